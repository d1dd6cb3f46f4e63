"""``preft serve``: vLLM's OpenAI-compatible server with PreFT adapters.

    preft serve --model default --adapter alice=BUNDLE_A --adapter bob=BUNDLE_B [--port 8000]

Each request names its adapter (LoRA-P, LoRA or ReFT-P bundle) in ``model`` (``/v1/completions``, ``/v1/chat/completions``;
``/v1/models`` lists them). Bundles come from ``preft export``; their manifests say
prefill-only and ``adapter_start``, which the PreFT vLLM plugin applies per token position.
``--all-token`` serves the same bundles on every token (the standard multi-LoRA baseline).
With ``--allow-runtime-loading --adapter-root DIR``, adapters under DIR can be loaded and
unloaded at run time with vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(behind ``--api-key`` when one is given, like every ``/v1`` route); without it those routes do
not exist. Adapter names are unique across kinds; ``load_inplace`` replaces one. With
``--resolve-adapters --adapter-root DIR`` a request naming ``DIR/<name>`` loads that bundle on
first use (:mod:`preft.serving.adapter_resolver`; it turns the load routes on too, for explicit
reloads); ``--max-host-adapters`` bounds the LoRA weights kept in host memory (LRU).
``/metrics`` has per-adapter figures beside vLLM's (:mod:`preft.serving.adapter_metrics`).

Every bundle is copied into the server's store and checked there before it is served
(:mod:`preft.serving.bundle_store`), so a bad bundle is one clear error line (or a 400 at run
time), not a crashed server, and nothing the user later does to the bundle's directory changes
what is served. Arguments after ``--`` go to vLLM as is.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from preft.serving import SCHEDULER_CLS
from preft.serving.bundle_store import BundleStore
from preft.serving.scheduling.spec import PREFIX_ADMISSIONS, SCHEDULER_CHOICES, SchedulerSpec


def vllm_lora_rank(max_rank: int) -> int:
    """vLLM's ``--max-lora-rank`` for ``--max-rank``: vLLM takes only some values (its
    ``MaxLoRARanks``), so the smallest of them that holds ``max_rank``."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fitting = [rank for rank in allowed if rank >= max_rank]
    if not fitting:
        raise ValueError(f"--max-rank {max_rank} is over vLLM's largest LoRA rank {allowed[-1]}")
    return fitting[0]


#: the online step cost model's state, in --state-dir (SLOWeave and WavePP)
ONLINE_COST_STATE = "step_cost_online.json"

#: vLLM server flags that ``preft serve`` sets itself -> the preft serve flag to use instead
OWN_FLAGS = {
    "--tensor-parallel-size": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size", "-pp": "--pipeline-parallel-size",
    "--max-loras": "--max-adapters", "--max-cpu-loras": "--max-host-adapters", "--max-lora-rank": "--max-rank", "--lora-modules": "--adapter NAME=BUNDLE",
    "--scheduler-cls": "--scheduler", "--model": "--model", "--max-model-len": "--max-model-len",
    "--dtype": "--dtype", "--host": "--host", "--port": "--port", "--served-model-name": "--served-model-name",
    "--shutdown-timeout": "--drain-seconds",
}


def check_vllm_args(vllm_args: list[str]) -> None:
    """Refuse, in one line, a vLLM flag after ``--`` that ``preft serve`` sets itself (given twice,
    vLLM would take the last; the parallel ones would also skip preft's CPU thread binding, and
    vLLM died with a traceback)."""
    for argument in vllm_args:
        flag = argument.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise ValueError(f"{flag} after -- is set by preft serve itself: use preft serve's {OWN_FLAGS[flag]} "
                              "(before --)")


def served_dtype(requested: str) -> str:
    """The engine's ``--dtype`` for preft serve's (vLLM and SGLang alike): ``auto`` on a CPU
    without native bfloat16 (no AVX512-BF16 or AMX-BF16) is float32, as training's ``precision:
    auto`` is there (:mod:`preft.precision`). vLLM's own ``auto`` is bfloat16 on every CPU
    (SGLang's follows the model's config), and bfloat16 matmuls on such a CPU run tens of times
    slower than float32's (docs/RESULTS.md, "1,024 adapters on 8 slots on a real model").
    Anything else, and ``auto`` on a GPU or a CPU with bfloat16, as given."""
    import torch

    from preft.precision import cpu_has_native_bf16

    if requested == "auto" and not torch.cuda.is_available() and not cpu_has_native_bf16():
        return "float32"
    return requested


