"""`preft bench hf-generate`: its adapters are PEFT's own, built in linear time, and a tiny run
measures every variant."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from preft.eval.bench import hf_generate


@pytest.mark.parametrize("variant", ["PEFT LoRA (all-token)", "LoRA-P", "LoReFT-P"])
def test_the_fast_adapters_are_peft_add_adapters(variant):
    fast = hf_generate.with_adapters(hf_generate.base_model("default"), variant, 4, rank=4)
    make = hf_generate.adapter_configs(rank=4)[variant]
    torch.manual_seed(0)
    slow = get_peft_model(hf_generate.base_model("default"), make(), adapter_name="a0")
    for index in range(1, 4):
        torch.manual_seed(index)
        slow.add_adapter(f"a{index}", make())
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state.keys() == slow_state.keys() and any(".a3." in key for key in fast_state)
    assert all(torch.equal(fast_state[key], slow_state[key]) for key in slow_state)
    assert set(fast.peft_config) == {"a0", "a1", "a2", "a3"}


def test_a_tiny_run_measures_every_variant_side_by_side():
    result = hf_generate.run(model="default", adapters="1,3", rank=4, prompt_tokens=6, output_tokens=3, rounds=1)
    assert result["adapter_counts"] == ["1", "3"]
    assert set(result["summary"]) == set(hf_generate.VARIANTS)
    for variant, row in result["summary"].items():
        assert all(row["tokens_per_s"][n] > 0 for n in ("1", "3"))
        assert len(result["rounds_measured"][variant]["3"]) == 1  # the warm-up round is dropped
    assert result["summary"]["base"]["vs_base"] == {"1": 1.0, "3": 1.0}
    assert "| LoRA-P |" in hf_generate.markdown({**result, "command": "preft bench hf-generate"})
    with pytest.raises(ValueError, match="base included"):
        hf_generate.run(variants="LoRA-P")
