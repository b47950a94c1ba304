"""The planner: memory model, baselines, verifier, profiles, pins, infeasible budgets."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import public_configs
from ktc.api import load_model, plan
from ktc.errors import BudgetError, ConfigError, FormatError
from ktc.formats.activation_profile import ActivationProfile, load_activation_profile
from ktc.formats.hardware_profile import GiB, HardwareProfile
from ktc.formats.model_config import config_from_hf
from ktc.formats.schemes import ExpertShape, expert_footprint
from ktc.ir import Device
from ktc.passes.plan import PlannerOptions, Workload
from ktc.passes.plan_verify import recompute, verify_plan
from ktc.passes.planner import build_context, disk_staging_bytes, plan_placement


def test_kv_bytes_per_token_of_published_configs():
    mixtral = config_from_hf(public_configs.MIXTRAL_8X7B, "mixtral")
    qwen = config_from_hf(public_configs.QWEN3_30B_A3B, "qwen3")
    deepseek = config_from_hf(public_configs.DEEPSEEK_V3, "deepseek")
    assert mixtral.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert qwen.kv_bytes_per_token(2) == 2 * 48 * 4 * 128 * 2 == 98304
    assert deepseek.kv_bytes_per_token(2) == 61 * (512 + 64) * 2 == 70272
    assert deepseek.kv_bytes_per_token(1) == 35136


def zipf_profile(ir, seed: int = 0, exponent: float = 1.2) -> ActivationProfile:
    rng = np.random.default_rng(seed)
    n = ir.config.num_experts
    counts = np.array([rng.permutation(1000.0 / np.arange(1, n + 1) ** exponent) for _ in ir.moe_layers])
    return ActivationProfile(ir.moe_layer_indices, counts, "zipf")


def quarter_budget(ir, workload: Workload, scheme: str = "bf16", reserve: int = 0) -> HardwareProfile:
    """VRAM for everything fixed plus a quarter of the routed experts at ``scheme``."""
    probe = HardwareProfile(vram_bytes=10**15, ram_bytes=10**15, reserve_bytes=reserve)
    ctx = build_context(ir, probe, workload, None, PlannerOptions())
    fixed = sum(ctx.fixed_vram.values())
    shape = ExpertShape(ir.config.hidden_size, ir.moe_layers[0].experts[0].intermediate_size,
                        ir.moe_layers[0].experts[0].gate_bias is not None)
    total = len(ir.moe_layers) * ir.config.num_experts
    return HardwareProfile(vram_bytes=fixed + total // 4 * expert_footprint(shape, scheme).stored_bytes,
                           ram_bytes=64 * GiB, reserve_bytes=reserve)


@pytest.mark.parametrize("seed", range(6))
def test_zipf_quarter_budget_never_worse_than_baselines(demo_model, seed):
    ir = load_model(demo_model)
    workload = Workload(max_tokens=1024, batch=1 + seed % 3)
    hw = quarter_budget(ir, workload)
    result = plan_placement(ir, hw, workload, zipf_profile(ir, seed))
    verify_plan(ir, result)
    assert result.solve.optimal
    assert 0 < sum(result.placement.gpu_experts_per_layer()) < ir.config.num_experts * len(ir.moe_layers)
    for baseline in result.baselines:
        assert baseline.feasible, baseline.name
        assert result.predicted_ms_per_step <= baseline.predicted_ms_per_step * (1 + 1e-9), baseline.name


def test_every_code_path_passes_the_verifier(tiny_models, demo_model):
    cases = []
    for family in ("mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"):
        ir = load_model(tiny_models[family]["safetensors"])
        w = Workload(max_tokens=64)
        cases.append((ir, quarter_budget(ir, w, "bf16"), w, None, PlannerOptions()))
    ir = load_model(demo_model)
    w = Workload(max_tokens=256, batch=4, kv_dtype="fp8")
    hw = quarter_budget(ir, w)
    cases += [
        (ir, hw, w, zipf_profile(ir), PlannerOptions(gpu_schemes=("bf16", "int8", "int4"),
                                                     cpu_schemes=("int8", "int4"))),
        (ir, hw, w, zipf_profile(ir, 3), PlannerOptions(pin_gpu=((0, 5), (2, 1)), pin_cpu=((1, 0),))),
        (ir, hw, w, zipf_profile(ir, 4), PlannerOptions(gpu_schemes=("q8_0", "bf16"), cpu_schemes=("q4_0",),
                                                        quality_weight=1e-3)),
    ]
    for ir, hw, w, profile, options in cases:
        result = plan_placement(ir, hw, w, profile, options)
        verified = verify_plan(ir, result)  # checks the plan and every baseline
        assert verified.vram_bytes <= hw.vram_bytes
        for pin in options.pin_gpu:
            assert result.placement.of(*pin).device is Device.GPU
        for pin in options.pin_cpu:
            assert result.placement.of(*pin).device is Device.CPU


def test_llamacpp_plan_is_verified_and_not_better_than_per_expert(demo_model):
    from ktc.ir import ExpertPlacement, Placement
    from ktc.plan_report import llamacpp_plan

    ir = load_model(demo_model)
    w = Workload(max_tokens=256)
    result = plan_placement(ir, quarter_budget(ir, w), w, zipf_profile(ir, 1))
    cpp = llamacpp_plan(result)
    gpu, cpu = ExpertPlacement(Device.GPU, "bf16"), ExpertPlacement(Device.CPU, "int8")
    placement = Placement(result.placement.layers, tuple(
        tuple(cpu if layer in cpp.cpu_layers else gpu for _ in range(ir.config.num_experts))
        for layer in result.placement.layers))
    again = recompute(ir, placement, result.hardware, w, result.profile, result.options)
    assert not again.problems
    assert math.isclose(again.ms_per_step, cpp.predicted_ms_per_step, rel_tol=1e-9)
    assert cpp.predicted_ms_per_step >= result.predicted_ms_per_step * (1 - 1e-9)
    if cpp.cpu_layers == result.placement.layers[:len(cpp.cpu_layers)] and cpp.cpu_layers:
        assert cpp.rules == f"-ngl 999 --n-cpu-moe {cpp.cpu_layers[-1] + 1}"
    else:
        assert "-ot" in cpp.rules or not cpp.cpu_layers


def test_batch_raises_the_use_of_every_expert(demo_model):
    ir = load_model(demo_model)
    hw = quarter_budget(ir, Workload())
    one = plan_placement(ir, hw, Workload(batch=1), zipf_profile(ir))
    many = plan_placement(ir, hw, Workload(batch=16), zipf_profile(ir))
    assert (many.usage >= one.usage).all() and many.usage.max() <= 1.0
    assert many.predicted_ms_per_step > one.predicted_ms_per_step
    assert many.predicted_ms_per_token < one.predicted_ms_per_token


def test_infeasible_max_tokens_reports_the_largest_that_fits(demo_model):
    ir = load_model(demo_model)
    hw = quarter_budget(ir, Workload(max_tokens=1000))
    with pytest.raises(BudgetError) as info:
        plan_placement(ir, hw, Workload(max_tokens=10**7))
    largest = info.value.largest_max_tokens
    message = str(info.value)
    assert "kv cache" in message and "VRAM" in message and f"--max-tokens that fits is {largest}" in message
    assert largest >= 1000
    plan_placement(ir, hw, Workload(max_tokens=largest))  # fits exactly
    with pytest.raises(BudgetError):
        plan_placement(ir, hw, Workload(max_tokens=largest + 1))


def test_weights_alone_too_big(demo_model):
    ir = load_model(demo_model)
    with pytest.raises(BudgetError, match="no --max-tokens fits"):
        plan_placement(ir, HardwareProfile(vram_bytes=4 * 1024**2, ram_bytes=1024**2, reserve_bytes=0))


def test_pins_that_cannot_fit(demo_model):
    ir = load_model(demo_model)
    hw = quarter_budget(ir, Workload())
    pins = tuple((layer, e) for layer in ir.moe_layer_indices for e in range(ir.config.num_experts))
    with pytest.raises(BudgetError):
        plan_placement(ir, hw, Workload(), None, PlannerOptions(pin_gpu=pins))
    with pytest.raises(ConfigError, match="both"):
        PlannerOptions(pin_gpu=((0, 1),), pin_cpu=((0, 1),))
    with pytest.raises(ConfigError, match="not an expert"):
        plan_placement(ir, hw, Workload(), None, PlannerOptions(pin_gpu=((0, 99),)))


def test_activation_profile_files(demo_model, tmp_path):
    import torch

    ir = load_model(demo_model)
    layers, n = ir.moe_layer_indices, ir.config.num_experts
    kw = dict(moe_layers=layers, num_layers=ir.config.num_layers, num_experts=n)
    # ktc's own JSON round-trips.
    zipf = zipf_profile(ir)
    zipf.save(str(tmp_path / "p.json"))
    np.testing.assert_array_equal(load_activation_profile(str(tmp_path / "p.json"), **kw).counts, zipf.counts)
    # SGLang/KTransformers logical_count [buffer, layers, experts] is summed over the buffer.
    counts = torch.randint(0, 50, (3, len(layers), n))
    torch.save({"logical_count": counts}, tmp_path / "d.pt")
    loaded = load_activation_profile(str(tmp_path / "d.pt"), **kw)
    np.testing.assert_array_equal(loaded.counts, counts.sum(0).numpy())
    # Wrong shape, NaN and negative counts are refused.
    torch.save({"logical_count": torch.ones(2, len(layers), n + 1)}, tmp_path / "wrong.pt")
    with pytest.raises(ConfigError, match="experts"):
        load_activation_profile(str(tmp_path / "wrong.pt"), **kw)
    bad = zipf.to_json()
    bad["counts"][1][2] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match="NaN"):
        load_activation_profile(str(tmp_path / "nan.json"), **kw)
    bad["counts"][1][2] = -3
    (tmp_path / "neg.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="negative"):
        load_activation_profile(str(tmp_path / "neg.json"), **kw)


def test_full_scale_deepseek_v3_from_a_sparse_header(tmp_path):
    """Planning DeepSeek-V3 (58 MoE layers x 256 experts, 3 schemes) answers in seconds."""
    from ktc.demo import write_sparse_checkpoint

    described = write_sparse_checkpoint(public_configs.DEEPSEEK_V3, str(tmp_path / "ds3"))
    assert described > 1e12  # 1.3 TB of bf16 weights described, none written
    started = time.perf_counter()
    # Solve time is the benchmark's business (benchmarks/planner.py); here a generous limit keeps
    # a slow machine from turning a proven-optimal answer into a reported gap.
    result = plan(str(tmp_path / "ds3"), vram="80GiB", ram="1.5TiB", max_tokens=32768,
                  gpu_schemes=("bf16", "int4"), cpu_schemes=("int4",), time_limit=20)
    elapsed = time.perf_counter() - started
    assert elapsed < 30, elapsed
    assert result.model.num_experts == 256 and len(result.model.moe_layers) == 58
    assert result.solve.optimal or result.solve.gap < 1e-3
    with pytest.raises(BudgetError) as info:
        plan(str(tmp_path / "ds3"), vram="80GiB", ram="1.5TiB", max_tokens=10**8)
    largest = info.value.largest_max_tokens
    assert largest and largest > 32768
    plan(str(tmp_path / "ds3"), vram="80GiB", ram="1.5TiB", max_tokens=largest)


def test_generate_gpu_experts_masks_api():
    import torch

    import ktc

    freq = torch.tensor([[1.0, 50, 3, 80], [20, 4, 90, 1]])
    mask = ktc.generate_gpu_experts_masks(freq, vram_budget_bytes=3 * 1000, expert_bytes=1000, top_k=2)
    assert mask.dtype == torch.bool and mask.shape == freq.shape
    assert int(mask.sum()) <= 3
    # With no sync cost and equal sizes, the best 3 are the globally most used (KTransformers' rule).
    exact = ktc.generate_gpu_experts_masks(freq.numpy(), 3000, expert_bytes=1000, top_k=2, sync_seconds=0)
    assert exact.sum() == 3 and exact[0, 3] and exact[1, 2] and exact[0, 1]


def test_hardware_profile_file_and_flag_overrides(demo_model, tmp_path):
    from ktc.formats.hardware_profile import load_hardware_profile, make_hardware_profile, parse_bytes

    profile = HardwareProfile(vram_bytes=parse_bytes("16MiB"), ram_bytes=parse_bytes("1GiB"), reserve_bytes=0,
                              cpu_bandwidth=80e9, gpu_bandwidth=1.5e12, pcie_bandwidth=50e9, sync_seconds=2e-5)
    (tmp_path / "hw.json").write_text(json.dumps(profile.to_json()))
    loaded = load_hardware_profile(str(tmp_path / "hw.json"))
    assert loaded.cpu_bandwidth == 80e9 and loaded.vram_bytes == 16 * 1024**2
    overridden = make_hardware_profile(profile_path=str(tmp_path / "hw.json"), vram="32MiB", cpu_bandwidth="40GB/s")
    assert overridden.vram_bytes == 32 * 1024**2 and overridden.cpu_bandwidth == 40e9
    assert overridden.gpu_bandwidth == 1.5e12
    result = plan(demo_model, hardware=str(tmp_path / "hw.json"))
    assert result.hardware.sync_seconds == 2e-5 and result.memory.vram_budget == 16 * 1024**2
    assert parse_bytes("24GiB") == 24 * 1024**3 and parse_bytes("24GB") == 24 * 10**9
    with pytest.raises(ConfigError, match="24GiB"):
        parse_bytes("lots")


def test_baselines_do_not_depend_on_the_order_of_the_scheme_lists(demo_model):
    """Each baseline is measured at its best single scheme per device, so reordering
    --gpu-schemes changes nothing, and ktc's one-scheme placement separates what placement
    gains from what mixing schemes adds."""
    ir = load_model(demo_model)
    hw = quarter_budget(ir, Workload())
    profile = zipf_profile(ir)
    plans = [plan_placement(ir, hw, Workload(), profile,
                            PlannerOptions(gpu_schemes=gpu, cpu_schemes=("int4_g128", "int8")))
             for gpu in (("bf16", "int4_g128"), ("int4_g128", "bf16"))]
    first, second = ([(b.setting, b.schemes, round(b.predicted_ms_per_step, 9)) for b in p.baselines]
                     for p in plans)
    assert first == second
    for plan in plans:
        single = plan.single_scheme
        assert single is not None and single.schemes
        assert plan.predicted_ms_per_step <= single.predicted_ms_per_step + 1e-9
        for b in plan.baselines:
            if b.feasible:
                assert single.predicted_ms_per_step <= b.predicted_ms_per_step + 1e-9
    one = plan_placement(ir, hw, Workload(), profile)  # one scheme per device: nothing to separate
    assert one.single_scheme is None and all(b.schemes == "gpu bf16, cpu int8" for b in one.baselines if b.feasible)


def test_a_calibrated_profile_prices_cpu_experts_at_their_schemes_kernel_rates(demo_model):
    import dataclasses

    ir = load_model(demo_model)
    hw = quarter_budget(ir, Workload())
    rates = {"experts": {"int8": hw.cpu_bandwidth / 4}, "matrix": {"q4_0": hw.cpu_bandwidth / 2}}
    opts = PlannerOptions(gpu_schemes=("bf16",), cpu_schemes=("int8",))
    plain = build_context(ir, hw, Workload(), None, opts).problem.options
    calibrated = build_context(ir, dataclasses.replace(hw, cpu_scheme_bandwidth=rates), Workload(), None,
                               opts).problem.options
    for before, after in zip(plain, calibrated):
        factor = 4 if before.device == "cpu" else 1  # GPU experts keep the GPU bandwidth
        assert after.seconds_per_use == pytest.approx(factor * before.seconds_per_use)


def test_without_a_gpu_every_weight_lives_in_ram_and_the_disk_tier_takes_what_does_not_fit(demo_model):
    """--vram 0 plans for the CPU alone: the weights, KV cache and workspace that a GPU would
    hold are counted in RAM (no reserve), the CPU reads the non-expert weights, no layer pays a
    device's hand-off, and no expert goes to a GPU; the verifier agrees. Where RAM is short the
    disk tier takes the least used experts, and without one the refusal names RAM and the flag."""
    from ktc.plan_report import render_plan_text

    ir = load_model(demo_model)
    profile = zipf_profile(ir, seed=3)
    roomy = plan(ir, vram=0, ram="1GiB", profile=profile)
    verify_plan(ir, roomy)
    assert roomy.memory.vram_total == 0 and sum(roomy.placement.gpu_experts_per_layer()) == 0
    ram = dict(roomy.memory.ram)
    assert ram["kv_cache"] > 0 and ram["workspace"] > 0 and ram["attention"] > 0 and "reserve" not in ram
    ctx = build_context(ir, roomy.hardware, roomy.workload, profile, roomy.options)
    read = sum(v for k, v in ram.items() if k not in ("embeddings", "kv_cache", "workspace", "cpu_experts"))
    assert roomy.constant_ms == pytest.approx(1e3 * read / roomy.hardware.cpu_bandwidth)
    assert (ctx.problem.sync_seconds == 0).all()
    assert "VRAM: none (--vram 0)" in render_plan_text(roomy)
    fixed = sum(v for k, v in ram.items() if k != "cpu_experts")
    short = fixed + ram["cpu_experts"] // 2
    with pytest.raises(BudgetError, match=r"RAM binds \(no GPU, --vram 0\)") as refused:
        plan(ir, vram=0, ram=short, profile=profile)
    assert "--disk-bandwidth" in refused.value.hint
    tiered = plan(ir, vram=0, ram=short, profile=profile, disk_bandwidth="2GB/s")
    verify_plan(ir, tiered)
    devices = np.array([[p.device.value for p in row] for row in tiered.placement.experts])
    assert (devices == "disk").sum() > 0 and (devices == "cpu").sum() > 0 and (devices == "gpu").sum() == 0
    assert tiered.memory.ram_total <= short
    assert tiered.usage[devices == "disk"].mean() < tiered.usage[devices == "cpu"].mean()
    with pytest.raises(ConfigError, match="pinned to the GPU"):
        plan(ir, vram=0, ram="1GiB", pin_gpu=("0:1",))


def test_a_disk_tier_keeps_the_least_used_experts_on_disk_where_ram_is_short(demo_model):
    """With the disk's read bandwidth known, CPU experts that do not fit --ram stay on disk (no
    RAM, their bytes read from disk when used) instead of the plan being refused; the verifier
    agrees, the RAM budget holds, and the disk takes the least used experts."""
    ir = load_model(demo_model)
    profile = zipf_profile(ir, seed=3)
    tight = dict(vram="16MiB", ram="3MiB", reserve=0, profile=profile)
    with pytest.raises(BudgetError):
        plan(ir, **tight)
    made = plan(ir, **tight, disk_bandwidth="2GB/s")
    assert made.hardware.disk_bandwidth == 2e9
    verify_plan(ir, made)
    devices = np.array([[p.device.value for p in row] for row in made.placement.experts])
    assert (devices == "disk").sum() > 0 and (devices == "cpu").sum() > 0
    assert made.memory.ram_total <= made.memory.ram_budget
    usage = made.usage
    assert usage[devices == "disk"].mean() < min(usage[devices == "cpu"].mean(), usage[devices == "gpu"].mean())
    # the disk experts' pages in flight are counted in RAM: two layers' worth of a step's experts
    ram = dict(made.memory.ram)
    assert ram["disk_staging"] == disk_staging_bytes(ir, made.workload, made.options) > 0
    assert any(p.startswith("disk:") for row in made.to_json()["placement"].values() for p in row)
    roomy = plan(ir, vram="16MiB", ram="1GiB", reserve=0, profile=profile, disk_bandwidth="2GB/s")
    assert not any(p.device is Device.DISK for row in roomy.placement.experts for p in row)  # disk only when short
    assert "disk_staging" not in dict(roomy.memory.ram)
    text = HardwareProfile(vram_bytes=1, ram_bytes=1, disk_bandwidth=2e9).to_json()
    assert HardwareProfile.from_json(text).disk_bandwidth == 2e9
    assert "disk_bandwidth" not in HardwareProfile(vram_bytes=1, ram_bytes=1).to_json()  # older files stay as they were


def test_a_device_step_cost_is_planned_for_and_verified(demo_model, tmp_path):
    """The runtime's fixed cost of a layer's step with GPU experts: where it exceeds what the
    demo's small experts save on the GPU, the plan keeps them all on the CPU though VRAM holds
    them; a small one keeps the GPU experts; the verifier's own arithmetic agrees with each
    plan's prediction, and the profile file carries the figure (only when measured)."""
    from ktc.formats.hardware_profile import load_hardware_profile

    ir = load_model(demo_model)
    profile = zipf_profile(ir, seed=1)
    free = plan(ir, vram="16MiB", ram="1GiB", reserve=0, profile=profile)
    small = plan(ir, vram="16MiB", ram="1GiB", reserve=0, profile=profile, device_step_us=0.5)
    costly = plan(ir, vram="16MiB", ram="1GiB", reserve=0, profile=profile, device_step_us=500)
    assert sum(free.placement.gpu_experts_per_layer()) > 0
    assert sum(small.placement.gpu_experts_per_layer()) > 0
    assert sum(costly.placement.gpu_experts_per_layer()) == 0
    assert costly.hardware.device_step_seconds == 500e-6
    for made in (free, small, costly):
        verify_plan(ir, made)
    assert small.predicted_ms_per_token > free.predicted_ms_per_token
    assert "device_step_seconds" not in free.hardware.to_json()
    (tmp_path / "hw.json").write_text(json.dumps(costly.hardware.to_json()))
    assert load_hardware_profile(str(tmp_path / "hw.json")).device_step_seconds == 500e-6
