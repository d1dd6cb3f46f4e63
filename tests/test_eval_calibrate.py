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


@pytest.mark.parametrize("prefill_slowdown", [1.0, 2.0])
def test_on_a_machine_that_is_a_roofline_the_fit_recovers_its_overhead_and_each_steps_error(
        tmp_path, monkeypatch, prefill_slowdown):
    """Timings from a machine that follows the roofline with a known overhead: the fit must find that
    overhead, predict the unfitted steps exactly, and report a step run ``k`` times slower as an
    error of ``1/k − 1`` (a wrong context per step, a wrong overhead or a flipped ratio fails)."""
    from dataclasses import replace

    from preft.serving.scheduling.roofline import Hardware, ModelShape, RooflineCostModel

    flops, bandwidth, overhead = 3e11, 4e10, 0.0042
    monkeypatch.setattr(calibrate, "matmul_flops", lambda *args: flops)
    monkeypatch.setattr(calibrate, "copy_bandwidth", lambda *args: bandwidth)

    def machine_steps(model, device, context, prefill, repeats):
        shape = replace(ModelShape.from_config(model.config.to_dict()), bytes_per_value=4)
        machine = RooflineCostModel(shape, Hardware("fake", flops, bandwidth, 1.0, 1.0, step_overhead_s=overhead))
        return {"decode_b1": machine.step(1, 0, decode_context=context),
                "decode_b16": machine.step(16, 0, decode_context=16 * context),
                "prefill": prefill_slowdown * machine.step(0, prefill)}

    monkeypatch.setattr(calibrate, "model_steps", machine_steps)
    result = calibrate.main(tiny=True, allow_cpu=True, context=48, prefill=96, repeats=1, out=str(tmp_path))
    steps = {s["step"]: s for s in result["steps"]}
    assert result["step_overhead_s"] == pytest.approx(overhead)
    assert steps["decode_b16"]["error"] == pytest.approx(0.0, abs=1e-9)
    assert steps["prefill"]["error"] == pytest.approx(1 / prefill_slowdown - 1, abs=1e-9)
    expected = "+0%" if prefill_slowdown == 1.0 else "-50%"
    assert f"| prefill | {steps['prefill']['measured_ms']:.2f} ms | {steps['prefill']['predicted_ms']:.2f} ms | " \
           f"{expected} |" in (tmp_path / "calibrate" / "calibrate.md").read_text()
