"""The finishing steps of ``make sglang`` (SGLang on a CPU in ``.venv-sglang``), run by that
venv's Python after pip has installed SGLang and its requirements:

1. torchvision: the only torchvision for torch 2.13 here is PyPI's CUDA build, whose compiled
   ops need ``libtorch_cuda.so`` and do not load beside ``torch 2.13.0+cpu``; torchvision then
   fails at import registering fake kernels for ops that do not exist (``operator
   torchvision::nms does not exist``). SGLang imports ``torchvision.transforms`` at start-up
   (its multimodal config helpers) and never runs those ops for a text model, so the two
   registration imports are made conditional on the ops having loaded.
2. The ``sgl_kernel`` stand-in (:mod:`serving/sglang/standin/sgl_kernel`) goes on the venv's path
   through a ``.pth`` file: PyPI has no CPU build of SGLang's kernel package.

Each step says what it did, or fails with one line naming the step.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

REGISTRATIONS = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
"""
GUARDED = """if extension._has_ops():  # preft (make sglang): without the compiled ops there is nothing to register
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
"""


def patch_torchvision(site: Path) -> str:
    init = site / "torchvision" / "__init__.py"
    if not init.is_file():
        return "torchvision: not installed, nothing to patch"
    text = init.read_text()
    if GUARDED in text:
        return "torchvision: already patched"
    if REGISTRATIONS not in text:
        raise SystemExit(f"make sglang: torchvision's {init} no longer imports its registrations as expected: "
                         "update serving/sglang/cpu_venv.py for this torchvision")
    init.write_text(text.replace(REGISTRATIONS, GUARDED, 1))
    return "torchvision: registrations skipped when its compiled ops are missing"


def add_standin(site: Path) -> str:
    standin = Path(__file__).resolve().parent / "standin"
    (site / "preft_sgl_kernel_standin.pth").write_text(f"{standin}\n")
    return f"sgl_kernel: the stand-in from {standin}"


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    for step in (patch_torchvision, add_standin):
        print(f"make sglang: {step(site)}")
    if "--check" in sys.argv:  # a new interpreter: the .pth file is read at start-up
        import subprocess

        check = "import sgl_kernel, torchvision, sglang; assert sgl_kernel.STANDIN; print(sglang.__version__)"
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"make sglang: sglang does not import with the stand-in: {last}")
        print(f"make sglang: sglang {done.stdout.strip()} imports with the stand-in")


if __name__ == "__main__":
    main()
