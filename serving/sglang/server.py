"""``preft serve --engine sglang``: SGLang's OpenAI-compatible server on a base model, with
PreFT's plugin (:mod:`.plugin`) choosing its admission order.

    preft serve --engine sglang --model smollm2-135m-instruct --scheduler feather [-- SGLANG ARGS]

SGLang runs in its own venv (``make sglang``; another Python, set ``PREFT_SGLANG_PYTHON`` to use
one elsewhere), replacing this process. On a CPU it runs as SGLang's CPU path needs without its
compiled kernels: ``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native``,
and the overlap scheduler off (the plugin's hooks see one step at a time). ``--kv-cache-gib``
becomes SGLang's ``--max-total-tokens``: the tokens whose keys and values fit in that many GiB,

    tokens = GiB * 2^30 / (2 * layers * kv_heads * head_dim * bytes per value).

``--scheduler`` takes ``default``/``fcfs`` (SGLang's own queue; its other policies after ``--``,
e.g. ``-- --schedule-policy lpm``), ``feather`` (Feather over the Chunked Hash Tree) and
``sloweave`` with ``--tpot-ms`` (each step's prefill chunk, SGLang in ``--enable-mixed-chunk``
mode; SGLang's fixed chunk is its own ``-- --chunked-prefill-size C``).
``--adapter NAME=BUNDLE`` serves LoRA and LoRA-P bundles through SGLang's torch-native LoRA
backend, each following its rule (:mod:`.lora_p`); a request names one as ``"lora_path": "NAME"``. ReFT-P bundles and runtime loading run on vLLM:
those flags are refused in one line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from preft import envs
from preft.serving.scheduling.spec import SchedulerSpec
from preft.serving.sglang.plugin import SGLANG_ADMISSIONS, SGLANG_CHUNK_POLICIES

#: ``preft serve`` flags that have no meaning on SGLang here, with the value that means "unset"
VLLM_ONLY = {"allow_runtime_loading": False, "adapter_root": None, "resolve_adapters": False,
             "all_token": False, "state_dir": None, "feather_state": None}
BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def sglang_python() -> Path:
    python = Path(envs.PREFT_SGLANG_PYTHON)
    if not python.is_file():
        raise ValueError(f"SGLang is not installed ({python} is missing): run `make sglang` (its own venv) or set "
                         "PREFT_SGLANG_PYTHON to a Python that has sglang 0.5.23 and preft")
    return python


def kv_tokens(base_dir: Path, gib: float, dtype: str) -> int:
    """How many tokens' keys and values fit in ``gib`` GiB (the module docstring's formula)."""
    config = json.loads((base_dir / "config.json").read_text())
    config = config.get("text_config", config)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    value_bytes = BYTES.get(dtype if dtype != "auto" else str(config.get("torch_dtype", "float32")), 4)
    return int(gib * 2**30 // (2 * layers * kv_heads * head_dim * value_bytes))


def check(args) -> SchedulerSpec:
    """Every flag SGLang cannot take, refused in one line; the parsed ``--scheduler``."""
    for flag, unset in VLLM_ONLY.items():
        if getattr(args, flag) != unset:
            raise ValueError(f"--{flag.replace('_', '-')} is not available with --engine sglang (it serves LoRA and "
                             "LoRA-P bundles given at start-up; ReFT-P, runtime loading, adapter resolving and "
                             "kept state run on vLLM)")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise ValueError("--engine sglang runs on one device here: drop --tensor-parallel-size and "
                         "--pipeline-parallel-size")
    from preft.serving.server import scheduler_spec

    spec = SchedulerSpec.from_json(scheduler_spec(args))  # the checks vLLM's serve runs: one line each
    if spec.chunk_policy not in SGLANG_CHUNK_POLICIES or spec.admission not in SGLANG_ADMISSIONS:
        raise ValueError(f"--scheduler {args.scheduler} does not run on SGLang: it takes the admission orders "
                         f"{', '.join(SGLANG_ADMISSIONS)} and the chunk policies {', '.join(SGLANG_CHUNK_POLICIES)} "
                         "(SGLang's own policies after --, e.g. -- --schedule-policy lpm or --chunked-prefill-size 256)")
    if spec.admission == "feather" and any(a.startswith("--schedule-policy") for a in args.vllm_args):
        raise ValueError("--scheduler feather orders SGLang's waiting queue itself: drop --schedule-policy")
    if spec.sloweave and any(a.startswith("--chunked-prefill-size") for a in args.vllm_args):
        raise ValueError("--scheduler sloweave sets SGLang's prefill chunk each step: drop --chunked-prefill-size "
                         "(--max-chunk caps it)")
    return spec


def lora_bundles(args, base_dir: Path) -> dict[str, tuple[str, int]]:
    """``{name: (bundle dir, rank)}`` of ``--adapter NAME=BUNDLE``, each checked as ``preft serve``
    checks it on vLLM (hash, rule, finite weights, the base it was exported for); LoRA only."""
    from preft.bundle import base_fingerprint
    from preft.serving.bundle_store import check_bundle

    bundles: dict[str, tuple[str, int]] = {}
    base = base_fingerprint(base_dir)
    for spec in args.adapter:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--adapter {spec!r} is not of the form NAME=BUNDLE_DIR")
        if name in bundles:
            raise ValueError(f"--adapter names must be unique: {name} given more than once")
        if not Path(path).is_dir():
            raise ValueError(f"adapter {name!r}: bundle directory not found: {path}")
        manifest = check_bundle(name, Path(path), base, args.max_rank)
        if manifest["kind"] != "lora":
            raise ValueError(f"adapter {name!r}: a {manifest['kind']} bundle; --engine sglang serves LoRA and LoRA-P "
                             "bundles (ReFT-P runs on vLLM)")
        bundles[name] = (str(Path(path).resolve()), int(manifest["rank"]))
    return bundles


def sglang_arguments(args, base_dir: Path, on_cpu: bool, bundles: dict | None = None,
                     spec: SchedulerSpec | None = None) -> list[str]:
    from preft.serving.server import served_dtype

    dtype = served_dtype(args.dtype)
    argv = ["--model-path", str(base_dir), "--host", args.host, "--port", str(args.port), "--dtype", dtype,
            "--max-total-tokens", str(kv_tokens(base_dir, args.kv_cache_gib, dtype)),
            "--disable-overlap-schedule"]
    if on_cpu:
        argv += ["--device", "cpu", "--attention-backend", "torch_native"]
    if bundles:  # the torch-native backend: the one PreFT's rule is applied to (preft.serving.sglang.lora_p)
        argv += ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", str(args.max_adapters),
                 "--max-lora-rank", str(max(rank for _, rank in bundles.values())),
                 "--lora-paths", *(f"{name}={path}" for name, (path, _) in bundles.items())]
    if spec is not None and spec.sloweave:  # each step's chunk is set per pass, up to --max-chunk, decodes in it
        argv += ["--enable-mixed-chunk", "--chunked-prefill-size", str(spec.max_chunk)]
    if args.max_model_len != "auto":
        argv += ["--context-length", str(args.max_model_len)]
    from preft.real_models import served_name as short_name

    served_name = args.served_model_name or short_name(args.model)
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + list(args.vllm_args)


def serve_sglang(args) -> int:
    import torch

    from preft.real_models import resolve
    from preft.serving.server import check_port_free

    base_dir = Path(resolve(args.model))
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"base model not found (no config.json): {base_dir}")
    spec = check(args)
    bundles = lora_bundles(args, base_dir)
    python = sglang_python()
    check_port_free(args.host, args.port)
    on_cpu = not torch.cuda.is_available()
    env = dict(os.environ)
    env["SGLANG_PLUGINS"] = "preft"  # this project's plugin, and no other
    env["PREFT_SCHEDULER"] = json.dumps(spec.to_json())
    if on_cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.pop("PREFT_SGLANG_LORA", None)
    if bundles:
        env["PREFT_SGLANG_LORA"] = "1"
    argv = [str(python), "-m", "sglang.launch_server", *sglang_arguments(args, base_dir, on_cpu, bundles, spec)]
    print("preft serve: " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    os.execve(str(python), argv, env)  # the server replaces this process
    return 0  # not reached
