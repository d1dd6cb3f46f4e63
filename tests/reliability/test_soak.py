"""A short soak of a live server (the same code as `preft bench soak`): every answer equals HF's,
every bad request gets its expected status, and the server survives runtime loads and unloads."""

from __future__ import annotations

import pytest

from preft.eval.bench_soak import main as soak


@pytest.mark.slow
def test_short_soak_has_no_mismatch_and_no_unexpected_failure():
    result = soak(minutes=0.4, concurrency=8, seed=1, publish=False)
    assert result["mismatches"] == 0, result
    assert result["unexpected_failures"] == 0, result["unexpected_examples"]
    assert result["by_kind"].get("completion", 0) > 40 and result["by_kind"].get("bad request", 0) > 5
    assert result["by_kind"].get("load", 0) + result["by_kind"].get("unload", 0) > 0
