"""The ``sgl_kernel`` stand-in (``serving/sglang/standin``) in SGLang's venv: its
``assign_req_to_token_pool_cpu`` writes what SGLang's own Triton kernel for the same assignment
(``assign_req_to_token_pool``, the path SGLang takes on a GPU; run here in Triton's interpreter)
writes, on uneven batches; any other name fails loudly naming itself; and SGLang picks the
stand-in up (its allocator imports it on the CPU)."""

from __future__ import annotations

import subprocess

import pytest

from preft import envs

pytestmark = pytest.mark.sglang

SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang on the CPU: its allocator imports the stand-in
import torch, sgl_kernel
from sglang.srt.mem_cache import allocation
from sglang.srt.utils import next_power_of_2

assert sgl_kernel.STANDIN and allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu
torch.manual_seed(0)
for batch, pool_len in ((1, 16), (3, 40), (7, 64)):
    rows = torch.randperm(10)[:batch]
    starts = torch.randint(0, pool_len // 2, (batch,))
    ends = starts + torch.randint(0, pool_len // 2, (batch,))
    locs = torch.randint(1, 10**6, (int((ends - starts).sum()),))
    mine, theirs = (torch.zeros(10, pool_len, dtype=torch.int32) for _ in range(2))
    sgl_kernel.assign_req_to_token_pool_cpu(rows, mine, starts, ends, locs, pool_len)
    allocation.assign_req_to_token_pool[(batch,)](rows, theirs, starts, ends, locs, pool_len, next_power_of_2(batch))
    assert torch.equal(mine, theirs), (batch, mine, theirs)
    assert int((mine != 0).sum()) == len(locs)
try:
    sgl_kernel.copy_all_layer_kv_cache_cpu()
except NotImplementedError as err:
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu" in str(err)
else:
    raise AssertionError("an uncovered name computed something")
print("ok")
"""


def test_standin_assigns_as_sglangs_kernel_does():
    done = subprocess.run([envs.PREFT_SGLANG_PYTHON, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
