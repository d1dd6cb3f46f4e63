"""`preft eval plan` in a tiny configuration: the roofline through the simulator, both parts."""

from __future__ import annotations

import json

import pytest

from preft.eval import plan as eval_plan


def test_plan_simulates_adapters_and_sloweave_on_a_named_gpu(tmp_path):
    result = eval_plan.main(hardware="H100", model="qwen2.5-0.5b", adapters="1,32", slots=4, requests=80,
                            max_len=1024, out=str(tmp_path))
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
    saved = json.loads((tmp_path / "plan" / "results.json").read_text())
    assert saved["title"] == "roofline: Qwen2.5-0.5B on H100" and "Simulated" in (tmp_path / "plan" / "plan.md").read_text()
    for figure in ("plan_adapters.png", "plan_sloweave.png"):
        assert (tmp_path / "plan" / figure).stat().st_size > 1000
    with pytest.raises(ValueError, match="--hardware 'B200'"):
        eval_plan.main(hardware="B200")
