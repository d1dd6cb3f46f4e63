"""``preft eval gpu --engine hf`` (``make gpu-check-hf``): the GPU check for a machine with torch,
Triton, transformers and PEFT but no vLLM and no TRL, run from a copy of the tree with
``PYTHONPATH`` set (nothing installed, nothing downloaded). Parts (``--parts``), each timed, each
recorded even when another fails:

1. ``kernels``: the Triton LoRA shrink/expand and ReFT-P edit kernels against their torch
   references at Llama-3.1-8B layer shapes (one prefill step of 2048 rows in 32 segments of 64
   adapter slots, hidden 4096, q/k/v outputs 4096/1024/1024, rank 16, bfloat16): the largest
   error relative to the reference's largest value (within :data:`KERNEL_TOLERANCE`), and each
   timed with ``triton.testing.do_bench``;
2. ``calibrate``: :mod:`preft.eval.calibrate` (matmul FLOP/s, copy bandwidth, a decode and a
   prefill step of the 1B Llama): the roofline's hardware refitted and its error on those steps;
3. ``hf-generate``: :mod:`preft.eval.bench.hf_generate` in bfloat16 on the random-init 0.5B and
   1B Llamas at N = 1 / 64 rows of N different adapters (``--adapters``; PEFT builds 512 adapters
   in about two minutes a variant on an H200, more than a lent machine's quarter hour allows):
   base vs PEFT's all-token LoRA mixed batch vs LoRA-P vs LoReFT-P. A model not started within
   ``--budget-s`` is skipped.

Each finished part is written at once, so a machine taken back mid-run keeps what finished.

Writes ``OUT/gpu_hf/results.json`` and ``gpu_hf.md``; ``--write-docs`` also puts the section, named
after the GPU, into docs/RESULTS.md. Exits 2 with one line where there is no GPU, unless
``--allow-cpu`` (with ``--tiny``: small shapes and models, Triton's interpreter, the test of this
module).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

PARTS = ("kernels", "calibrate", "hf-generate")  # the longest last: the budget skips it, not the others
#: largest |kernel − reference| over the reference's largest |value|
KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2 ** -6}
SHAPES = {"8b": {"rows": 2048, "segments": 32, "slots": 64, "hidden": 4096, "outputs": (4096, 1024, 1024), "rank": 16},
          "tiny": {"rows": 48, "segments": 6, "slots": 4, "hidden": 64, "outputs": (64, 32, 32), "rank": 4}}


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.float() - reference.float()).abs().max() / reference.float().abs().max().clamp(min=1e-12))


def kernels(device: str, dtype: torch.dtype, shape: dict) -> dict[str, Any]:
    """Parity and (on CUDA) time of each Triton kernel against its torch reference."""
    from preft.kernels.lora_tiles import triton_planned_lora_linear
    from preft.kernels.reft_tiles import triton_reft_edit
    from preft.serving import lora_ops
    from preft.serving.reft import reft_edit
    from preft.serving.tile_plan import build_tile_plan

    torch.manual_seed(0)
    rows, hidden, rank, slots, outputs = shape["rows"], shape["hidden"], shape["rank"], shape["slots"], shape["outputs"]
    segment = rows // shape["segments"]
    indices = (torch.arange(shape["segments"], device=device).repeat_interleave(segment) * 7) % slots
    plan = build_tile_plan(indices)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden, device=device, dtype=dtype) / hidden ** 0.5 for _ in outputs)
    lora_b = tuple(torch.randn(slots, 1, out, rank, device=device, dtype=dtype) / rank ** 0.5 for out in outputs)
    weights = lora_ops.PlannedLoraWeights(lora_a, lora_b, outputs)
    bank = torch.randn(slots, 2 * rank, hidden, device=device) / hidden ** 0.5
    bias, sign = torch.randn(slots, rank, device=device), torch.ones(slots, device=device)
    residual = torch.randn_like(x)

    def lora(fn):
        y = torch.zeros(rows, sum(outputs), device=device, dtype=dtype)
        fn(y, x, plan, weights, 1.0)
        return y

    def reft(fn):
        edited = x.clone()
        fn(edited, residual, plan, bank, bias, sign, rank)
        return edited

    errors = {"lora_qkv": relative_error(lora(triton_planned_lora_linear), lora(lora_ops.planned_lora_linear)),
              "reft": relative_error(reft(triton_reft_edit), reft(reft_edit))}
    tolerance = KERNEL_TOLERANCE[dtype]
    result = {"shape": {**shape, "outputs": list(outputs)}, "dtype": str(dtype).removeprefix("torch."),
              "relative_error": errors, "tolerance": tolerance, "passed": all(e <= tolerance for e in errors.values())}
    if device == "cuda":  # interpreter timings on CPU would mean nothing
        from triton.testing import do_bench

        y = torch.zeros(rows, sum(outputs), device=device, dtype=dtype)
        edited = x.clone()
        timings = {"lora_qkv_triton_ms": do_bench(lambda: triton_planned_lora_linear(y, x, plan, weights, 1.0)),
                   "lora_qkv_torch_ms": do_bench(lambda: lora_ops.planned_lora_linear(y, x, plan, weights, 1.0)),
                   "reft_triton_ms": do_bench(lambda: triton_reft_edit(edited, residual, plan, bank, bias, sign, rank)),
                   "reft_torch_ms": do_bench(lambda: reft_edit(edited, residual, plan, bank, bias, sign, rank))}
        result["timings"] = {key: round(value, 4) for key, value in timings.items()}
    return result


def hf_generate(models: list[str], adapters: str, prompt_tokens: int, output_tokens: int, rounds: int,
                deadline: float) -> dict:
    """One benchmark per model, in order; a model not started by ``deadline`` is recorded as skipped."""
    from preft.eval.bench import hf_generate as bench

    runs, skipped = [], []
    for name in models:
        if time.time() > deadline:
            skipped.append(name)
            continue
        runs.append(bench.run(model=name, adapters=adapters, prompt_tokens=prompt_tokens,
                              output_tokens=output_tokens, rounds=rounds))
    return {"runs": runs, "skipped_models": skipped, "passed": True}


def report(result: dict) -> str:
    from preft.eval.bench import hf_generate as generate
    from preft.eval.calibrate import markdown as calibrate_markdown

    lines = [f"## The torch-only GPU check (`preft eval gpu --engine hf`): {result['device']}", "",
             f"Command: `{result['command']}`; torch {result['torch']}, Triton {result['triton']}; "
             f"{result['wall_time_s']:.0f} s in all. Random-init models built from configs, random adapters.", ""]
    for part in result["parts"]:
        outcome = result.get(part)
        if outcome is None:
            continue
        if "error" in outcome:
            lines += [f"**{part}**: failed: `{outcome['error']}`", ""]
        elif part == "kernels":
            s, e = outcome["shape"], outcome["relative_error"]
            lines += [f"**Triton kernels vs their torch references** ({s['rows']} rows in {s['segments']} segments of "
                      f"{s['slots']} slots, hidden {s['hidden']}, q/k/v outputs {'/'.join(map(str, s['outputs']))}, "
                      f"rank {s['rank']}, {outcome['dtype']}): relative error LoRA q/k/v {e['lora_qkv']:.1e}, ReFT-P "
                      f"{e['reft']:.1e} (tolerance {outcome['tolerance']:.1e}).", ""]
            if "timings" in outcome:
                t = outcome["timings"]
                lines += [f"Time: LoRA q/k/v Triton {t['lora_qkv_triton_ms']:.3f} ms vs torch "
                          f"{t['lora_qkv_torch_ms']:.3f} ms; ReFT-P Triton {t['reft_triton_ms']:.3f} ms vs torch "
                          f"{t['reft_torch_ms']:.3f} ms.", ""]
        elif part == "hf-generate":
            for run in outcome["runs"]:
                lines += [f"**HF generate with N users' adapters in one batch**: {generate.describe(run)}", "",
                          *generate.table(run), ""]
            if outcome.get("skipped_models"):
                lines += [f"**hf-generate**: {', '.join(outcome['skipped_models'])} not run (the time budget was "
                          "spent)", ""]
        elif part == "calibrate":
            lines += [calibrate_markdown(outcome), ""]
    for part, why in result.get("skipped", {}).items():
        lines += [f"**{part}**: not run ({why})", ""]
    return "\n".join(lines)


def main(parts: str = ",".join(PARTS), models: str = "0.5B,1B", adapters: str = "1,64", prompt_tokens: int = 64,
         output_tokens: int = 32, rounds: int = 2, budget_s: float = 420.0, tiny: bool = False,
         allow_cpu: bool = False, write_docs: bool = False, out: str = "runs/gpu_check",
         command: str = "preft eval gpu --engine hf") -> dict[str, Any]:
    import triton

    from preft.eval.calibrate import calibrate
    from preft.eval.gpu import GpuCheckError, device_name, finish, run_parts, save_partial

    started = time.time()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not allow_cpu:
        raise GpuCheckError("preft eval gpu --engine hf needs a CUDA GPU and found none (torch.cuda.is_available() "
                            "is False); --allow-cpu --tiny runs the same code on CPU")
    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown --parts {unknown} for --engine hf: choose from {', '.join(PARTS)}")
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model_list = ["default"] if tiny else [m.strip() for m in models.split(",") if m.strip()]
    result: dict[str, Any] = {"command": command, "device": device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "parts": chosen, "skipped": {}}
    def run_part(part: str) -> dict:
        if part == "kernels":
            return kernels(device, dtype, SHAPES["tiny" if tiny else "8b"])
        if part == "hf-generate":
            return hf_generate(model_list, "1,4" if tiny else adapters, 8 if tiny else prompt_tokens,
                               4 if tiny else output_tokens, 1 if tiny else rounds, started + budget_s)
        sizes = {"matmul_n": 256, "copy_bytes": 1 << 24, "context": 32, "prefill": 32, "repeats": 3} if tiny else {}
        return calibrate("tiny" if tiny else "1B", **sizes)

    root = Path(out) / "gpu_hf"
    run_parts(result, chosen, run_part, budget_s, started, "gpu hf",
              save=lambda r: save_partial(root, "gpu_hf", r, report(r)))
    return finish(result, chosen, root, "gpu_hf", report(result),
                  "gpu_check_hf" if write_docs else None)