def vllm_arguments(args, base_dir: Path) -> list[str]:
    argv = [
        "--model", str(base_dir), "--host", args.host, "--port", str(args.port),
        "--enable-lora", "--max-loras", str(args.max_adapters), "--max-lora-rank", str(vllm_lora_rank(args.max_rank)),
        "--max-cpu-loras", str(host_adapters(args)),
        "--max-model-len", "-1" if args.max_model_len == "auto" else str(args.max_model_len), "--enforce-eager", "--dtype", served_dtype(args.dtype),
        "--scheduler-cls", SCHEDULER_CLS,
        # SIGTERM: vLLM stops admitting and lets running requests finish for up to this long
        "--shutdown-timeout", str(args.drain_seconds),
    ]
    from preft.real_models import served_name as short_name

    served_name = args.served_model_name or short_name(args.model)
    if served_name:
        argv += ["--served-model-name", served_name]
    if args.lora_adapters:
        argv += ["--lora-modules", *args.lora_adapters]
    if args.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    spec = SchedulerSpec.parse(args.scheduler, max_chunk=args.max_chunk)
    if spec.chunk_policy != "default" and not any(a.startswith("--max-num-batched-tokens") for a in args.vllm_args):
        # the policy's chunk plus a decode token for every running request fit vLLM's token budget
        argv += ["--max-num-batched-tokens", str(spec.largest_chunk + 256)]
    return argv + list(args.vllm_args)


def host_adapters(args) -> int:
    """vLLM's ``--max-cpu-loras``: ``--max-host-adapters``, at least the slots (vLLM's rule)."""
    return max(args.max_host_adapters, args.max_adapters)


