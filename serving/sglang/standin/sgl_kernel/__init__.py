"""A stand-in for SGLang's kernel package on a CPU without its build (PyPI has no CPU wheel of
``sgl_kernel``), for sglang 0.5.23 served with ``--attention-backend torch_native``.

SGLang's CPU path imports a few names from ``sgl_kernel`` at module level. Without the compiled
ops registered, SGLang's AMX check fails and its layers run their plain-torch ``forward_native``;
the one name it still calls is :func:`assign_req_to_token_pool_cpu` (the KV allocator, on every
request), written here in plain torch. Every other name imports but raises if called, naming
itself, so a code path this stand-in does not cover fails loudly instead of computing nothing.

Installed into ``.venv-sglang`` by ``make sglang`` (a ``.pth`` file); tested against SGLang's own
Triton kernel for the same assignment in ``tests/sglang/test_sgl_kernel_standin.py``.
"""

from __future__ import annotations

import torch

STANDIN = True  # what the tests and `preft serve --engine sglang` check for


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + end[i] - start[i]]``
    with ``o_i = sum_{j<i} (end[j] - start[j])``: the KV slots allocated to each request of a batch,
    laid out one request after another in ``out_cache_loc``, written into its row of the pool."""
    del pool_len  # the row length; req_to_token's shape already says it
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends):
        req_to_token[row, start:end] = out_cache_loc[offset: offset + end - start].to(req_to_token.dtype)
        offset += end - start


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in preft's CPU stand-in for SGLang's kernel package: "
                                  "this SGLang code path needs the compiled kernels")

    missing.__name__ = name
    return missing
