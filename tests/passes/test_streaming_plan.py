"""The streaming plan (``ktc.streaming``): cache slots traded for residents on a routing trace's
replay, the prefill offload's threshold, what the bundle records and what the runtime follows."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import model_factory as mf
from ktc.api import plan
from ktc.compile import compile_bundle
from ktc.errors import ConfigError, FormatError
from ktc.formats.bundle import open_bundle
from ktc.formats.hardware_profile import HardwareProfile
from ktc.formats.schemes import ExpertShape, expert_footprint
from ktc.runtime.expert_cache import LayerCache, replay_trace
from ktc.streaming import DEFAULT_PREFILL_MIN_TOKENS, load_trace, sparse_slots


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("streaming") / "src")
    mf.write_safetensors(mf.build_hf_model("qwen3_moe").eval(), folder)
    mf.write_char_tokenizer(folder, 40)
    return folder


def _drifting(tokens: int, period: int, seed: int = 0) -> np.ndarray:
    """[tokens, layers, k]: each layer's top k drawn from a skewed popularity whose order moves
    every ``period`` tokens."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, mf.EXPERTS + 1) ** 2.0
    p /= p.sum()
    out = np.empty((tokens, mf.LAYERS, mf.TOP_K), dtype=np.int64)
    for t in range(tokens):
        order = (np.arange(mf.EXPERTS) + 3 * (t // period)) % mf.EXPERTS
        for li in range(mf.LAYERS):
            out[t, li] = order[rng.choice(mf.EXPERTS, mf.TOP_K, replace=False, p=p)]
    return out


# A machine whose CPU is slow beside its link, and no sync cost: the tiny model's experts then
# weigh what real ones do (at 60 GB/s and 50 us a layer the sync alone would decide).
SLOW_CPU = {"sync_us": 0, "cpu_bandwidth": "2GB/s", "pcie_bandwidth": "1GB/s"}


def _budget(source: str, experts: int) -> int:
    """A VRAM budget that holds the model's fixed part and ``experts`` bf16 experts."""
    made = plan(source, vram="1GiB", reserve=0)
    fixed = sum(v for k, v in made.memory.vram if k != "gpu_experts")
    return fixed + experts * 3 * mf.HIDDEN * 32 * 2


def test_replay_times_a_static_plan_as_the_planner_does():
    """One layer, expert 0 on the device: every token costs the slower side plus the sync; a
    cache of one slot takes the repeated CPU expert in once its copy has landed, and the CPU
    reads slower while the copy is under way."""
    routes = np.array([[[0, 1]]] * 6)
    device = np.full((1, 4), 1.0)
    cpu = np.full((1, 4), 3.0)
    static = replay_trace(routes, None, [frozenset({0})], device, cpu, np.array([0.5]), 2.0, 60e9, 25e9)
    assert static.seconds == pytest.approx(6 * (3.0 + 0.5)) and (static.hits, static.uses) == (6, 12)
    assert static.layer_seconds.tolist() == [static.seconds]
    caches = [LayerCache(4, 1, 100, resident=(0,), initial=())]
    cached = replay_trace(routes, caches, [frozenset({0})], device, cpu, np.array([0.5]), 2.0, 60e9, 25e9)
    # token 1 misses and starts the copy (lands at 2.0 s), its CPU expert read beside the copy
    # (60 GB/s less 25); from token 2 (at 5.6 s) both experts are on the device
    assert cached.uploaded == 1 and cached.hits == 1 + 5 * 2
    assert cached.seconds == pytest.approx(3.0 * 60 / 35 + 0.5 + 5 * 2.0)


def test_a_trace_trades_residents_for_slots_only_where_its_replay_gains(source, tmp_path):
    routes = _drifting(400, 50)
    np.save(tmp_path / "routes.npy", routes)
    budget = _budget(source, 10)
    static = plan(source, vram=budget, reserve=0, cpu_schemes=("bf16",), **SLOW_CPU)
    assert static.streaming.cache_slots == 0 and not static.streaming.splits
    assert "no routing trace" in static.streaming.evidence
    made = plan(source, vram=budget, reserve=0, cpu_schemes=("bf16",), trace=str(tmp_path / "routes.npy"),
                **SLOW_CPU)
    st = made.streaming
    splits = {s.slots: s for s in st.splits}
    # the static split is the plan without slots; the chosen one predicts the fewest ms/token
    assert splits[0].gpu_experts == sum(static.placement.gpu_experts_per_layer())
    assert st.chosen.ms_per_token == min(s.ms_per_token for s in st.splits)
    assert st.cache_slots > 0 and st.chosen.ms_per_token < splits[0].ms_per_token  # drifting: slots gain
    slot_bytes = 3 * mf.HIDDEN * 32 * 2
    assert st.slot_scheme == "bf16" and st.slot_bytes == slot_bytes
    # the slots are counted in VRAM; the residents were solved under what they leave
    vram = dict(made.memory.vram)
    assert vram["cache_slots"] == made.options.cache_vram == st.cache_slots * mf.LAYERS * slot_bytes
    assert made.memory.vram_total <= budget
    assert sum(made.placement.gpu_experts_per_layer()) == st.chosen.gpu_experts < splits[0].gpu_experts
    from ktc.plan_report import render_plan_text

    text = render_plan_text(made)
    assert f"chosen: {st.cache_slots} slots a layer at bf16" in text and "may not use" not in text
    # slots of a scheme the residents could not take: the text says part of the gain may be that
    other = dataclasses.replace(made, options=dataclasses.replace(made.options, gpu_schemes=("int8",)))
    assert "which the residents may not use" in render_plan_text(other)
    data = made.to_json()["streaming"]
    assert data["cache_slots"] == st.cache_slots and data["cache_vram_bytes"] == vram["cache_slots"]
    # routing that stays put: one expert pair, always the same
    np.save(tmp_path / "steady.npy", np.tile(np.array([[[1, 2]] * mf.LAYERS]), (300, 1, 1)))
    steady = plan(source, vram=budget, reserve=0, cpu_schemes=("bf16",), trace=str(tmp_path / "steady.npy"))
    assert steady.streaming.chosen.ms_per_token <= min(s.ms_per_token for s in steady.streaming.splits)


def test_sparse_slots_go_to_the_layers_that_gain_most_and_only_where_they_gain():
    gains = np.array([0.3, -0.1, 0.5, 0.0, 0.2, 0.4, 0.1, 0.0])
    assert sparse_slots(gains, 0.25) == (0, 0, 1, 0, 0, 1, 0, 0)
    assert sparse_slots(gains, 0.5) == (1, 0, 1, 0, 1, 1, 0, 0)
    assert sparse_slots(gains, 0.75) == (1, 0, 1, 0, 1, 1, 1, 0)  # six asked, five gain
    assert sparse_slots(np.zeros(4), 0.5) == (0, 0, 0, 0) and sparse_slots(np.ones(4), 0.01) == (1, 0, 0, 0)


def test_a_budget_under_one_expert_a_layer_keeps_slots_in_some_layers(source, tmp_path):
    """Where the VRAM left for experts holds fewer than the MoE layers, one slot a layer does not
    fit; the planner tries one slot in some layers instead, the bundle records each layer's and
    the runtime keeps them there alone."""
    from ktc.plan_report import render_plan_text
    from ktc.runtime.hf import from_bundle

    np.save(tmp_path / "routes.npy", _drifting(400, 50))
    budget = _budget(source, mf.LAYERS - 1)
    made = plan(source, vram=budget, reserve=0, cpu_schemes=("bf16",), trace=str(tmp_path / "routes.npy"),
                **SLOW_CPU)
    st = made.streaming
    assert all(max(s.layer_slots) <= 1 for s in st.splits)  # a slot in every layer does not fit
    assert st.cache_slots == 1 and 0 < sum(st.layer_slots) < mf.LAYERS
    assert st.chosen.layer_slots == st.layer_slots and st.chosen.ms_per_token < st.static.ms_per_token
    slot_bytes = 3 * mf.HIDDEN * 32 * 2
    assert dict(made.memory.vram)["cache_slots"] == sum(st.layer_slots) * slot_bytes
    assert made.memory.vram_total <= budget
    held = sum(st.layer_slots)
    assert f"chosen: 1 slot a layer in {held} of the {mf.LAYERS} MoE layers at bf16" in render_plan_text(made)
    assert made.to_json()["streaming"]["layer_slots"] == list(st.layer_slots)
    out = str(tmp_path / "m.ktb")
    compile_bundle(source, out, cpu_scheme="bf16",
                   plan_kwargs={"vram": budget, "reserve": 0, "trace": str(tmp_path / "routes.npy"), **SLOW_CPU})
    with open_bundle(out) as bundle:
        recorded = bundle.manifest["plan"]["streaming"]["layer_slots"]
    assert recorded == list(st.layer_slots)
    with from_bundle(out, device="cpu", prefill_offload=False) as km:
        assert [0 if e.cache is None else e.cache.policy.slots for e in km.experts] == recorded


def test_traces_that_do_not_fit_the_model_are_refused(source, tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((10, mf.LAYERS + 1, mf.TOP_K), dtype=np.int64))
    with pytest.raises(ConfigError, match="MoE layers"):
        load_trace(str(tmp_path / "bad.npy"), mf.LAYERS, mf.EXPERTS)
    np.save(tmp_path / "float.npy", np.zeros((10, mf.LAYERS, mf.TOP_K)))
    with pytest.raises(FormatError, match="not a routing trace"):
        load_trace(str(tmp_path / "float.npy"), mf.LAYERS, mf.EXPERTS)


def test_the_prefill_threshold_comes_from_the_measured_cpu_rate(source, tmp_path):
    budget = _budget(source, 4)
    unmeasured = plan(source, vram=budget, reserve=0)
    assert unmeasured.streaming.prefill_min_tokens == DEFAULT_PREFILL_MIN_TOKENS
    assert unmeasured.streaming.prefill_static_tokens_per_s is None
    ops = 2e9
    profile = {**HardwareProfile(vram_bytes=budget, ram_bytes=2**34, reserve_bytes=0,
                                 cpu_prefill_ops=ops).to_json()}
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    made = plan(source, hardware=str(tmp_path / "hw.json"))
    st, hw = made.streaming, made.hardware
    assert hw.cpu_prefill_ops == ops
    per_token = 6 * mf.HIDDEN * 32 / ops
    nbytes = expert_footprint(ExpertShape(mf.HIDDEN, 32, False), st.slot_scheme).data_bytes
    per_expert = max(math.ceil(nbytes * (1 / hw.pcie_bandwidth - 1 / hw.cpu_bandwidth) / per_token), 1)
    assert st.prefill_min_tokens == math.ceil(per_expert * mf.EXPERTS / mf.TOP_K)
    assert st.prefill_static_tokens_per_s > 0 and st.prefill_offload_tokens_per_s >= st.prefill_static_tokens_per_s


def test_the_bundle_records_the_streaming_plan_and_the_runtime_follows_it(source, tmp_path):
    from ktc.runtime.hf import from_bundle

    np.save(tmp_path / "routes.npy", _drifting(400, 50))
    out = str(tmp_path / "m.ktb")
    # a measured CPU prefill rate: the plan's own offload threshold, not llama.cpp's
    profile = HardwareProfile(vram_bytes=_budget(source, 10), ram_bytes=2**34, reserve_bytes=0, cpu_prefill_ops=2e9)
    (tmp_path / "hw.json").write_text(json.dumps(profile.to_json()))
    compile_bundle(source, out, cpu_scheme="bf16",
                   plan_kwargs={"hardware": str(tmp_path / "hw.json"), "trace": str(tmp_path / "routes.npy"),
                                **SLOW_CPU})
    with open_bundle(out) as bundle:
        recorded = bundle.manifest["plan"]["streaming"]
    slots = recorded["cache_slots"]
    assert slots > 0 and recorded["prefill_min_tokens"] != DEFAULT_PREFILL_MIN_TOKENS
    with from_bundle(out, device="cpu") as km:  # a device: the plan's slots, within its budget
        assert {e.cache.policy.slots for e in km.experts} == {slots}
        assert km.offload is not None and km.offload.min_tokens == recorded["prefill_min_tokens"]
    with from_bundle(out, device="cpu", cache_slots=0, prefill_offload=False) as km:
        assert all(e.cache is None for e in km.experts) and km.offload is None
    with from_bundle(out) as km:  # no device: nothing to stream into
        assert all(e.cache is None for e in km.experts) and km.offload is None


def _measured_hardware(tmp_path, budget: int) -> str:
    """A profile with the CPU's prefill rate measured (slow beside its link, no sync)."""
    profile = HardwareProfile(vram_bytes=budget, ram_bytes=2**34, reserve_bytes=0, cpu_prefill_ops=2e8,
                              sync_seconds=0, cpu_bandwidth=2e9, pcie_bandwidth=1e9)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile.to_json()))
    return str(path)


