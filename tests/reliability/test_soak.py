"""A short soak of a live server (`preft eval soak`, the same run as `preft bench soak`): every
answer equals HF's, every bad request gets its expected status, and the server survives runtime
loads and unloads."""

from __future__ import annotations

import json

import pytest

from preft.eval.soak import main as soak


@pytest.mark.slow
def test_short_soak_has_no_mismatch_and_no_unexpected_failure(tmp_path):
    result = soak(minutes=0.25, concurrency=8, seed=1, out=str(tmp_path))
    assert result["mismatches"] == 0, result
    assert result["unexpected_failures"] == 0, result["unexpected"]
    assert result["by_kind"].get("completion", 0) > 40 and result["by_kind"].get("bad request", 0) > 5
    assert result["by_kind"].get("load", 0) + result["by_kind"].get("unload", 0) > 0
    assert json.loads((tmp_path / "soak" / "results.json").read_text())["requests"] == result["requests"]
    assert f"| {result['requests']} (" in (tmp_path / "soak" / "soak.md").read_text()
    assert (tmp_path / "soak" / "soak.png").stat().st_size > 1000
    assert "Application startup complete" in (tmp_path / "soak" / "server.log").read_text()  # the log is kept
