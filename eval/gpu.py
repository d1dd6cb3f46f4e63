"""``preft eval gpu`` (``make gpu-check``): the GPU path in one short run on one CUDA GPU.

Nothing is downloaded: the models are random-init Llamas built from configs, the adapters
random PEFT adapters exported here. Parts (``--parts``), each timed, each recorded even when
another fails; the exit status is non-zero if any part failed:

1. ``parity``: on each model (about 0.5B and 1B parameters), one engine (bfloat16, the plugin
   and its scheduler) serves LoRA-P, ReFT-P and base requests over a fixed prompt set. HF
   (bfloat16, the same adapters under PreFT's prefill mask) scores the engine's tokens by
   teacher forcing. A request passes when its tokens equal HF's greedy tokens, or where they
   first differ HF had a near tie (the engine's token within ``--tolerance`` nats of HF's
   best), and the log-probs of the agreed tokens match within ``--tolerance``. As a control,
   the same tokens scored with the adapter on every token (the all-token rule) must miss by
   more than the tolerance for LoRA-P, or the check could not fail.
2. ``kernels``: ``tests/test_kernels.py`` on the GPU (compiled Triton, not the interpreter), and
   each kernel timed against its torch reference on one prefill step's shape.
3. ``throughput``: base / stock multi-LoRA (all-token, vLLM's punica kernels) / LoRA-P / ReFT-P
   at 1, 64 and 512 adapters, 512 prompts of 128 tokens, 128 output tokens, on the 0.5B model
   (:mod:`preft.eval.bench.throughput`'s interleaved rounds; eager engines, as ``preft serve``
   runs them).

Writes ``OUT/gpu/results.json`` and ``OUT/gpu/gpu.md``; ``--write-docs`` also puts the section
(with the GPU's name) into ``docs/RESULTS.md``. Without a GPU it stops at once with one line,
unless ``--allow-cpu`` (the test suite runs the same code on CPU with ``--tiny`` models).
"""

from __future__ import annotations

import functools
import inspect
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

#: name -> (hidden, layers, heads, KV heads, intermediate); the vocabulary is the default model's
MODELS = {
    "0.5B": (1280, 24, 20, 4, 3456),
    "1B": (2048, 20, 16, 4, 5632),
    "tiny": (128, 2, 4, 2, 256),  # --tiny: the CPU test of this module
}
TOLERANCE = 0.1
PROMPTS = ["add 12 35 =", "the quiet cat sat on the old red mat and", "sort 8 2 1 9 4 =", "rewrite the dog ran home =",
           "b=4 ; c=7 ; b =", "the happy bird flew over the river and the"]


class GpuCheckError(ValueError):
    """No GPU, or a part failed: the CLI prints it as one line and exits non-zero."""


@functools.lru_cache(maxsize=None)
def build_model(name: str, root: Path, dtype: torch.dtype) -> tuple[str, int]:
    """A random-init Llama ``name`` saved with the default tokenizer under ``root``; (dir, parameters).
    Built once per run: the parity and throughput parts share the 0.5B model."""
    from transformers import AutoTokenizer

    import preft
    from preft.models import random_llama

    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    hidden, layers, heads, kv_heads, intermediate = MODELS[name]
    model = random_llama(len(tokenizer), hidden, layers, heads, kv_heads, intermediate).to(dtype)
    path = root / f"base_{name}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())


