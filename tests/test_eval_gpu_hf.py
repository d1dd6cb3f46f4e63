"""The torch-only GPU check (`preft eval gpu --engine hf`) from a source tree on PYTHONPATH, with
vLLM and TRL hidden and preft not installed: its tiny CPU configuration passes every part."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HIDE = """
import importlib.abc, runpy, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("vllm", "trl"):
            raise ImportError(name + " is hidden")
sys.meta_path.insert(0, Hide())
sys.argv = ["preft", *sys.argv[1:]]
try:
    runpy.run_module("preft", run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm", "trl")], "vLLM or TRL was imported"
    print("no vllm, no trl", flush=True)
"""


def run_uninstalled(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``preft ARGS`` as a torch-only machine runs it: ``python -S`` (no site, so no installed preft),
    the tree and the libraries on PYTHONPATH, vLLM and TRL hidden, Triton's interpreter on CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *site.getsitepackages()]),
           "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-S", "-c", HIDE, *args], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)


def test_the_torch_only_check_runs_every_part_from_the_source_tree(tmp_path):
    done = run_uninstalled(tmp_path, "eval", "gpu", "--engine", "hf", "--allow-cpu", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "no vllm, no trl" in done.stdout
    result = json.loads((tmp_path / "gpu_hf" / "results.json").read_text())
    assert result["parts"] == ["kernels", "hf-generate", "calibrate"] and result["passed"]
    assert max(result["kernels"]["relative_error"].values()) <= result["kernels"]["tolerance"]
    run = result["hf-generate"]["runs"][0]
    assert set(run["summary"]) == {"base", "PEFT LoRA (all-token)", "LoRA-P", "LoReFT-P"}
    assert all(rate > 0 for row in run["summary"].values() for rate in row["tokens_per_s"].values())
    assert {s["step"] for s in result["calibrate"]["steps"]} == {"decode_b1", "decode_b16", "prefill"}
    text = (tmp_path / "gpu_hf" / "gpu_hf.md").read_text()
    assert "Triton kernels vs their torch references" in text and "Roofline calibration" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit is for machines without one")
def test_without_a_gpu_it_exits_2_with_one_line(tmp_path):
    done = run_uninstalled(tmp_path, "eval", "gpu", "--engine", "hf", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_vllm_argument_with_the_hf_engine_is_refused(tmp_path):
    from preft.eval import gpu

    with pytest.raises(ValueError, match="--prompt-tokens is an argument of --engine vllm"):
        gpu.main(engine="hf", prompt_tokens=64, allow_cpu=True, tiny=True, out=str(tmp_path))
    with pytest.raises(ValueError, match="--engine 'sglang'"):
        gpu.main(engine="sglang")
