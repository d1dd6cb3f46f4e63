"""``preft eval gpu`` (``make gpu-check``): without a GPU it stops with one line; with
``--allow-cpu --tiny`` the parity and throughput parts run the same code on CPU (float32, tiny
random Llama): parity with HF through teacher-forced log-probs (and an all-token control that
misses), and the interleaved throughput rounds (two of the four engines, to keep the suite
short: the LoRA engines differ from them only in their settings). The kernels part would rerun
two test files of the suite itself."""

from __future__ import annotations

import json

import pytest
import torch

from preft.cli import main as cli_main
from preft.eval import gpu as eval_gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_check_stops_with_one_line(capsys, tmp_path):
    assert cli_main(["eval", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU and found none" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "gpu").exists()


def test_a_near_tie_passes_and_a_real_difference_fails():
    hf = {"greedy": [5, 6, 7], "logprobs": [-1.0, -2.0, -3.0], "best": [-1.0, -2.0, -2.95]}
    assert eval_gpu.judge([5, 6, 7], [-1.01, -2.02, -3.0], hf, 0.1)["passed"]
    tie = eval_gpu.judge([5, 6, 8], [-1.0, -2.0, -3.0], {**hf, "logprobs": [-1.0, -2.0, -3.0]}, 0.1)
    assert tie["passed"] and tie["first_difference"] == 2
    assert not eval_gpu.judge([5, 6, 8], [-1.0, -2.0, -3.0], {**hf, "best": [-1.0, -2.0, -2.5]}, 0.1)["passed"]
    assert not eval_gpu.judge([5, 6, 7], [-1.0, -2.5, -3.0], hf, 0.1)["passed"]  # a log-prob off by 0.5


@pytest.mark.slow
def test_every_part_runs_on_cpu_with_tiny_models(tmp_path):
    # the kernels part runs tests/test_kernels.py and tests/test_gpu_path.py, which make test runs itself
    result = eval_gpu.main(parts="parity,throughput", tiny=True, allow_cpu=True, adapters="1,2",
                           variants="base,ReFT-P", prompts=4, prompt_tokens=16, output_tokens=4, rounds=1,
                           tolerance=1e-3, out=str(tmp_path))
    assert result["passed"] and result["parts"] == ["parity", "throughput"]
    (run,) = result["parity"]["runs"]
    assert run["tokens_equal"] == len(run["requests"]) == 18  # float32: every token equal
    assert run["worst_logprob_gap"] < 1e-3 < run["control_worst_gap"]
    summary = result["throughput"]["summary"]
    assert set(summary) == {"base", "ReFT-P"}  # (LoRA engines are the parity part's; here two of four)
    assert all(summary[v]["tokens_per_s"]["2"] > 0 for v in summary)
    saved = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert saved["passed"] and "## The GPU path" in (tmp_path / "gpu" / "gpu.md").read_text()