def server_environment(args, base_dir: Path, reft_adapters: dict[str, str]) -> dict[str, str]:
    """The server's environment: vLLM's settings and PreFT's (each is described in :mod:`preft.envs`)."""
    env = dict(os.environ)
    env.pop("PREFT_SERVE_RESOLVE", None)
    if args.resolve_adapters:
        env["PREFT_SERVE_RESOLVE"] = "1"
    env["PREFT_METRICS_TOP_K"] = str(args.metrics_top_adapters)
    if args.allow_runtime_loading or args.resolve_adapters:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env["PREFT_SERVE_ADAPTER_ROOT"] = str(Path(args.adapter_root).resolve())
    else:  # vLLM then serves no load/unload routes at all, and neither does PreFT
        env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        env.pop("PREFT_SERVE_ADAPTER_ROOT", None)
    env["PREFT_SERVE_STORE"] = str(args.state_dir)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    # the API server checks bundles loaded at run time against these (preft.serving.api_server)
    env["PREFT_SERVE_BASE"], env["PREFT_SERVE_MAX_RANK"] = str(base_dir), str(args.max_rank)
    env["PREFT_SERVE_REFT"] = json.dumps(reft_adapters)
    env["PREFT_SERVE_LORA"] = json.dumps(dict(spec.split("=", 1) for spec in getattr(args, "lora_adapters", [])))
    from preft.real_models import served_name as short_name

    env["PREFT_SERVE_BASE_NAME"] = args.served_model_name or short_name(args.model) or str(base_dir)
    env["PREFT_REFT_SLOTS"] = str(args.max_adapters)  # --max-adapters bounds ReFT-P bundles too
    env["PREFT_SCHEDULER"] = json.dumps(scheduler_spec(args))
    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    if workers > 1 and on_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        from preft.serving.parallel import cpu_thread_binding

        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(workers, sorted(os.sched_getaffinity(0)))
    if args.all_token:
        env["PREFT_ALL_TOKEN"] = "1"
    else:
        env.pop("PREFT_ALL_TOKEN", None)
    return env


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def scheduler_spec(args) -> dict:
    """The prefill chunk policy and admission order for the engine (``PREFT_SCHEDULER``: a
    :class:`~preft.serving.scheduling.spec.SchedulerSpec` as JSON), checked now: a bad name, a
    missing TPOT target, an unreadable cost model, online cost state or Feather state is one
    error line before the model loads. SLOWeave and WavePP learn their step cost model online
    (:mod:`~preft.serving.scheduling.online_cost_model`); with ``--state-dir`` it is kept in
    ``STATE_DIR/step_cost_online.json`` and a restarted server goes on from it."""
    from preft.serving.scheduling.admission import admission_from_spec
    from preft.serving.scheduling.chunk_policies import policy_from_spec

    for flag, value, low in (("--tpot-ms", args.tpot_ms, "> 0"), ("--margin-ms", args.margin_ms, ">= 0"),
                             ("--feather-max-wait-s", args.feather_max_wait_s, "> 0"),
                             ("--max-chunk", args.max_chunk, "> 0"), ("--min-chunk", args.min_chunk, "> 0")):
        if value is not None and not (math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)):
            raise ValueError(f"{flag} must be {low} and finite, got {value}")
    try:
        name_only = SchedulerSpec.parse(args.scheduler)
    except ValueError as err:
        raise ValueError(f"--scheduler: {err}") from None
    if name_only.sloweave and args.tpot_ms is None:
        raise ValueError("--scheduler sloweave needs --tpot-ms MS (the time-per-output-token target)")
    if name_only.wavepp and args.pipeline_parallel_size < 2:
        raise ValueError("--scheduler wavepp sizes prefill chunks for pipeline stages: it needs "
                         "--pipeline-parallel-size 2 or more")
    if not name_only.sloweave and args.tpot_ms is not None:
        raise ValueError(f"--tpot-ms is SLOWeave's; --scheduler {args.scheduler} does not use it")
    if not (name_only.sloweave or name_only.wavepp) and args.cost_model:
        raise ValueError(f"--cost-model is SLOWeave's and WavePP's; --scheduler {args.scheduler} does not use it")
    if name_only.admission != "feather" and (args.feather_state or args.feather_max_wait_s is not None):
        raise ValueError(f"--feather-state and --feather-max-wait-s are Feather's; --scheduler {args.scheduler} "
                         "does not use them")
    if any(a == "--async-scheduling" or a.startswith("--async-scheduling=") for a in args.vllm_args):
        raise ValueError("--async-scheduling cannot run with PreFT's scheduler (a synchronous vLLM Scheduler "
                         "subclass); PreFT turns async scheduling off")
    if name_only.admission in PREFIX_ADMISSIONS and "--no-enable-prefix-caching" in args.vllm_args:
        raise ValueError(f"--scheduler {args.scheduler} orders requests by their prefix-cache blocks: it needs "
                         "prefix caching (drop --no-enable-prefix-caching)")
    state = None
    if args.feather_state:
        state = Path(args.feather_state).resolve()
        if state.is_dir() or not state.parent.is_dir():
            raise ValueError(f"--feather-state must be a file in an existing directory: {args.feather_state}")
        try:  # the table is written there while serving and at exit: find out now, not at exit
            tempfile.NamedTemporaryFile(dir=state.parent, prefix=f".{state.name}.", suffix=".probe").close()
        except OSError as err:
            raise ValueError(f"--feather-state {args.feather_state}: its directory is not writable "
                             f"({err.strerror or err})") from None
    cost_state = None
    if (name_only.sloweave or name_only.wavepp) and args.state_dir:  # what the online model learns outlives the server
        cost_state = str(Path(args.state_dir).resolve() / ONLINE_COST_STATE)
    spec = SchedulerSpec.parse(
        args.scheduler, max_chunk=args.max_chunk, margin_ms=args.margin_ms, tpot_ms=args.tpot_ms,
        cost_model=str(Path(args.cost_model).resolve()) if args.cost_model else None, cost_state=cost_state,
        min_chunk=args.min_chunk if name_only.wavepp else None, feather_state=str(state) if state else None,
        feather_max_wait_s=args.feather_max_wait_s)
    try:
        policy_from_spec(spec)
        # reads the Feather state: a bad file fails now
        admission_from_spec(spec, cache=object(), adapter_of={}.get, slots=args.max_adapters)
    except ValueError as err:
        raise ValueError(f"--scheduler: {err}") from None
    return spec.to_json()


