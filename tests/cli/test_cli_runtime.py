"""``ktc bench`` and ``ktc doctor``: the figures and files they promise."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktc.cli import main
from ktc.compile import compile_bundle


def test_bench_json(tmp_path, tiny_models):
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models["qwen3_moe"]["safetensors"], str(path), cpu_scheme="int8")
    result = CliRunner().invoke(main, ["bench", str(path), "--tokens", "1,4", "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["roofline_gbps"] > 0
    for count in ("1", "4"):
        fig = out["tokens"][count]
        assert fig["ms_per_token"] > 0 and fig["weight_gbps"] > 0
        assert 0 < fig["roofline_fraction"] == fig["weight_gbps"] / out["roofline_gbps"]
        assert set(fig["layers"]) == {"0", "1", "2"}


def test_doctor_writes_a_profile_the_planner_reads(tmp_path, demo_model):
    profile = tmp_path / "hw.json"
    result = CliRunner().invoke(main, ["doctor", "--json", "--write-profile", str(profile)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["read_bandwidth_gbps"] > 0 and report["cpu"]["cores"] >= 1
    assert set(report["cpu"]["features"]) == {"avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"}
    from ktc.runtime import amx, vnni

    assert report["kernels"]["vnni"] is vnni.HAVE_VNNI  # which 4-bit kernels this process runs
    assert report["kernels"]["amx"] is amx.HAVE_AMX and ("AMX" in report["kernels"]["description"]) is (
        amx.HAVE_AMX or (report["cpu"]["features"]["amx"] and vnni.HAVE_VNNI))
    try:  # the fused device kernels' Triton, or why a GPU's experts would not get them
        import triton

        assert report["versions"]["triton"] == triton.__version__
    except ImportError:
        assert report["versions"]["triton"] == "not installed"
        assert any("Triton is not installed" in w for w in report["warnings"]) is bool(report["cuda"])
    from ktc.api import plan

    result = plan(demo_model, hardware=str(profile), vram="16MiB", reserve=0)
    assert abs(result.hardware.cpu_bandwidth / 1e9 - report["read_bandwidth_gbps"]) < 1e-6


@pytest.mark.slow
def test_doctor_calibrate_writes_what_the_cpu_cost_model_reads(tmp_path, demo_model):
    profile = tmp_path / "hw.json"
    result = CliRunner().invoke(main, ["doctor", "--calibrate", "--write-profile", str(profile)])
    assert result.exit_code == 0, result.output
    assert "experts GB/s" in result.output and "a layer" in result.output
    from ktc.formats.hardware_profile import load_hardware_profile

    hw = load_hardware_profile(str(profile), vram_bytes=0)
    assert hw.cpu_scheme_bandwidth["matrix"]["int8"] > 0 and hw.cpu_scheme_bandwidth["experts"]["int8"] > 0
    assert hw.cpu_layer_seconds > 0
    from ktc.api import plan

    assert plan(demo_model, hardware=str(profile), vram="16MiB", reserve=0).hardware.cpu_scheme_bandwidth


@pytest.mark.parametrize("after, warned", [(30e9, False), (34e9, False), (40e9, True), (20e9, True)])
def test_doctor_calibrate_warns_when_the_bandwidth_moves_under_it(monkeypatch, after, warned):
    """The read bandwidth measured again after the calibration; a move of more than 15% from
    the one before it is warned of (the calibration itself stands in here: the real one takes a
    minute)."""
    import dataclasses

    import ktc.calibrate
    import ktc.runtime.doctor as doctor

    rates = iter([30e9, after])
    monkeypatch.setattr(doctor, "read_bandwidth", lambda *args, **kwargs: next(rates))
    monkeypatch.setattr(ktc.calibrate, "calibrate", lambda base, **kwargs: dataclasses.replace(
        base, cpu_scheme_bandwidth={"experts": {"int8": 1e10}, "matrix": {"int8": 1e10}}))
    result = CliRunner().invoke(main, ["doctor", "--calibrate", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["read_bandwidth_gbps"] == 30 and report["read_bandwidth_after_calibration_gbps"] == after / 1e9
    assert any("moved from 30.0 to" in w for w in report["warnings"]) == warned
    assert doctor.unsteady_warning(0, after) is None


def test_doctor_disk_measures_the_disk_tier_rate_and_plan_uses_it(tmp_path, demo_model, monkeypatch):
    """ktc doctor --disk DIR writes the disk's read bandwidth into the profile; ktc plan with it
    and a short --ram keeps the least used experts on disk and says so."""
    import ktc.runtime.doctor as doctor

    measured = []
    real = doctor.disk_read_bandwidth
    monkeypatch.setattr(doctor, "disk_read_bandwidth",
                        lambda folder: measured.append(folder) or real(folder, nbytes=8 * 1024 * 1024))
    profile = tmp_path / "hw.json"
    result = CliRunner().invoke(main, ["doctor", "--disk", str(tmp_path), "--write-profile", str(profile)])
    assert result.exit_code == 0, result.output
    assert measured == [str(tmp_path)] and "GB/s read under" in result.output
    written = json.loads(profile.read_text())
    assert written["disk_bandwidth"] > 0
    result = CliRunner().invoke(main, ["plan", demo_model, "--hardware", str(profile), "--vram", "16MiB",
                                       "--ram", "3MiB", "--reserve", "0"])
    assert result.exit_code == 0, result.output
    assert "disk tier:" in result.output and "disk int8 x" in result.output
