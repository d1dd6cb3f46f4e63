"""What ``preft serve --tensor-parallel-size T --pipeline-parallel-size P`` checks and sets.

vLLM runs ``T · P`` worker processes. Before start-up, one clear line for what vLLM would
refuse later with a traceback:

- ``T`` must divide the model's attention heads, and its KV heads must divide by ``T`` or
  ``T`` by them (vLLM shards heads, or replicates KV heads when there are fewer than ``T``);
- ``P`` cannot exceed the model's layers;
- on CPU, each worker needs a core of its own.

On CPU vLLM's automatic thread binding asserts one NUMA node per worker, which a small machine
does not have. ``preft serve`` therefore splits the cores it may use
(``os.sched_getaffinity``) into ``T · P`` equal groups and passes them as
``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"`` on 2 cores), unless the user set it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def parallel_problem(config: dict, tensor: int, pipeline: int, cores: int | None) -> str | None:
    """Why this model cannot run at these sizes, or None."""
    if tensor < 1 or pipeline < 1:
        return "--tensor-parallel-size and --pipeline-parallel-size must be >= 1"
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    layers = config.get("num_hidden_layers")
    if heads and heads % tensor:
        return (f"--tensor-parallel-size {tensor} does not divide the model's {heads} attention heads "
                f"(choose a size that does)")
    if kv_heads and tensor > 1 and kv_heads % tensor and tensor % kv_heads:
        return f"--tensor-parallel-size {tensor} and the model's {kv_heads} KV heads: neither divides the other"
    if layers and pipeline > layers:
        return f"--pipeline-parallel-size {pipeline} is more than the model's {layers} layers"
    if cores is not None and tensor * pipeline > cores:
        return (f"{tensor * pipeline} parallel workers need a CPU core each; this process may use {cores} "
                f"(os.sched_getaffinity)")
    return None


def check_parallel(base_dir: Path, tensor: int, pipeline: int, on_cpu: bool) -> None:
    from preft.bundle import BundleError

    config = json.loads((Path(base_dir) / "config.json").read_text())
    cores = len(os.sched_getaffinity(0)) if on_cpu else None
    problem = parallel_problem(config, tensor, pipeline, cores)
    if problem:
        raise BundleError(problem)


def cpu_thread_binding(workers: int, cores: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` workers over ``cores``: equal contiguous groups,
    ``|``-separated (``"0|1"``; ``"0-3|4-7"``); the cores left over by the division stay unused."""
    if workers < 1 or len(cores) < workers:
        raise ValueError(f"{workers} workers need at least {workers} cores, got {len(cores)}")
    cores = sorted(cores)
    share = len(cores) // workers
    groups = []
    for index in range(workers):
        group = cores[index * share:(index + 1) * share]
        contiguous = group[-1] - group[0] == len(group) - 1
        groups.append(f"{group[0]}-{group[-1]}" if contiguous and len(group) > 1
                      else ",".join(map(str, group)))
    return "|".join(groups)