def max_model_len(text: str):
    """``--max-model-len``: a positive token count, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of tokens or 'auto'")
    return value


def announce_max_model_len(args, base_dir: Path) -> None:
    """One line saying what ``--max-model-len auto`` chose (vLLM's auto-fit: the model's context,
    or what the KV cache holds if that is less; vLLM logs 'Auto-fit max_model_len' with the result)."""
    if args.max_model_len != "auto":
        return
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(base_dir).get_text_config(), "max_position_embeddings", None)
    print(f"preft serve: --max-model-len auto: the model's context of {context} tokens, or less if the KV cache "
          f"({args.kv_cache_gib} GiB on CPU) holds fewer (vLLM's 'Auto-fit max_model_len' log line says which)",
          file=sys.stderr, flush=True)


def check_port_free(host: str, port: int) -> None:
    """One clear line, before the model loads, if the address is taken (vLLM's own answer is a
    traceback once the engine is up)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err} (is another server running?)") from None


def serve(args) -> int:
    import shutil

    import preft

    from preft.real_models import resolve

    if args.engine == "sglang":
        from preft.serving.sglang.server import serve_sglang

        return serve_sglang(args)
    base_dir = Path(resolve(args.model))
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"base model not found (no config.json): {base_dir}")
    if args.allow_runtime_loading and not args.adapter_root:
        raise ValueError("--allow-runtime-loading needs --adapter-root DIR: runtime loads may only read bundles "
                          "under it")
    if args.resolve_adapters and not args.adapter_root:
        raise ValueError("--resolve-adapters needs --adapter-root DIR: the bundles it loads on first use are "
                         "DIR/<name>")
    if args.max_host_adapters < 1 or args.metrics_top_adapters < 0:
        raise ValueError("--max-host-adapters must be >= 1 and --metrics-top-adapters >= 0")
    if args.adapter_root and not Path(args.adapter_root).is_dir():
        raise ValueError(f"--adapter-root is not a directory: {args.adapter_root}")
    if args.max_rank < 1 or args.max_adapters < 1:
        raise ValueError("--max-rank and --max-adapters must be >= 1")
    vllm_lora_rank(args.max_rank)  # over vLLM's largest: refused now, not after the model loads
    check_vllm_args(args.vllm_args)
    scheduler_spec(args)
    from preft.serving.parallel import check_parallel

    check_parallel(base_dir, args.tensor_parallel_size, args.pipeline_parallel_size, on_cpu())
    names = [spec.split("=", 1)[0] for spec in args.adapter if "=" in spec]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"--adapter names must be unique: {', '.join(duplicated)} given more than once")
    check_port_free(args.host, args.port)
    temporary_store = args.state_dir is None
    if temporary_store:
        args.state_dir = tempfile.mkdtemp(prefix="preft-serve-bundles-")
    store = BundleStore(args.state_dir, base_dir, args.max_rank)
    args.lora_adapters, reft_adapters = [], {}
    try:
        for spec in args.adapter:
            if "=" not in spec:
                raise ValueError(f"--adapter {spec!r} is not of the form NAME=BUNDLE_DIR")
            name, path = spec.split("=", 1)
            if not name:
                raise ValueError(f"--adapter {spec!r} has an empty name")
            copy, manifest = store.add(name, path)
            if manifest["kind"] == "reft":
                reft_adapters[name] = str(copy)
            else:
                args.lora_adapters.append(f"{name}={copy}")
    except ValueError:
        if temporary_store:  # made above, for this server only: nothing is left behind
            shutil.rmtree(args.state_dir, ignore_errors=True)
        raise

    env = server_environment(args, base_dir, reft_adapters)
    if temporary_store:  # the API server keeps this process's pid across exec and removes it at exit
        env["PREFT_SERVE_STORE_OWNER_PID"] = str(os.getpid())
    announce_max_model_len(args, base_dir)  # every check has passed: bad input stays one line
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_arguments(args, base_dir)]
    print("preft serve: " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    os.execve(sys.executable, argv, env)  # the server replaces this process
    return 0  # not reached


def add_arguments(parser) -> None:
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                        help="the serving engine (default vllm; sglang: base models with PreFT's admission orders, "
                             "after `make sglang`)")
    parser.add_argument("--model", default="default", help="base model: 'default' (the embedded model), a prepared real model's "
                        "name (preft models list; served under that name) or a model directory")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=BUNDLE",
                        help="serve the bundle at BUNDLE (from `preft export`) as model NAME; repeatable")
    parser.add_argument("--max-adapters", type=int, default=8,
                        help="adapter slots in the engine, LoRA and ReFT-P each: adapters whose prompts are "
                             "prefilled in one step (default 8)")
    parser.add_argument("--max-rank", type=int, default=64, help="largest adapter rank accepted (default 64)")
    parser.add_argument("--max-model-len", type=max_model_len, default="auto",
                        help="longest prompt + completion in tokens; 'auto' (default): the model's own context, "
                             "reduced by vLLM to what the KV cache (--kv-cache-gib on CPU) holds")
    parser.add_argument("--dtype", default="auto",
                        help="weights/activations dtype; 'auto' (default): vLLM's (bfloat16 on a CPU), but float32 on a "
                             "CPU without native bfloat16 (no AVX512-BF16 or AMX); float32 = HF parity")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="name of the base model in the API (default: 'base' for the embedded model, a "
                             "real model's short name, else its path)")
    parser.add_argument("--all-token", action="store_true",
                        help="apply every adapter (LoRA and ReFT) to all tokens: the standard multi-adapter baseline")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--drain-seconds", type=int, default=30,
                        help="on SIGTERM, how long running requests may take to finish before the server exits "
                             "(vLLM's --shutdown-timeout; 0 aborts them at once; default 30)")
    parser.add_argument("--allow-runtime-loading", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default; needs "
                             "--adapter-root; honours --api-key like every /v1 route)")
    parser.add_argument("--adapter-root", default=None, metavar="DIR",
                        help="runtime loads may only read bundles under DIR (paths resolved, links followed)")
    parser.add_argument("--resolve-adapters", action="store_true",
                        help="a request naming an adapter that is not loaded but is a bundle DIR/NAME under "
                             "--adapter-root loads it on first use (needs --adapter-root; also serves the load "
                             "routes, for explicit reloads; honours --api-key)")
    parser.add_argument("--max-host-adapters", type=int, default=64,
                        help="LoRA adapters kept in host memory, least recently used out (vLLM's --max-cpu-loras; "
                             "at least --max-adapters; default 64)")
    parser.add_argument("--metrics-top-adapters", type=int, default=20,
                        help="adapters with their own label on /metrics, by finished requests; the rest are "
                             "summed as adapter=\"_other\" (default 20)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="where the server keeps its checked copies of the bundles it serves, and SLOWeave's and "
                             "WavePP's learned step cost model (default: a new temporary directory)")
    parser.add_argument("--scheduler", default="default",
                        help=f"{SCHEDULER_CHOICES}. 'default': vLLM's; 'fixed:TOKENS': at most TOKENS prefill tokens "
                             "a step; 'sloweave': the largest chunk predicted to meet the earliest decode deadline "
                             "(needs --tpot-ms; its step cost model is learned online from the served steps); 'wavepp': "
                             "pipeline-sized chunks; 'lpm': most cached "
                             "prefix first; 'feather': the CHT + ADD/STOP bandit")
    parser.add_argument("--tpot-ms", type=float, default=None, help="SLOWeave's time-per-output-token target (ms)")
    parser.add_argument("--cost-model", default=None, metavar="FILE",
                        help="a step cost model (from `preft eval profile` on this machine and model) that seeds "
                             "SLOWeave's and WavePP's online model; without it they start from a conservative prior "
                             "and learn from the first steps")
    parser.add_argument("--max-chunk", type=int, default=2048,
                        help="SLOWeave's largest prefill chunk (tokens; default 2048)")
    parser.add_argument("--margin-ms", type=float, default=0.0,
                        help="a fixed safety margin on each predicted step time, on top of the online model's own "
                             "error bound (ms; default 0)")
    parser.add_argument("--min-chunk", type=int, default=16,
                        help="WavePP's smallest prefill chunk (tokens; default 16)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages (vLLM's --pipeline-parallel-size); on CPU preft binds each worker "
                             "to its share of the cores")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="tensor-parallel workers (vLLM's --tensor-parallel-size; the model's attention heads "
                             "must divide by it); on CPU preft binds each worker to its share of the cores")
    parser.add_argument("--feather-state", default=None, metavar="FILE",
                        help="Feather's learned table: read at start when FILE exists (e.g. pretrained by `preft eval "
                             "prefix --parts scheduling`), written back to FILE atomically every 30 s and at shutdown")
    parser.add_argument("--feather-max-wait-s", type=float, default=None,
                        help="Feather's age bound: no request is overtaken by one that arrived more than this "
                             "much later (seconds; default 10)")
    parser.add_argument("vllm_args", nargs="*", help="after --: extra engine server arguments (vLLM's, or SGLang's)")
