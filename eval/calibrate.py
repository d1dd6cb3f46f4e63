"""`preft eval calibrate`: the roofline's hardware constants measured on the GPU at hand, and the
roofline's error on real steps. Torch alone (no vLLM): it is part of the torch-only GPU check
(``preft eval gpu --engine hf``) and runs by itself in about two minutes.

    preft eval calibrate [--model 1B] [--out runs/eval]

Measured, each the median of ``--repeats`` timed runs after a warm-up, in bfloat16 on CUDA:

- ``flops``: a ``n × n`` by ``n × n`` matmul (``n = 8192``), ``2 n³ / t``;
- ``bandwidth``: a device-to-device copy of 1 GiB, ``2 · bytes / t`` (read and written);
- steps of a random-init Llama (``--model``, built from a config, nothing downloaded) in HF:
  a decode step (one token after ``--context`` cached) at batch 1 and at batch 16, and a prefill
  of ``--prefill`` tokens at batch 1.

The hardware becomes :meth:`Hardware.calibrated(flops, bandwidth, overhead)
<preft.serving.scheduling.roofline.Hardware.calibrated>`, the overhead being what the batch-1
decode took beyond ``max(compute, memory)`` (HF's per-step Python and launches, larger than a
CUDA-graph engine's). The roofline of the model's shape (:meth:`ModelShape.from_config`) then
predicts every step, and ``error = predicted / measured − 1`` is reported: zero by construction
for the batch-1 decode (it sets the overhead), a real check for the other two. Writes
``OUT/calibrate/results.json`` (with the calibrated ``hardware``, usable in a plan) and
``calibrate.md``. Without a GPU it stops with one line unless ``--allow-cpu`` (with ``--tiny``,
the test's configuration).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

#: name -> (hidden, layers, heads, KV heads, intermediate, vocabulary)
MODELS = {"1B": (2048, 20, 16, 4, 5632, 32000), "0.5B": (1280, 24, 20, 4, 3456, 32000),
          "tiny": (128, 2, 4, 2, 256, 1024)}


class NoGpuError(ValueError):
    """No CUDA GPU and no ``--allow-cpu``: the CLI prints it as one line and exits 2."""


def timed(run, device: str, repeats: int) -> float:
    """The median seconds of ``run()`` over ``repeats`` runs after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(device: str, dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, device, repeats)


def copy_bandwidth(device: str, size_bytes: int, repeats: int) -> float:
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * size_bytes / timed(lambda: target.copy_(source), device, repeats)


