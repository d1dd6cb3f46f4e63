"""The SFT and GRPO recipes under ``accelerate launch`` on 2 CPU processes (gloo), with the
shipped accelerate configs, as a user runs them:

- DDP and FSDP2, SFT with LoRA-P: at the same global batch (1 x 16 rows against 2 x 8) the
  held-out loss after training equals the single-process run's within 1e-4 relative, and
  the saved adapters agree within 1e-3 (float32; the gradients are summed in another order,
  and Adam's division by small second moments amplifies that). Before
  :class:`preft.recipes.common.LossBeforeTraining`, the recipe's evaluation before training
  left the model unwrapped, the two processes trained two copies, and the loss missed by 1.4%;
- DDP, GRPO with LoRA-P: runs, learns a non-identity adapter and writes its summary once.
  Its loss is not compared: TRL samples completions with a per-process seed.

``make test`` runs DDP's SFT; FSDP2 and GRPO run in ``make test-parallel``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
SFT = ["recipes/configs/sft_lora_p.yaml", "trainer.max_steps=6", "trainer.eval_steps=100", "trainer.save_strategy=no",
       "trainer.report_to=none", "trainer.logging_steps=1", "data.train_examples=192", "data.eval_examples=32"]


def run(command: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PREFT_DEBUG": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def free_port() -> int:
    with socket.socket() as probe:  # torchrun's default 29500 may still be held by the last launch
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config: str, recipe: list[str], out: Path, **overrides) -> None:
    args = [*recipe, f"output_dir={out}", *(f"trainer.{k}={v}" for k, v in overrides.items())]
    run([str(ACCELERATE), "launch", "--config_file", f"recipes/configs/accelerate/{config}.yaml",
         "--main_process_port", str(free_port()),
         "-m", "preft", "train", *args])


@pytest.fixture(scope="module")
def single_sft(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    run([sys.executable, "-m", "preft", "train", *SFT, f"output_dir={out}", "trainer.per_device_train_batch_size=16"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", pytest.param("fsdp", marks=pytest.mark.parallel)])
def test_sft_on_two_processes_matches_one(config, single_sft, tmp_path):
    out = tmp_path / config
    launch(config, SFT, out, per_device_train_batch_size=8)
    one, two = (json.loads((run / "run_summary.json").read_text()) for run in (single_sft, out))
    assert two["steps"] == one["steps"] == 6
    assert two["initial_eval_loss"] == pytest.approx(one["initial_eval_loss"], rel=1e-5)
    assert two["final_eval_loss"] < two["initial_eval_loss"]
    assert two["final_eval_loss"] == pytest.approx(one["final_eval_loss"], rel=1e-4), (one, two)
    weights = [load_file(run / "adapter" / "adapter_model.safetensors") for run in (single_sft, out)]
    assert weights[0].keys() == weights[1].keys()
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert worst < 1e-3, f"{config}: adapters differ by {worst}"


@pytest.mark.slow
@pytest.mark.parallel  # make test-parallel
def test_grpo_runs_under_ddp(tmp_path):
    out = tmp_path / "grpo"
    recipe = ["recipes/configs/grpo_lora_p.yaml", "trainer.max_steps=2", "trainer.save_strategy=no",
              "trainer.report_to=none", "trainer.logging_steps=1", "trainer.num_generations=8",
              "data.train_prompts=64", "data.eval_prompts=16"]
    launch("ddp", recipe, out, per_device_train_batch_size=8)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["reward_history"]) == 2
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any(float(w.abs().max()) > 0 for k, w in weights.items() if "lora_B" in k), "the adapter did not move"
    assert not list(out.glob(".run_summary.json.*.tmp"))
