"""The torch-only GPU check (`preft eval gpu --engine hf`) from a source tree on PYTHONPATH, with
vLLM, TRL and the other libraries such a machine lacks absent and preft not installed: its tiny
CPU configuration passes every part."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: what a torch-only GPU machine lacks (it has torch, Triton, transformers with its dependencies,
#: PEFT and accelerate)
ABSENT = {"vllm", "trl", "datasets", "wandb", "openai", "lm_eval", "rich", "matplotlib", "mpl_toolkits"}
CHECK = """
import runpy, sys
sys.argv = ["preft", *sys.argv[1:]]
try:
    runpy.run_module("preft", run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm", "trl")], "vLLM or TRL was imported"
    print("no vllm, no trl", flush=True)
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> Path:
    """This environment's site-packages less :data:`ABSENT`, as a folder of links."""
    folder = tmp_path_factory.mktemp("torch_only_site")
    for site_packages in site.getsitepackages():
        for entry in Path(site_packages).iterdir():
            top = entry.name.split("-")[0].split(".")[0].lower()
            if top not in ABSENT and not entry.name.endswith(".pth") and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def run_uninstalled(tmp_path, libraries: Path, *args: str) -> subprocess.CompletedProcess:
    """``preft ARGS`` as a torch-only machine runs it: ``python -S`` (no site, so no installed preft),
    the tree and the libraries on PYTHONPATH without vLLM, TRL and the rest of :data:`ABSENT`,
    Triton's interpreter on CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(libraries)]), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-S", "-c", CHECK, *args], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)


def test_the_torch_only_check_runs_every_part_from_the_source_tree(tmp_path, libraries):
    done = run_uninstalled(tmp_path, libraries, "eval", "gpu", "--engine", "hf", "--allow-cpu", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "no vllm, no trl" in done.stdout
    result = json.loads((tmp_path / "gpu_hf" / "results.json").read_text())
    assert result["parts"] == ["kernels", "calibrate", "hf-generate"] and result["passed"]
    assert max(result["kernels"]["relative_error"].values()) <= result["kernels"]["tolerance"]
    run = result["hf-generate"]["runs"][0]
    assert set(run["summary"]) == {"base", "PEFT LoRA (all-token)", "LoRA-P", "LoReFT-P"}
    assert all(rate > 0 for row in run["summary"].values() for rate in row["tokens_per_s"].values())
    assert {s["step"] for s in result["calibrate"]["steps"]} == {"decode_b1", "decode_b16", "prefill"}
    text = (tmp_path / "gpu_hf" / "gpu_hf.md").read_text()
    assert "Triton kernels vs their torch references" in text and "Roofline calibration" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit is for machines without one")
def test_without_a_gpu_it_exits_2_with_one_line(tmp_path, libraries):
    done = run_uninstalled(tmp_path, libraries, "eval", "gpu", "--engine", "hf", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    # a command whose libraries are absent there stays listed and says what it lacks
    done = run_uninstalled(tmp_path, libraries, "bench", "soak", "--duration-s", "5")
    assert done.returncode == 2 and "preft bench soak cannot run here" in done.stderr


def test_a_vllm_argument_with_the_hf_engine_is_refused(tmp_path):
    from preft.eval import gpu

    with pytest.raises(ValueError, match="--prompt-tokens is an argument of --engine vllm"):
        gpu.main(engine="hf", prompt_tokens=64, allow_cpu=True, tiny=True, out=str(tmp_path))
    with pytest.raises(ValueError, match="--engine 'sglang'"):
        gpu.main(engine="sglang")


def test_a_check_stopped_mid_run_keeps_the_parts_that_finished(tmp_path):
    """A lent machine is taken back when its time is spent: the parts done by then are on disk."""
    import time

    from preft.eval import gpu

    def run_part(part):
        if part == "second":
            raise KeyboardInterrupt  # the machine going away, not a failure the check records
        return {"passed": True, "value": 1}

    result = {"parts": ["first", "second"], "skipped": {}}
    root = tmp_path / "check"
    with pytest.raises(KeyboardInterrupt):
        gpu.run_parts(result, ["first", "second"], run_part, 100.0, time.time(), "test",
                      save=lambda r: gpu.save_partial(root, "check", r, f"first: {r['first']['value']}"))
    saved = json.loads((root / "results.json").read_text())
    assert saved["first"] == {"passed": True, "value": 1} and "second" not in saved
    assert (root / "check.md").read_text().strip() == "first: 1"


def test_hf_generate_skips_the_models_it_has_no_time_left_for():
    import time

    from preft.eval import gpu_hf

    outcome = gpu_hf.hf_generate(["0.5B", "1B"], "1,64", 64, 32, 2, deadline=time.time() - 1)
    assert outcome == {"runs": [], "skipped_models": ["0.5B", "1B"], "passed": True}
    assert "0.5B, 1B not run" in gpu_hf.report({"device": "x", "command": "c", "torch": "t", "triton": "t",
                                                 "wall_time_s": 1.0, "parts": ["hf-generate"],
                                                 "hf-generate": outcome})