def test_a_prompt_heavy_request_trades_residents_for_an_offload_buffer(source, tmp_path):
    from ktc.plan_report import render_plan_text

    budget = _budget(source, 10)
    hardware = _measured_hardware(tmp_path, budget)
    without = plan(source, hardware=hardware, cpu_schemes=("bf16",))
    assert without.options.offload_vram == 0 and not without.streaming.offload_splits
    assert "no request given" in without.streaming.offload_evidence
    heavy = plan(source, hardware=hardware, cpu_schemes=("bf16",), request=(4000, 10))
    st = heavy.streaming
    splits = st.offload_splits
    # no buffer first: the plan without a request's placement
    assert splits[0].vram == 0 and splits[0].gpu_experts == sum(without.placement.gpu_experts_per_layer())
    assert heavy.workload.prompt_tokens == 4000 and heavy.workload.new_tokens == 10
    # each split's request: the prompt at its prefill rate, the new tokens at its decode steps
    for s in splits:
        assert s.request_seconds == pytest.approx(4000 / s.prefill_tokens_per_s + 10 * s.decode_ms_per_step / 1e3)
    assert {s.vram for s in splits[1:]} <= {int(n * mf.EXPERTS * 3 * mf.HIDDEN * 32 * 2) for n in (0.25, 0.5, 1, 2)}
    # a prompt of 4,000 tokens and 10 new: a buffer wins, residents given up for it
    chosen = next(s for s in splits if s.vram == st.offload_vram)
    assert st.offload_vram > 0 and heavy.options.offload_vram == st.offload_vram
    assert chosen.request_seconds == min(s.request_seconds for s in splits) < 0.99 * splits[0].request_seconds
    assert chosen.gpu_experts == sum(heavy.placement.gpu_experts_per_layer()) < splits[0].gpu_experts
    assert chosen.prefill_tokens_per_s > splits[0].prefill_tokens_per_s
    assert chosen.decode_ms_per_step > splits[0].decode_ms_per_step == pytest.approx(without.predicted_ms_per_step)
    # held in VRAM beside the rest, within the budget
    assert dict(heavy.memory.vram)["prefill_offload"] == st.offload_vram and heavy.memory.vram_total <= budget
    text = render_plan_text(heavy)
    assert "held for them" in text and f"residents fewer; prefill {chosen.prefill_tokens_per_s:.0f}" in text
    assert heavy.to_json()["streaming"]["prefill_offload_vram_bytes"] == st.offload_vram
    # a short prompt and a long answer: every resident kept
    light = plan(source, hardware=hardware, cpu_schemes=("bf16",), request=(10, 3000))
    assert light.options.offload_vram == 0 and len(light.streaming.offload_splits) > 1
    assert "no buffer makes it faster" in light.streaming.offload_evidence
    assert light.placement == without.placement
    # without the CPU's prefill rate there is nothing to weigh
    unmeasured = plan(source, vram=budget, reserve=0, cpu_schemes=("bf16",), request=(4000, 10))
    assert unmeasured.options.offload_vram == 0 and "not measured" in unmeasured.streaming.offload_evidence


def test_the_runtime_gives_the_offload_the_buffer_the_plan_held(source, tmp_path):
    from ktc.runtime.hf import from_bundle

    out = str(tmp_path / "m.ktb")
    budget = _budget(source, 10)
    compile_bundle(source, out, cpu_scheme="bf16",
                   plan_kwargs={"hardware": _measured_hardware(tmp_path, budget), "request": (4000, 10)})
    with open_bundle(out) as bundle:
        recorded = bundle.manifest["plan"]
    held = recorded["streaming"]["prefill_offload_vram_bytes"]
    assert held > 0 and recorded["memory"]["vram"]["prefill_offload"] == held
    assert recorded["workload"]["prompt_tokens"] == 4000
    left = budget - sum(recorded["memory"]["vram"].values())
    with from_bundle(out, device="cpu") as km:
        assert km.offload is not None and km.offload.budget_bytes == held + left
        assert "prefill_offload" not in km.plan_device_bytes and km.plan_device_bytes["non_expert"] == sum(
            v for k, v in recorded["memory"]["vram"].items()
            if k not in ("gpu_experts", "kv_cache", "workspace", "reserve", "prefill_offload"))
