"""`preft eval plan` in a tiny configuration: the roofline through the simulator, every part, run
where vLLM and TRL cannot be imported (a torch-only GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from preft.eval import plan as eval_plan

HIDDEN = """
import importlib.abc, json, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("vllm", "trl"):
            raise ImportError(name + " is hidden")
sys.meta_path.insert(0, Hide())
import preft
from preft.eval import plan
plan.main(hardware="H100", model="qwen2.5-0.5b", adapters="1,32", slots=4, requests=80, max_len=1024,
          pipeline_prompts="4096", out=sys.argv[1])
assert "vllm" not in sys.modules and "trl" not in sys.modules
"""


def test_plan_simulates_every_part_on_a_named_gpu_without_vllm_or_trl(tmp_path):
    done = subprocess.run([sys.executable, "-c", HIDDEN, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    directory = tmp_path / "plan_qwen2.5-0.5b_H100"
    result = json.loads((directory / "results.json").read_text())
    rows = {(r["adapter"], r["adapters"]): r for r in result["adapters"]}
    assert set(rows) == {(k, n) for k in ("lora", "reft") for n in (1, 32)}
    for kind in ("lora", "reft"):
        many = rows[(kind, 32)]
        assert many["slots"] == 4
        # all-token holds a slot to the last token: with 32 adapters on 4 slots it falls behind PreFT
        assert many["preft_vs_all_token"] > 1.2 and many["preft_tok_s"] <= 1.05 * many["base_tok_s"]
    assert {(r["workload"], r["tpot_ms"]) for r in result["sloweave"]} == {(w, t) for w in ("mixed", "long")
                                                                          for t in (25.0, 10.0)}
    assert all(set(r["goodput"]) == {*eval_plan.FIXED, "sloweave"} for r in result["sloweave"])
    feather = {(r["workload"], r["cache"]): r for r in result["feather"]}
    assert set(feather) == {(w, c) for w in ("shared", "no-sharing") for c in ("0.25x", "0.5x", "1x", "2x", "8x", "GPU")}
    # a prefix cache smaller than the groups' prefixes is where ordering by prefix pays; the GPU's is not
    assert feather[("shared", "0.25x")]["feather_vs_fcfs"] > 1.3 and feather[("shared", "0.25x")]["lpm_vs_fcfs"] > 1.3
    assert feather[("shared", "0.25x")]["feather_vs_fcfs"] > feather[("shared", "GPU")]["feather_vs_fcfs"]
    assert all(0.9 < r["feather_vs_fcfs"] < 1.1 for r in result["feather"] if r["workload"] == "no-sharing")
    wave = result["wavepp"]
    assert {(r["stages"], r["handoff_ms"], r["cached"]) for r in wave} == {
        (s, h, c) for s in (4, 8) for h in (0.0, 1.0, 3.0) for c in (0, 2048)}
    assert all(0 <= r["best_fixed_bubble"] < 1 for r in wave)
    # planning with the true stage cost, WavePP is never slower than the best fixed chunk, and with a
    # free hand-off (small chunks cheap) its equal-time waves are faster on every case
    assert all(r["wavepp_vs_best"] >= 0.999 for r in wave), [r["wavepp_vs_best"] for r in wave]
    assert all(r["wavepp_vs_best"] > 1.01 for r in wave if r["handoff_ms"] == 0.0)
    # a costlier hand-off makes small chunks dear: the best fixed chunk grows with it
    assert max(r["best_fixed"] for r in wave if r["handoff_ms"] == 3.0) >= max(r["best_fixed"] for r in wave
                                                                               if r["handoff_ms"] == 0.0)
    assert [r["model"] for r in result["published"]][:1] == ["llama-3.1-8b"]
    assert result["title"] == "roofline: Qwen2.5-0.5B on H100" and "Simulated" in (directory / "plan.md").read_text()
    for part in ("adapters", "sloweave", "feather", "wavepp"):
        assert (directory / f"plan_qwen2.5-0.5b_H100_{part}.png").stat().st_size > 1000
        assert f"](plan_qwen2.5-0.5b_H100_{part}.png)" in (directory / "plan.md").read_text()
    with pytest.raises(ValueError, match="--hardware 'B200'"):
        eval_plan.main(hardware="B200")
