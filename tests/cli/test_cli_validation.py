"""Bad input files and flag values: each refused in a line or two (exit 2), never a traceback,
never accepted and turned into a wrong answer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from ktc.cli import main
from ktc.formats.hardware_profile import parse_bytes


def ktc(*args: str):
    return CliRunner().invoke(main, list(args))


def refused(result, *words: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, (word, result.output)


@pytest.fixture(scope="module")
def demo_plan(demo_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    result = ktc("plan", demo_model, "--vram", "16MiB", "--reserve", "0", "-o", str(path))
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def _profile(demo_plan) -> dict:
    layers = list(demo_plan["model"]["moe_layers"])
    experts = demo_plan["model"]["num_experts"]
    return {"format": "ktc-activation-profile", "version": 1, "layers": layers, "num_experts": experts,
            "counts": [[1.0] * experts for _ in layers]}


def _write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("change, words", [
    (lambda p: p.update(version="abc"), ["'version'", "whole number"]),
    (lambda p: p.update(version=None), ["'version'", "null"]),
    (lambda p: p.update(version=2), ["newer"]),
    (lambda p: p.update(layers="0,1"), ["'layers'", "list"]),
    (lambda p: p["layers"].__setitem__(0, -1), ["'layers'", "item 0"]),
    (lambda p: p["counts"].pop(), ["'counts'", "rows for"]),
    (lambda p: p["counts"][0].pop(), ["'counts'", "row 0"]),
    (lambda p: p["counts"][1].__setitem__(0, "7"), ["'counts'", "row 1"]),
    (lambda p: p["counts"][1].__setitem__(0, True), ["'counts'", "row 1"]),
    (lambda p: p.update(num_experts=0, counts=[[] for _ in p["layers"]]), ["'num_experts'", "at least 1"]),
    (lambda p: p["counts"][0].__setitem__(2, -3), ["negative"]),
])
def test_bad_activation_profile(tmp_path, demo_model, demo_plan, change, words):
    profile = _profile(demo_plan)
    change(profile)
    path = _write(tmp_path, "p.json", profile)
    refused(ktc("plan", demo_model, "--vram", "16MiB", "--profile", path), *words)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_json_numbers_are_refused(tmp_path, demo_model, demo_plan, literal):
    text = json.dumps(_profile(demo_plan)).replace("1.0", literal, 1)
    path = _write(tmp_path, "p.json", text)
    refused(ktc("plan", demo_model, "--vram", "16MiB", "--profile", path), "only finite numbers")


def test_expert_distribution_with_zero_experts(tmp_path, demo_model, demo_plan):
    layers = len(demo_plan["model"]["moe_layers"])
    torch.save({"logical_count": torch.zeros(3, layers, 0)}, tmp_path / "d.pt")
    refused(ktc("plan", demo_model, "--vram", "16MiB", "--profile", str(tmp_path / "d.pt")), "logical_count")


def test_oversized_and_endless_json_inputs_are_not_read(tmp_path, demo_model):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: 65 MiB that take no disk
    refused(ktc("plan", demo_model, "--vram", "16MiB", "--profile", str(big)), "larger than 64 MiB")
    refused(ktc("plan", demo_model, "--vram", "16MiB", "--profile", "/dev/zero"), "larger than 64 MiB")
    refused(ktc("plan", demo_model, "--hardware", str(big)), "larger than 64 MiB")


@pytest.mark.parametrize("field, value, words", [
    ("vram_bytes", "NaN", ["only finite numbers"]),
    ("vram_bytes", "null", ["'vram_bytes'", "null"]),
    ("vram_bytes", '"24GiB"', ["'vram_bytes'", "a string"]),
    ("vram_bytes", "true", ["'vram_bytes'", "a boolean"]),
    ("vram_bytes", "-1", ["'vram_bytes'", "at least 0"]),
    ("ram_bytes", "1.5", ["'ram_bytes'", "whole number"]),
    ("cpu_bandwidth", "0", ["'cpu_bandwidth'", "positive"]),
    ("sync_seconds", "-1", ["'sync_seconds'", "at least 0"]),
    ("version", '"1"', ["'version'"]),
])
def test_bad_hardware_profile(tmp_path, demo_model, field, value, words):
    fields = {"format": "ktc-hardware-profile", "version": 1, "vram_bytes": 16 * 2**20, "ram_bytes": 2**30}
    text = json.dumps({k: v for k, v in fields.items() if k != field})[:-1] + f', "{field}": {value}}}'
    path = _write(tmp_path, "hw.json", text)
    refused(ktc("plan", demo_model, "--hardware", path), *words)


@pytest.mark.parametrize("change, words", [
    (lambda p: p["placement"]["0"].__setitem__(0, "tpu:bf16"), ["tpu:bf16", "gpu:SCHEME"]),
    (lambda p: p["placement"]["0"].__setitem__(1, 3), ["expert 1", "3"]),
    (lambda p: p["placement"].update({"x": p["placement"]["0"]}), ["'x'", "layer number"]),
    (lambda p: p["placement"].update({"-1": p["placement"]["0"]}), ["'-1'", "layer number"]),
    (lambda p: p["placement"].update({"7": p["placement"]["0"]}), ["MoE layers"]),
    (lambda p: p["placement"]["0"].pop(), ["experts in layer 0"]),
    (lambda p: p["placement"]["0"].__setitem__(0, "cpu:int3"), ["int3"]),
    (lambda p: p.update(placement=[]), ["'placement'", "object"]),
    (lambda p: p.update(feasible=False), ["does not fit"]),
    (lambda p: p.update(model=7), ["'model'", "object"]),
    (lambda p: p["workload"].update(max_tokens=0), ["'max_tokens'", "at least 1"]),
    (lambda p: p["workload"].update(kv_dtype="int2"), ["'kv_dtype'", "int2"]),
])
def test_bad_plan_file(tmp_path, demo_model, demo_plan, change, words):
    plan = json.loads(json.dumps(demo_plan))
    change(plan)
    path = _write(tmp_path, "plan.json", plan)
    refused(ktc("compile", demo_model, "--plan", path, "-o", str(tmp_path / "x.ktb")), *words)
    assert not (tmp_path / "x.ktb").exists()


@pytest.mark.parametrize("flag, value, words", [
    ("--quality-weight", "-1", ["--quality-weight", "x>=0"]),
    ("--quality-weight", "nan", ["--quality-weight", "finite"]),
    ("--time-limit", "-1", ["--time-limit", "x>0"]),
    ("--time-limit", "0", ["--time-limit", "x>0"]),
    ("--time-limit", "nan", ["--time-limit", "finite"]),
    ("--sync-us", "nan", ["--sync-us", "finite"]),
    ("--sync-us", "-5", ["--sync-us", "x>=0"]),
    ("--device-step-us", "inf", ["--device-step-us", "finite"]),
    ("--device-step-us", "-1", ["--device-step-us", "x>=0"]),
    ("--vram", "lots", ["24GiB"]),
    ("--request", "4000", ["--request", "4000:300"]),
    ("--request", "0:300", ["--request", "4000:300"]),
    ("--request", "4000:-1", ["--request", "4000:300"]),
    ("--request", "many:few", ["--request", "4000:300"]),
])
def test_bad_planner_flags(demo_model, flag, value, words):
    args = ["plan", demo_model, "--vram", "16MiB", flag, value]
    refused(ktc(*args), *words)


@pytest.mark.parametrize("args, words", [
    (["--profile", "p.json"], ["--profile is a planner flag"]),
    (["--batch", "2", "--ram", "1GiB"], ["--ram, --batch are planner flags"]),
    (["--reserve", "0"], ["--reserve is a planner flag"]),
    (["--request", "4000:300"], ["--request is a planner flag"]),
])
def test_compile_refuses_planner_flags_without_a_budget(tmp_path, demo_model, args, words):
    refused(ktc("compile", demo_model, "-o", str(tmp_path / "x.ktb"), *args), *words)


@pytest.mark.parametrize("flag", [["--max-tokens", "100"], ["--batch", "2"], ["--profile", "p.json"]])
def test_compile_refuses_flags_a_plan_file_fixes(tmp_path, demo_model, demo_plan, flag):
    path = _write(tmp_path, "plan.json", demo_plan)
    refused(ktc("compile", demo_model, "--plan", path, "-o", str(tmp_path / "x.ktb"), *flag),
            flag[0], "the plan file fixes")


def test_one_rule_for_size_suffixes():
    assert parse_bytes("512M") == parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1K") == 1000 and parse_bytes("2G") == 2 * 10**9 and parse_bytes("1T") == 10**12
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1GiB") == 2**30 and parse_bytes("1TiB") == 2**40
    assert parse_bytes("1.5GiB") == 3 * 2**29


@pytest.mark.parametrize("flag, value, words", [
    ("--vram", "24", ["'24' has no unit", "24GiB", "24GB"]),
    ("--ram", "64", ["'64' has no unit"]),
    ("--reserve", "1.5", ["'1.5' has no unit"]),
    ("--cpu-bandwidth", "200", ["'200' has no unit", "200GB/s"]),
    ("--gpu-bandwidth", "fast", ["as a bandwidth", "60GB/s"]),
])
def test_a_size_or_bandwidth_needs_its_unit(demo_model, flag, value, words):
    args = ["plan", demo_model, flag, value] + (["--vram", "16MiB"] if flag != "--vram" else [])
    refused(ktc(*args), *words)


def test_zero_needs_no_unit_and_a_24gb_budget_reads_as_gib(demo_model):
    result = ktc("plan", demo_model, "--vram", "24GB", "--reserve", "0")
    assert result.exit_code == 0, result.output
    assert "of 22.4 GiB" in result.output  # a "24GB" card's budget, visibly
    assert "1.00x" not in result.output and "same as ktc" in result.output  # every plan fits all


def test_compile_refuses_schemes_a_plan_file_fixes(tmp_path, demo_model):
    plan = tmp_path / "plan.json"
    assert ktc("plan", demo_model, "--vram", "16MiB", "--reserve", "0", "--dense-scheme", "q8_0",
               "-o", str(plan)).exit_code == 0
    out = str(tmp_path / "x.ktb")
    refused(ktc("compile", demo_model, "--plan", str(plan), "-o", out, "--cpu-scheme", "int4_g128"),
            "--cpu-scheme", "the plan file fixes")
    refused(ktc("compile", demo_model, "--plan", str(plan), "-o", out, "--gpu-schemes", "int8"),
            "--gpu-scheme", "the plan file fixes")
    refused(ktc("compile", demo_model, "--plan", str(plan), "-o", out, "--dense-scheme", "bf16"),
            "made for dense scheme q8_0, not bf16")
    done = ktc("compile", demo_model, "--plan", str(plan), "-o", out, "--json")
    assert done.exit_code == 0, done.output
    from ktc.formats.bundle import open_bundle

    with open_bundle(out) as b:
        assert b.run_info["dense_scheme"] == "q8_0"  # the plan's, without being told again


def test_compile_with_a_budget_takes_scheme_lists_and_prints_its_plan(tmp_path, demo_model):
    result = ktc("compile", demo_model, "-o", str(tmp_path / "x.ktb"), "--vram", "16MiB", "--reserve", "0",
                 "--cpu-schemes", "int8,q4_0", "--gpu-schemes", "bf16,int8")
    assert result.exit_code == 0, result.output
    assert "predicted:" in result.output and "baselines on the same budget" in result.output
    assert "schemes: " in result.output and "wrote " in result.output
    refused(ktc("compile", demo_model, "-o", str(tmp_path / "y.ktb"), "--cpu-schemes", "int8,q4_0"),
            "one CPU scheme, not 2")


def test_every_output_file_needs_an_existing_folder_and_gets_the_umask_mode(tmp_path, demo_model):
    missing = tmp_path / "missing"
    for args in (["plan", demo_model, "--vram", "16MiB", "-o", str(missing / "p.json")],
                 ["plan", demo_model, "--vram", "16MiB", "--html", str(missing / "p.html")],
                 ["compile", demo_model, "-o", str(missing / "x.ktb")],
                 ["doctor", "--write-profile", str(missing / "hw.json")]):
        refused(ktc(*args), "the output folder does not exist")
    assert not missing.exists()
    from ktc.demo import write_demo_model

    old = os.umask(0o022)
    try:
        folder = write_demo_model(str(tmp_path / "demo"))
        assert ktc("compile", folder, "-o", str(tmp_path / "x.ktb")).exit_code == 0
    finally:
        os.umask(old)
    for path in [tmp_path / "x.ktb", *(tmp_path / "demo").iterdir()]:
        assert os.stat(path).st_mode & 0o777 == 0o644, path


def test_doctor_without_cuda_advises_a_plan_that_runs(tmp_path, demo_model, monkeypatch):
    import ktc.runtime.doctor as doctor

    monkeypatch.setattr(doctor, "read_bandwidth", lambda *a, **k: 40e9)  # the advice, not the machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "_nvidia_gpu_present", lambda: True)
    monkeypatch.setattr(doctor, "_cpu_only_torch", lambda: True)
    hw = tmp_path / "hw.json"
    result = ktc("doctor", "--write-profile", str(hw))
    assert result.exit_code == 0, result.output
    assert "--vram 0" not in result.output and "--vram 24GiB" in result.output
    assert "CPU-only build" in result.output and "install a CUDA build" in result.output
    assert "vram_bytes" not in json.loads(hw.read_text())
    refused(ktc("plan", demo_model, "--hardware", str(hw)), "no vram_bytes", "--vram 24GiB")
    planned = ktc("plan", demo_model, "--hardware", str(hw), "--vram", "16MiB", "--reserve", "0")
    assert planned.exit_code == 0, planned.output


def test_experts_on_cuda_without_cuda_is_a_clear_error(tmp_path, tiny_models, monkeypatch):
    from ktc.compile import compile_bundle
    from ktc.errors import KtcError
    from ktc.formats.bundle import open_bundle
    from ktc.runtime.moe import moe_layers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = str(tmp_path / "m.ktb")
    compile_bundle(tiny_models["qwen3_moe"]["safetensors"], path)
    with open_bundle(path) as bundle, pytest.raises(KtcError, match="torch sees no CUDA device"):
        moe_layers(bundle, device="cuda")


def test_one_json_convention(tmp_path, demo_model):
    """Every --json output names its command and version; an error under --json is a JSON
    object on stdout too, with the exit code unchanged."""
    bundle = str(tmp_path / "b.ktb")
    outputs = {
        "inspect": ktc("inspect", demo_model, "--json"),
        "compile": ktc("compile", demo_model, "-o", bundle, "--json"),
        "verify": ktc("verify", bundle, "--json"),
        "bench": ktc("bench", bundle, "--tokens", "1", "--steps", "1", "--json"),
    }
    outputs["inspect-bundle"] = ktc("inspect", bundle, "--json")
    for name, result in outputs.items():
        assert result.exit_code == 0, (name, result.output)
        data = json.loads(result.stdout)
        assert data["format"] == "ktc-" + name.split("-")[0] and data["version"] == 1, name
    assert json.loads(outputs["inspect"].stdout)["source_format"] == "safetensors"
    plan = ktc("plan", demo_model, "--vram", "16MiB", "--reserve", "0", "--json")
    assert json.loads(plan.stdout)["format"] == "ktc-plan"
    bad = ktc("plan", demo_model, "--vram", "1MiB", "--json")
    assert bad.exit_code == 2
    error = json.loads(bad.stdout)
    assert error["format"] == "ktc-error" and error["error"] == "BudgetError"
    assert "does not fit" in error["message"] and error["hint"]
