"""``ktc plan`` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from click.testing import CliRunner

from ktc.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_plan_json_fields(demo_model):
    result = run("plan", demo_model, "--vram", "40MiB", "--reserve", "0", "--max-tokens", "512", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    for key in ("feasible", "predicted_ms_per_token", "memory", "gpu_experts_per_layer", "baselines",
                "solve_seconds"):
        assert key in out
    assert out["feasible"] is True
    assert set(out["baselines"]) == {"uniform", "global_topk", "n_cpu_moe"}
    for baseline in out["baselines"].values():
        assert baseline["predicted_ms_per_token"] >= out["predicted_ms_per_token"] * (1 - 1e-9)
        assert baseline["ktc_speedup"] >= 1 - 1e-9
    assert out["memory"]["vram_total"] <= out["memory"]["vram_budget"]
    assert set(out["memory"]["vram"]) >= {"kv_cache", "workspace", "reserve", "gpu_experts", "attention"}


def test_plan_text_exports_and_html(demo_model, tmp_path):
    import torch

    profile = {"format": "ktc-activation-profile", "version": 1, "layers": [0, 1, 2, 3], "num_experts": 16,
               "counts": [list(np.random.default_rng(i).zipf(1.5, 16).astype(float)) for i in range(4)]}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    result = run("plan", demo_model, "--vram", "40MiB", "--reserve", "0", "--max-tokens", "512",
                 "--profile", str(tmp_path / "profile.json"), "--export-kt", str(tmp_path / "kt"),
                 "--export-llamacpp", "--html", str(tmp_path / "plan.html"), "-o", str(tmp_path / "plan.json"))
    assert result.exit_code == 0, result.output
    text = result.output
    assert "ms/token" in text and "tokens/s" in text and "x faster" in text
    for name in ("uniform", "global_topk", "n_cpu_moe"):
        assert name in text
    assert "-ngl 999" in text
    mask = torch.load(tmp_path / "kt" / "gpu_experts_mask.pt", weights_only=True)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (4, 16)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["format"] == "ktc-plan" and len(saved["placement"]["0"]) == 16
    assert int(mask.sum()) == sum(saved["gpu_experts_per_layer"].values())
    page = (tmp_path / "plan.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert page.count("<rect") == 64 + 2 * 4  # a cell per expert, two time bars per layer
    assert "uniform (no --profile)" not in page  # the profile given is named as the source
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_plan_budget_error_is_short_and_nonzero(demo_model):
    proc = subprocess.run([sys.executable, "-m", "ktc.cli", "plan", demo_model, "--vram", "4MiB",
                           "--reserve", "0", "--max-tokens", "100000"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert 2 <= len(lines) <= 6, proc.stderr
    assert "VRAM" in proc.stderr and "--max-tokens" in proc.stderr


def test_plan_needs_a_budget(demo_model):
    result = CliRunner().invoke(main, ["plan", demo_model])
    assert result.exit_code != 0 and "--vram" in result.output


def test_plan_help_has_examples():
    result = run("plan", "--help")
    assert result.exit_code == 0 and "Examples" in result.output and "--export-llamacpp" in result.output


def test_plan_json_on_real_stdout_is_clean_and_deterministic(demo_model):
    """Nothing else (a solver banner, progress) may reach standard output with --json."""
    args = [sys.executable, "-m", "ktc.cli", "plan", demo_model, "--vram", "40MiB", "--reserve", "0",
            "--gpu-schemes", "bf16,int8", "--cpu-schemes", "int8,int4"]
    outs = []
    for _ in range(2):
        proc = subprocess.run(args + ["--json"], capture_output=True, text=True, check=True)
        out = json.loads(proc.stdout)
        outs.append((out["gpu_experts_per_layer"], out["predicted_ms_per_step"]))
    assert outs[0] == outs[1]


def test_budget_error_names_the_binding_limit_in_readable_units(demo_model):
    def error(*flags: str) -> str:
        result = run("plan", demo_model, "--reserve", "0", *flags)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        return result.output

    vram = error("--vram", "4MiB", "--max-tokens", "100000")
    assert "VRAM binds" in vram and "VRAM 4.0 MiB: fixed 199.9 MiB" in vram and "0.0 MiB" not in vram
    both = error("--vram", "16MiB", "--ram", "1MiB")
    assert "VRAM and RAM together are too small" in both
    assert "with this RAM it needs" in both and "(--vram)" in both
    assert "with this VRAM it needs" in both and "(--ram)" in both
    ram = error("--vram", "1GiB", "--ram", "100KiB")
    assert "RAM binds" in ram and "RAM  100.0 KiB: fixed 512.0 KiB" in ram
    for flag in ("--cpu-schemes", "--dense-scheme", "--reserve", "--vram/--ram"):
        assert flag in vram


def test_exports_that_run(tmp_path, demo_model):
    """KTransformers' suggestion fits the budget, the SGLang command places ktc's experts through
    the frequency strategy, and llama.cpp gets --n-cpu-moe when that is the plan."""
    import json

    import numpy as np
    import torch

    from ktc.api import plan
    from ktc.formats.activation_profile import load_activation_profile
    from ktc.plan_report import export_kt, kt_mask, llamacpp_plan

    made = plan(demo_model, vram="14MiB", reserve="0")
    info = export_kt(made, str(tmp_path / "kt"))
    assert info == json.loads((tmp_path / "kt" / "kt_args.json").read_text())
    uniform = made.baseline("uniform")
    layers = len(made.model.moe_layers)
    assert info["kt_num_gpu_experts"] <= uniform.gpu_experts // layers  # fits, like the baseline
    assert "--kt-expert-placement-strategy frequency" in info["sglang_command"]
    assert f"--init-expert-location {info['activation_stats']}" in info["sglang_command"]
    total = made.model.num_experts * layers
    for rounding in (int, round):  # the ratio gives ktc's count however it is turned into one
        assert rounding(info["kt_gpu_experts_ratio"] * total) == info["gpu_experts_total"]
    # The distribution, read back as SGLang's format: ktc's GPU experts are the most frequent,
    # in every layer and over the whole model.
    stats = load_activation_profile(info["activation_stats"], moe_layers=made.model.moe_layers,
                                    num_layers=made.model.num_layers, num_experts=made.model.num_experts)
    mask = kt_mask(made)[list(made.model.moe_layers)]
    top = np.argsort(-stats.counts, axis=None, kind="stable")[: info["gpu_experts_total"]]
    assert mask.reshape(-1)[top].all()
    assert torch.load(info["gpu_experts_mask"]).sum() == info["gpu_experts_total"]
    everything = export_kt(plan(demo_model, vram="1GiB", reserve="0"), str(tmp_path / "all"))
    assert everything["kt_gpu_experts_ratio"] == 1.0  # never above 1
    cpp = llamacpp_plan(plan(demo_model, vram="13MiB", reserve="0"))
    assert cpp.cpu_layers == (0, 1, 2, 3) and cpp.rules == "-ngl 999 --n-cpu-moe 4"


def test_bench_explains_itself(tmp_path, demo_model):
    import json

    plan_path = tmp_path / "plan.json"
    assert run("plan", demo_model, "--vram", "16MiB", "--reserve", "0", "--cpu-bandwidth", "100000GB/s",
               "-o", str(plan_path)).exit_code == 0
    bundle = str(tmp_path / "b.ktb")
    assert run("compile", demo_model, "--plan", str(plan_path), "-o", bundle).exit_code == 0
    text = run("bench", bundle, "--tokens", "1", "--steps", "1", "--threads", "1")
    assert "1 threads" in text.output and "read bandwidth measured" in text.output
    assert "the plan assumed 100000 GB/s" in text.output and "under half" in text.output
    assert "the cost model for these bytes" in text.output and "at the plan's" in text.output
    fig = json.loads(run("bench", bundle, "--tokens", "1", "--steps", "1", "--json").output)
    one = fig["tokens"]["1"]
    assert fig["plan_cpu_bandwidth_gbps"] == 100000 and fig["warnings"]
    assert one["predicted_ms_per_step"] < one["roofline_ms_per_step"]  # a planned 100 TB/s
    plain = str(tmp_path / "cpu.ktb")
    assert run("compile", demo_model, "-o", plain).exit_code == 0
    fig = json.loads(run("bench", plain, "--tokens", "1", "--steps", "1", "--json").output)
    assert fig["plan_cpu_bandwidth_gbps"] is None and fig["tokens"]["1"]["predicted_ms_per_step"] is None


def test_heatmap_structure(tmp_path, demo_model):
    """The page's parts: experts sorted by use within each layer (index in the tooltip), cells
    apart, a colour scale per device, per-layer GPU count and time bars, schemes, budgets,
    bandwidths, the exports, and ktc's own row among the baselines."""
    import re

    from ktc.api import plan
    from ktc.formats.activation_profile import ActivationProfile
    from ktc.plan_report import render_plan_html

    rng = np.random.default_rng(1)
    counts = rng.random((4, 16)) * 100
    made = plan(demo_model, vram="14MiB", reserve="0", profile=ActivationProfile((0, 1, 2, 3), counts, "test"))
    page = render_plan_html(made)
    cells = re.findall(r'<rect x="([0-9.]+)" y="([0-9.]+)" width="([0-9.]+)" height="[0-9.]+" fill="[^"]+">'
                       r'<title>layer (\d+), expert (\d+) \(rank (\d+)\): (gpu|cpu) (\w+), used ([0-9.]+)', page)
    assert len(cells) == 64
    for layer in range(4):
        row = sorted((float(x), int(e), float(u)) for x, _, _, lay, e, _, _, _, u in cells if int(lay) == layer)
        uses = [u for _, _, u in row]
        assert uses == sorted(uses, reverse=True)  # most routed to first
        assert sorted(e for _, e, _ in row) == list(range(16))
        widths = {float(w) for x, _, w, lay, *_ in cells if int(lay) == layer}
        step = row[1][0] - row[0][0]
        assert all(w < step for w in widths)  # a gap between neighbours
    assert page.count('class="scale"') == 2 and "GPU</b>" in page and "CPU</b>" in page
    for layer, n in zip(made.placement.layers, made.placement.gpu_experts_per_layer()):
        assert f"layer {layer}: GPU experts" in page and f"{n}/16 GPU" in page
    for words in ("GPU schemes allowed", "VRAM budget", "RAM budget", "bandwidths", "CPU-GPU sync",
                  "--export-kt", "--export-llamacpp", "<td>ktc</td><td>this plan</td>", "<td>routing</td>"):
        assert words in page, words
    assert "uniform (no --profile)" not in page  # the profile given is named as the source
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
