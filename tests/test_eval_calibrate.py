"""`preft eval calibrate` on CPU in its tiny configuration (the GPU check runs it on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from preft.eval import calibrate


def test_calibration_measures_the_hardware_and_reports_the_rooflines_error(tmp_path):
    result = calibrate.main(tiny=True, allow_cpu=True, context=64, prefill=64, repeats=3, out=str(tmp_path))
    assert result["flops"] > 1e8 and result["bandwidth"] > 1e8
    steps = {s["step"]: s for s in result["steps"]}
    assert set(steps) == {"decode_b1", "decode_b16", "prefill"}
    assert all(s["measured_ms"] > 0 and s["predicted_ms"] > 0 for s in steps.values())
    # the batch-1 decode sets the overhead, so the roofline meets it (unless it was all compute/memory)
    assert steps["decode_b1"]["fitted"] and not steps["prefill"]["fitted"]
    assert result["step_overhead_s"] == 0 or abs(steps["decode_b1"]["error"]) < 1e-6
    from preft.serving.scheduling.roofline import Hardware, ModelShape, RooflineCostModel

    saved = json.loads((tmp_path / "calibrate" / "results.json").read_text())
    hardware = Hardware(**saved["hardware"])
    shape = ModelShape(**{**saved["model"], "lora_targets": tuple(saved["model"]["lora_targets"])})
    assert hardware.peak_flops == pytest.approx(result["flops"]) and shape.layers == 2
    assert RooflineCostModel(shape, hardware)(1, 0, 64) == pytest.approx(steps["decode_b1"]["predicted_ms"] / 1e3)
    assert "fitted (sets the overhead)" in (tmp_path / "calibrate" / "calibrate.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU error is for machines without one")
def test_without_a_gpu_it_is_one_error():
    with pytest.raises(calibrate.NoGpuError, match="needs a CUDA GPU"):
        calibrate.main()