@torch.no_grad()
def model_steps(model, device: str, context: int, prefill: int, repeats: int) -> dict[str, float]:
    """Seconds of a decode step at batch 1 and 16 after ``context`` cached tokens, and of a prefill."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    steps = {}
    for batch in (1, 16):
        ids = torch.randint(0, vocab, (batch, context), device=device)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = torch.randint(0, vocab, (batch, 1), device=device)
        position = torch.full((batch, 1), context, device=device)

        def decode():
            model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True)
            cache.crop(-1)  # the next run decodes the same position again
        steps[f"decode_b{batch}"] = timed(decode, device, repeats)
    prompt = torch.randint(0, vocab, (1, prefill), device=device)
    steps["prefill"] = timed(lambda: model(input_ids=prompt, use_cache=False), device, repeats)
    return steps


def calibrate(model_name: str = "1B", context: int = 256, prefill: int = 256, repeats: int = 10,
              matmul_n: int = 8192, copy_bytes: int = 1 << 30, device: str | None = None) -> dict[str, Any]:
    """The measurements and the roofline's error (module docstring), as a dict."""
    from preft.models import random_llama
    from preft.serving.scheduling.roofline import Hardware, ModelShape, RooflineCostModel

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    flops = matmul_flops(device, dtype, matmul_n, repeats)
    bandwidth = copy_bandwidth(device, copy_bytes, repeats)
    hidden, layers, heads, kv_heads, intermediate, vocab = MODELS[model_name]
    model = random_llama(vocab, hidden, layers, heads, kv_heads, intermediate)
    model.config.max_position_embeddings = max(context, prefill) + 8
    model = model.to(device=device, dtype=dtype).eval()
    shape = ModelShape.from_config(model.config.to_dict(), name=f"random Llama {model_name}")
    shape = replace(shape, bytes_per_value=torch.finfo(dtype).bits // 8)
    measured = model_steps(model, device, context, prefill, repeats)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    bare = RooflineCostModel(shape, Hardware(name, flops, bandwidth, 1.0, 1.0, step_overhead_s=0.0))
    overhead = max(0.0, measured["decode_b1"] - bare.step(1, 0, decode_context=context))
    hardware = Hardware(name, flops, bandwidth, 1.0, 1.0, step_overhead_s=overhead,
                        source=f"measured by preft eval calibrate ({name}, HF eager steps)")
    roofline = RooflineCostModel(shape, hardware)
    predicted = {"decode_b1": roofline.step(1, 0, decode_context=context),
                 "decode_b16": roofline.step(16, 0, decode_context=16 * context),
                 "prefill": roofline.step(0, prefill)}
    steps = [{"step": key, "measured_ms": 1e3 * measured[key], "predicted_ms": 1e3 * predicted[key],
              "error": predicted[key] / measured[key] - 1, "fitted": key == "decode_b1"} for key in measured]
    return {"device": name, "dtype": str(dtype).removeprefix("torch."), "flops": flops, "bandwidth": bandwidth,
            "step_overhead_s": overhead, "hardware": asdict(hardware), "model": asdict(shape),
            "parameters": sum(p.numel() for p in model.parameters()), "context": context, "prefill": prefill,
            "steps": steps, "passed": True}


def markdown(result: dict) -> str:
    lines = [f"**Roofline calibration** on {result['device']} ({result['dtype']}): matmul "
             f"{result['flops'] / 1e12:.1f} TFLOP/s, copy {result['bandwidth'] / 1e9:.0f} GB/s, per-step overhead "
             f"{1e3 * result['step_overhead_s']:.2f} ms (HF eager). Steps of a random-init Llama of "
             f"{result['parameters'] / 1e9:.2f}B parameters ({result['context']} tokens of context, a "
             f"{result['prefill']}-token prefill):", "",
             "| step | measured | roofline | error |", "|---|---|---|---|"]
    for s in result["steps"]:
        error = "fitted (sets the overhead)" if s["fitted"] else f"{100 * s['error']:+.0f}%"
        lines.append(f"| {s['step']} | {s['measured_ms']:.2f} ms | {s['predicted_ms']:.2f} ms | {error} |")
    return "\n".join(lines) + "\n"


def main(model: str = "1B", context: int = 256, prefill: int = 256, repeats: int = 10, tiny: bool = False,
         allow_cpu: bool = False, out: str = "runs/eval") -> dict[str, Any]:
    import inspect

    from preft.eval.results import command_line, save_run

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    if not torch.cuda.is_available() and not allow_cpu:
        raise NoGpuError("preft eval calibrate needs a CUDA GPU and found none (torch.cuda.is_available() is False); "
                         "--allow-cpu --tiny runs the same code on CPU")
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose from {', '.join(MODELS)}")
    if min(context, prefill, repeats) < 1:
        raise ValueError("--context, --prefill and --repeats must be >= 1")
    sizes = {"matmul_n": 256, "copy_bytes": 1 << 24} if tiny else {}
    result = {"command": command_line("calibrate", main, values),
              **calibrate("tiny" if tiny else model, context, prefill, repeats, **sizes)}
    save_run(Path(out) / "calibrate", "calibrate", result, markdown(result))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "the random-init Llama whose steps are timed (1B, 0.5B)"),
        ("--context", int, "cached tokens before each timed decode step"),
        ("--prefill", int, "tokens of the timed prefill"),
        ("--repeats", int, "timed runs per measurement (the median is kept)"),
        ("--tiny", bool, "a tiny model and small sizes (the CPU test of this command)"),
        ("--allow-cpu", bool, "run without a GPU (float32)"),
        ("--out", str, "results directory"),
    ])