def make_adapters(base: str, root: Path, rank: int) -> dict[str, str]:
    """One random LoRA-P and one random ReFT-P adapter (saved PEFT dirs), with their bundles."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import preft
    from preft.constants import ALL_PROJECTIONS
    from preft.export import export_adapter

    configs = {"lora_p": preft.PreftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ALL_PROJECTIONS),
                                               init_lora_weights=False),
               "reft_p": preft.PreftReftConfig(rank=rank, init_weights=False)}
    paths = {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(100 + seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
        with torch.no_grad():  # random inits are mild; make the edit show in the log-probs
            for key, param in model.named_parameters():
                if "lora_B" in key or "reft_source" in key:
                    param.mul_(4.0)
        model.save_pretrained(root / name)
        export_adapter(root / name, base, root / f"{name}.bundle")
        paths[name] = str(root / name)
    return paths


@torch.no_grad()
def hf_scores(model, tokenizer, prompt: str, tokens: list[int], prompt_lengths: int | None, device) -> dict:
    """HF's greedy tokens for ``prompt`` and its log-probs of ``tokens`` (teacher forcing, the
    adapter on positions ``< prompt_lengths``, or on every position when None)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    full = torch.cat([ids, torch.tensor([tokens], device=device)], dim=1)
    extra = {} if prompt_lengths is None else {"prompt_lengths": [prompt_lengths]}
    logits = model(input_ids=full, **extra).logits[0, ids.shape[1] - 1: -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return {"logprobs": chosen.tolist(), "best": logprobs.max(dim=1).values.tolist(),
            "greedy": logprobs.argmax(dim=1).tolist()}


def judge(engine_tokens: list[int], engine_logprobs: list[float], hf: dict, tolerance: float) -> dict:
    """Pass/fail of one request (see the module docstring), with the worst log-prob gap."""
    agreed = next((i for i, (a, b) in enumerate(zip(engine_tokens, hf["greedy"])) if a != b), len(engine_tokens))
    gaps = [abs(a - b) for a, b in zip(engine_logprobs[:agreed], hf["logprobs"][:agreed])]
    near_tie = agreed == len(engine_tokens) or hf["best"][agreed] - hf["logprobs"][agreed] <= tolerance
    worst = max(gaps, default=0.0)
    return {"tokens_equal": agreed == len(engine_tokens), "first_difference": None if agreed == len(engine_tokens)
            else agreed, "worst_logprob_gap": worst, "passed": near_tie and worst <= tolerance}


def parity(model_name: str, root: Path, dtype: torch.dtype, device: str, tolerance: float, new_tokens: int,
           engine_extra: dict) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import preft  # noqa: F401 - registers the PreFT PEFT types
    from preft.eval.harness.engine_driver import EngineProcess

    base, parameters = build_model(model_name, root, dtype)
    adapters = make_adapters(base, root, rank=16 if model_name != "tiny" else 4)
    tokenizer = AutoTokenizer.from_pretrained(base)
    entries = {None: {}, "lora_p": {"lora": ["lora_p", 1, adapters["lora_p"] + ".bundle"]},
               "reft_p": {"reft": adapters["reft_p"] + ".bundle"}}
    requests = [{"prompt": prompt, **entries[name]} for prompt in PROMPTS for name in entries]
    engine = {"dtype": str(dtype).removeprefix("torch."), "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
              "max_model_len": 256, **engine_extra}
    with EngineProcess(base, engine, log_path=root / f"parity_{model_name}.log") as driver:
        served = driver.generate(requests, new_tokens, logprobs=True)
    results, control_gaps = [], []
    models = {}
    for request, tokens, logprobs in zip(requests, served["tokens"], served["logprobs"]):
        name = request["lora"][0] if "lora" in request else "reft_p" if "reft" in request else None
        if name not in models:
            loaded = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
            models[name] = (PeftModel.from_pretrained(loaded, adapters[name]) if name else loaded).eval()
        prompt_length = len(tokenizer(request["prompt"])["input_ids"])
        hf = hf_scores(models[name], tokenizer, request["prompt"], tokens, prompt_length if name else None, device)
        verdict = judge(tokens, logprobs, hf, tolerance)
        if name == "lora_p":  # the control: the same tokens with the adapter on every token
            control = hf_scores(models[name], tokenizer, request["prompt"], tokens, prompt_length + new_tokens, device)
            control_gaps.append(max(abs(a - b) for a, b in zip(logprobs, control["logprobs"])))
        results.append({"adapter": name or "base", "prompt": request["prompt"], **verdict})
    control = max(control_gaps)
    passed = all(r["passed"] for r in results) and control > tolerance
    return {"model": model_name, "parameters": parameters, "requests": results, "passed": passed,
            "tokens_equal": sum(r["tokens_equal"] for r in results), "control_worst_gap": control,
            "worst_logprob_gap": max(r["worst_logprob_gap"] for r in results)}


def kernel_timings() -> dict:
    """On CUDA: each Triton kernel against its torch reference on one prefill step's shape (2048
    rows in 32 segments of 64 adapters, hidden 1280, rank 16), ``triton.testing.do_bench`` ms."""
    from triton.testing import do_bench

    from preft.kernels.lora_tiles import triton_planned_lora_linear
    from preft.kernels.reft_tiles import triton_reft_edit
    from preft.serving import lora_ops
    from preft.serving.reft import reft_edit
    from preft.serving.tile_plan import build_tile_plan

    torch.manual_seed(0)
    rows, hidden, rank, slots = 2048, 1280, 16, 64
    indices = torch.arange(32, device="cuda").repeat_interleave(rows // 32) % slots
    plan = build_tile_plan(indices)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(rows, 3 * hidden, device="cuda", dtype=torch.bfloat16)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lora_b = tuple(torch.randn(slots, 1, hidden, rank, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    weights = lora_ops.PlannedLoraWeights(lora_a, lora_b, (hidden,) * 3)
    bank = torch.randn(slots, 2 * rank, hidden, device="cuda") / hidden ** 0.5
    bias, sign = torch.randn(slots, rank, device="cuda"), torch.ones(slots, device="cuda")
    residual = torch.randn_like(x)
    timings = {
        "lora_qkv_triton_ms": do_bench(lambda: triton_planned_lora_linear(y, x, plan, weights, 1.0)),
        "lora_qkv_torch_ms": do_bench(lambda: lora_ops.planned_lora_linear(y, x, plan, weights, 1.0)),
        "reft_triton_ms": do_bench(lambda: triton_reft_edit(x, residual, plan, bank, bias, sign, rank)),
        "reft_torch_ms": do_bench(lambda: reft_edit(x, residual, plan, bank, bias, sign, rank)),
    }
    return {key: round(value, 4) for key, value in timings.items()}


def kernels(device: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "tests/test_gpu_path.py"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    tail = (done.stdout + done.stderr).strip().splitlines()
    result = {"passed": done.returncode == 0, "summary": tail[-1] if tail else "", "device": device,
              "output_tail": "\n".join(tail[-30:])}
    if device == "cuda":  # interpreter timings on CPU would mean nothing
        result["timings"] = kernel_timings()
    return result


def throughput(model_name: str, root: Path, counts: list[int], prompts: int, prompt_tokens: int, output_tokens: int,
               rounds: int, variants: list[str], engine_extra: dict) -> dict:
    from transformers import AutoTokenizer

    import preft
    from preft.eval.bench import throughput as bench

    base, parameters = build_model(model_name, root, torch.bfloat16 if engine_extra.get("dtype") == "bfloat16"
                                   else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    rank = 16
    lora = lambda: preft.PreftLoraConfig(r=rank, target_modules=bench.TARGETS, init_lora_weights=False)  # noqa: E731
    reft = lambda: preft.PreftReftConfig(rank=rank, init_weights=False)  # noqa: E731
    spec = {"model": base, "adapter_counts": counts, "rank": rank, "engine": engine_extra, "variants": variants,
            "prompts": bench.prompts_of(tokenizer, prompts, prompt_tokens), "output_tokens": output_tokens,
            "bundles": bench.make_bundles(base, max(counts), lora, root, "lora_p"),
            "reft_bundles": bench.make_bundles(base, max(counts), reft, root, "reft_p")}
    measured = bench.measure(spec, root, rounds)
    keys = [str(c) for c in counts]
    return {"model": model_name, "parameters": parameters, "adapter_counts": keys, "prompts": prompts,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "rounds": rounds,
            "summary": bench.summarize(measured, keys, variants), "rounds_measured": measured, "passed": True}


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no GPU)"


def report(result: dict) -> str:
    lines = [f"## The GPU path (`make gpu-check`): {result['device']}", "",
             f"Command: `{result['command']}`; vLLM {result['vllm']}, torch {result['torch']}; "
             f"{result['wall_time_s']:.0f} s in all. Random-init Llamas built from configs, random adapters.", ""]
    for part in result["parts"]:
        outcome = result.get(part)
        if outcome is None:  # skipped, or not reached yet
            continue
        if "error" in outcome:
            lines += [f"**{part}**: failed: `{outcome['error']}`", ""]
            continue
        if part == "parity":
            lines += ["**Parity with HF** (bfloat16; tokens equal, or a near tie where they first differ, and "
                      f"log-probs within {result['tolerance']} nats):", "",
                      "| model | parameters | requests passed | tokens equal | worst log-prob gap | all-token control |",
                      "|---|---|---|---|---|---|"]
            for run in outcome["runs"]:
                lines.append(f"| {run['model']} | {run['parameters'] / 1e9:.2f}B | "
                             f"{sum(r['passed'] for r in run['requests'])}/{len(run['requests'])} | "
                             f"{run['tokens_equal']}/{len(run['requests'])} | {run['worst_logprob_gap']:.3f} | "
                             f"{run['control_worst_gap']:.3f} |")
            lines.append("")
        elif part == "kernels":
            lines += [f"**Kernels vs their torch references** on {outcome['device']}: {outcome['summary']}", ""]
            if "timings" in outcome:
                t = outcome["timings"]
                lines += ["One prefill step (2048 rows in 32 segments of 64 adapters, hidden 1280, rank 16, bf16): "
                          f"LoRA q/k/v Triton {t['lora_qkv_triton_ms']:.3f} ms vs torch {t['lora_qkv_torch_ms']:.3f} ms; "
                          f"ReFT-P Triton {t['reft_triton_ms']:.3f} ms vs torch {t['reft_torch_ms']:.3f} ms.", ""]
        elif part == "throughput":
            counts = outcome["adapter_counts"]
            header = "N = " + " / ".join(counts)
            lines += [f"**Throughput**, {outcome['model']} model ({outcome['parameters'] / 1e9:.2f}B), "
                      f"{outcome['prompts']} prompts x {outcome['prompt_tokens']} tokens, {outcome['output_tokens']} "
                      f"out, rank-16 adapters, {outcome['rounds']} interleaved rounds (medians of per-round ratios):", "",
                      f"| variant | tok/s ({header}) | vs base | vs stock multi-LoRA |", "|---|---|---|---|"]
            for variant, values in outcome["summary"].items():
                rates = " / ".join(f"{values['tokens_per_s'][c]:.0f}" for c in counts)
                vs_base = " / ".join(f"{values['vs_base'][c]:.2f}x" for c in counts)
                vs_stock = " / ".join(f"{values['vs_stock'][c]:.2f}x" for c in counts) if "vs_stock" in values else "-"
                lines.append(f"| {variant} | {rates} | {vs_base} | {vs_stock} |")
            lines.append("")
    for part, why in result.get("skipped", {}).items():
        lines += [f"**{part}**: not run ({why})", ""]
    return "\n".join(lines)


def main(parts: str = "parity,kernels,throughput", models: str = "0.5B,1B", throughput_model: str = "0.5B",
         adapters: str = "1,64,512", variants: str = "base,stock all-token LoRA,LoRA-P,ReFT-P",
         prompts: int = 512, prompt_tokens: int = 128, output_tokens: int = 128,
         rounds: int = 2, tolerance: float = TOLERANCE, budget_s: float = 450.0, tiny: bool = False,
         allow_cpu: bool = False, write_docs: bool = False, out: str = "runs/gpu_check",
         engine: str = "vllm") -> dict[str, Any]:
    from preft.eval.results import command_line

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    if engine not in ("vllm", "hf"):
        raise ValueError(f"--engine {engine!r}: vllm (the engine, make gpu-check) or hf (torch only, make gpu-check-hf)")
    if engine == "hf":
        return hf_engine(values)
    started = time.time()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not allow_cpu:
        raise GpuCheckError("preft eval gpu needs a CUDA GPU and found none (torch.cuda.is_available() is False); "
                    "--allow-cpu --tiny runs the same code on CPU")
    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - {"parity", "kernels", "throughput"})
    if unknown:
        raise ValueError(f"unknown --parts {unknown}: choose from parity, kernels, throughput")
    model_list = ["tiny"] if tiny else [m.strip() for m in models.split(",")]
    for name in [*model_list, throughput_model]:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    counts = [int(c) for c in adapters.split(",")]
    if max(counts) > prompts:
        raise ValueError(f"--prompts {prompts} is fewer than --adapters {max(counts)}")
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # eager, as `preft serve` runs (ReFT-P's hooks are not captured by torch.compile or CUDA graphs)
    engine_extra = ({"dtype": "bfloat16", "gpu_memory_utilization": 0.85} if on_gpu else {"dtype": "float32"})
    from preft.eval.bench.throughput import VARIANTS

    variant_list = [v.strip() for v in variants.split(",") if v.strip()]
    if "base" not in variant_list or set(variant_list) - set(VARIANTS):
        raise ValueError(f"--variants {variants!r}: choose from {', '.join(VARIANTS)}, base included")
    root = Path(out) / "gpu"
    root.mkdir(parents=True, exist_ok=True)
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:  # the kernels part needs only torch and Triton; parity and throughput need vLLM
        vllm_version = "not installed"
    result: dict[str, Any] = {"command": command_line("gpu", main, values), "device": device_name(),
                              "vllm": vllm_version, "torch": torch.__version__, "tolerance": tolerance,
                              "parts": chosen, "skipped": {}}
    def run_part(part: str) -> dict:
        if part == "parity":
            runs = [parity(name, root, dtype, device, tolerance, 12, {}) for name in model_list]
            return {"runs": runs, "passed": all(r["passed"] for r in runs)}
        if part == "kernels":
            return kernels(device)
        return throughput("tiny" if tiny else throughput_model, root, counts, prompts, prompt_tokens, output_tokens,
                          rounds, variant_list, engine_extra)

    run_parts(result, chosen, run_part, budget_s, started, "gpu",
              save=lambda r: save_partial(root, "gpu", r, report(r)))
    return finish(result, chosen, root, "gpu", report(result), "gpu_check" if write_docs else None)


def run_parts(result: dict, parts: list[str], run_part, budget_s: float, started: float, label: str,
              save=None) -> None:
    """``result[part] = run_part(part)`` for each part in turn, a failure recorded (the other parts
    still run), a part not started once ``budget_s`` is spent recorded as skipped; then the wall
    time and whether every part that ran passed. ``save(result)`` after each part: a lent machine
    taken back mid-run keeps the parts that finished."""
    for part in parts:
        elapsed = time.time() - started
        if elapsed > budget_s:
            result["skipped"][part] = f"the time budget of {budget_s:.0f} s was spent ({elapsed:.0f} s)"
            continue
        print(f"[{label}] {part} ({elapsed:.0f} s so far)", flush=True)
        try:
            result[part] = run_part(part)
        except Exception as err:  # noqa: BLE001 - one part's failure is recorded; the others still run
            result[part] = {"passed": False, "error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()[-4000:]}
        if save is not None:
            result["wall_time_s"] = round(time.time() - started, 1)
            save(result)
    result["wall_time_s"] = round(time.time() - started, 1)
    result["passed"] = all(result[p]["passed"] for p in parts if p in result)


def save_partial(root: Path, name: str, result: dict, markdown: str) -> None:
    """``root/results.json`` and ``root/NAME.md`` of the parts finished so far."""
    from preft.eval.results import save_run

    save_run(root, name, result, markdown + "\n")


def finish(result: dict, parts: list[str], root: Path, name: str, markdown: str, docs_name: str | None) -> dict:
    """Write ``root/results.json`` and ``root/NAME.md`` (and the docs section ``docs_name``), then
    fail with one line naming the failed parts."""
    from preft.eval.results import write_result

    save_partial(root, name, result, markdown)
    if docs_name:
        write_result(docs_name, result, markdown)
    if not result["passed"]:
        failed = [p for p in parts if p in result and not result[p]["passed"]]
        raise GpuCheckError(f"{', '.join(failed)} failed (details in {root / 'results.json'})")
    return result


#: the arguments the torch-only check (:mod:`preft.eval.gpu_hf`) takes from this command; the
#: others are the vLLM engine's, refused with --engine hf rather than ignored
HF_ARGUMENTS = ("models", "adapters", "rounds", "budget_s", "tiny", "allow_cpu", "write_docs", "out")


def hf_engine(values: dict) -> dict[str, Any]:
    """``--engine hf``: :func:`preft.eval.gpu_hf.main` (no vLLM, no TRL)."""
    from preft.eval import gpu_hf
    from preft.eval.results import command_line, default_of

    vllm_only = [k for k, v in values.items() if k not in (*HF_ARGUMENTS, "parts", "engine")
                 and v != default_of(main, k)]
    if vllm_only:
        raise ValueError(f"--{vllm_only[0].replace('_', '-')} is an argument of --engine vllm; --engine hf takes "
                         f"--parts ({', '.join(gpu_hf.PARTS)}), " + ", ".join(f"--{k.replace('_', '-')}"
                                                                            for k in HF_ARGUMENTS))
    parts = values["parts"] if values["parts"] != default_of(main, "parts") else ",".join(gpu_hf.PARTS)
    return gpu_hf.main(parts=parts, **{k: values[k] for k in HF_ARGUMENTS},
                       command=command_line("gpu", main, values, always=("engine",)))


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--engine", str, "vllm: the engine's check (needs vLLM); hf: the torch-only check (kernels, hf-generate, "
                          "calibrate; no vLLM, no TRL)"),
        ("--parts", str, "comma-separated parts: parity, kernels, throughput (--engine hf: kernels, hf-generate, "
                         "calibrate; all by default)"),
        ("--models", str, "models of the parity part (0.5B, 1B); with --engine hf, of hf-generate"),
        ("--throughput-model", str, "model of the throughput part"),
        ("--adapters", str, "comma-separated adapter counts of the throughput part (--engine hf: of hf-generate)"),
        ("--variants", str, "comma-separated engines of the throughput part (bench throughput's names)"),
        ("--prompts", int, "requests per throughput run"),
        ("--prompt-tokens", int, "tokens per throughput prompt"),
        ("--output-tokens", int, "tokens generated per throughput request"),
        ("--rounds", int, "measured throughput rounds after a warm-up round"),
        ("--tolerance", float, "parity tolerance on log-probs and near ties, in nats"),
        ("--budget-s", float, "start no part after this many seconds"),
        ("--tiny", bool, "tiny models (the CPU test of this command)"),
        ("--allow-cpu", bool, "run without a GPU (float32; with --tiny, for the tests)"),
        ("--write-docs", bool, "also write the section into docs/RESULTS.md"),
        ("--out", str, "results directory"),
    ])
