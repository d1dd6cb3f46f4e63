"""The throughput benchmark's bookkeeping (the engines themselves run in `make bench`)."""

from __future__ import annotations

import pytest

from preft.cli import main as cli_main
from preft.eval.bench.throughput import VARIANTS, command_line, summarize


def test_ratios_are_paired_within_a_round_then_the_median_is_taken():
    # the machine is twice as fast in round 2: tok/s medians move, the paired ratio does not
    rounds = [{name: {"8": speed * rate} for name, rate in zip(VARIANTS, (1.0, 0.2, 0.5, 0.9, 1.1))}
              for speed in (1000.0, 2000.0, 1500.0)]
    summary = summarize(rounds, ["8"])
    assert summary["base"]["tokens_per_s"]["8"] == 1500.0
    assert summary["LoRA-P"]["vs_base"]["8"] == pytest.approx(0.9)
    assert summary["LoRA-P"]["vs_stock"]["8"] == pytest.approx(0.9 / 0.2)
    assert summary["ReFT-P"]["vs_base_range"]["8"] == pytest.approx([1.1, 1.1])


@pytest.mark.parametrize("argv, message", [
    (["--model", "huge"], "unknown --model 'huge'"),
    (["--adapters", "1,64", "--prompts", "8"], "--prompts 8 is fewer than --adapters 64"),
])
def test_bad_benchmark_arguments_are_refused_before_any_work(argv, message, capsys):
    assert cli_main(["bench", "throughput", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_recorded_command_names_only_what_differs_from_the_defaults():
    assert command_line(model="default", adapter_counts=(1, 8, 64, 256), prompts=256, output_tokens=64,
                        rounds=5) == "preft bench throughput"
    assert command_line(model="512x8", adapter_counts=(1, 8, 64), prompts=64, output_tokens=64, rounds=3) == (
        "preft bench throughput --model 512x8 --adapters 1,8,64 --prompts 64 --rounds 3")
