"""``preft serve``: vLLM's OpenAI-compatible server with PreFT adapters.

    preft serve --model default --adapter alice=BUNDLE_A --adapter bob=BUNDLE_B [--port 8000]

Each request names its adapter (LoRA-P, LoRA or ReFT-P bundle) in ``model`` (``/v1/completions``, ``/v1/chat/completions``;
``/v1/models`` lists them). Bundles come from ``preft export``; their manifests say
prefill-only and ``adapter_start``, which the PreFT vLLM plugin applies per token position.
``--all-token`` serves the same bundles on every token (the standard multi-LoRA baseline).
Adapters can be loaded and unloaded at run time with vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``.

Every bundle is checked before the engine starts (manifest, kind, rank, base model), so a bad
bundle is one clear error line, not a crashed server. Arguments after ``--`` go to vLLM as is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from preft.export import ExportError, check_finite, load_tensors, read_manifest
from preft.serving import SCHEDULER_CLS


def check_bundle(name: str, path: str, base_dir: Path, max_rank: int) -> dict:
    """Refuse a bundle that this server cannot serve; returns its manifest."""
    if not Path(path).is_dir():
        raise ExportError(f"adapter {name!r}: bundle directory not found: {path}")
    manifest = read_manifest(path)
    if manifest.get("kind") not in ("lora", "reft"):
        raise ExportError(f"adapter {name!r}: unknown bundle kind {manifest.get('kind')!r}")
    if manifest["rank"] > max_rank:
        raise ExportError(f"adapter {name!r}: rank {manifest['rank']} is over --max-rank {max_rank}")
    base = json.loads((base_dir / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if manifest["base"].get(key) != base.get(key):
            raise ExportError(
                f"adapter {name!r} was exported for another base model: {key} is {manifest['base'].get(key)} "
                f"in the bundle, {base.get(key)} in {base_dir}"
            )
    weights = "adapter_model.safetensors" if manifest["kind"] == "lora" else "reft_weights.safetensors"
    check_finite(load_tensors(Path(path) / weights))
    return manifest


def vllm_arguments(args, base_dir: Path) -> list[str]:
    argv = [
        "--model", str(base_dir), "--host", args.host, "--port", str(args.port),
        "--enable-lora", "--max-loras", str(args.max_adapters), "--max-lora-rank", str(args.max_rank),
        "--max-model-len", str(args.max_model_len), "--enforce-eager", "--dtype", args.dtype,
        "--scheduler-cls", SCHEDULER_CLS,
    ]
    served_name = args.served_model_name or ("base" if args.model == "default" else None)
    if served_name:
        argv += ["--served-model-name", served_name]
    if args.lora_adapters:
        argv += ["--lora-modules", *args.lora_adapters]
    return argv + list(args.vllm_args)


def server_environment(args, base_dir: Path, reft_adapters: dict[str, str]) -> dict[str, str]:
    """The server's environment: vLLM's settings and PreFT's (each is described in :mod:`preft.envs`)."""
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    # the API server checks bundles loaded at run time against these (preft.serving.api_server)
    env["PREFT_SERVE_BASE"], env["PREFT_SERVE_MAX_RANK"] = str(base_dir), str(args.max_rank)
    env["PREFT_SERVE_REFT"] = json.dumps(reft_adapters)
    env["PREFT_SERVE_BASE_NAME"] = args.served_model_name or ("base" if args.model == "default" else str(base_dir))
    env["PREFT_REFT_SLOTS"] = str(args.max_adapters)  # --max-adapters bounds ReFT-P bundles too
    if args.all_token:
        env["PREFT_ALL_TOKEN"] = "1"
    else:
        env.pop("PREFT_ALL_TOKEN", None)
    return env


def serve(args) -> int:
    import preft

    base_dir = Path(preft.DEFAULT_BASE_MODEL if args.model == "default" else args.model)
    if not (base_dir / "config.json").is_file():
        raise ExportError(f"base model not found (no config.json): {base_dir}")
    args.lora_adapters, reft_adapters = [], {}
    for spec in args.adapter:
        if "=" not in spec:
            raise ExportError(f"--adapter {spec!r} is not of the form NAME=BUNDLE_DIR")
        name, path = spec.split("=", 1)
        manifest = check_bundle(name, path, base_dir, args.max_rank)
        if manifest["kind"] == "reft":
            reft_adapters[name] = str(Path(path).resolve())
        else:
            args.lora_adapters.append(spec)

    env = server_environment(args, base_dir, reft_adapters)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_arguments(args, base_dir)]
    print("preft serve: " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    os.execve(sys.executable, argv, env)  # the server replaces this process
    return 0  # not reached


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default", help="base model directory ('default' = the embedded model)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=BUNDLE",
                        help="serve the bundle at BUNDLE (from `preft export`) as model NAME; repeatable")
    parser.add_argument("--max-adapters", type=int, default=8,
                        help="adapter slots in the engine, LoRA and ReFT-P each: adapters whose prompts are "
                             "prefilled in one step (default 8)")
    parser.add_argument("--max-rank", type=int, default=64, help="largest adapter rank accepted (default 64)")
    parser.add_argument("--max-model-len", type=int, default=512, help="longest prompt + completion (default 512)")
    parser.add_argument("--dtype", default="auto",
                        help="weights/activations dtype; vLLM's 'auto' is bfloat16 on CPU (float32 = HF parity)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="name of the base model in the API (default: 'base' for the embedded model, else its path)")
    parser.add_argument("--all-token", action="store_true",
                        help="apply every adapter (LoRA and ReFT) to all tokens: the standard multi-adapter baseline")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("vllm_args", nargs="*", help="after --: extra vLLM server arguments")
