"""The CPU decode cost model: each part of a step from the bundle's tensors and the profile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ktc.errors import ConfigError, FormatError
from ktc.formats.hardware_profile import HardwareProfile
from ktc.passes.decode_cost import cpu_decode_cost, rate

GB = 1e9


def tensor(name, role, nbytes, scheme="q8_0", layer=None, expert=None, shape=(64, 64), segment="device"):
    return SimpleNamespace(name=name, role=role, nbytes=nbytes, scheme=scheme, layer=layer, expert=expert,
                           shape=shape, segment=segment)


def model_tensors(*, head=True, expert_segment="host"):
    ts = [tensor("token_embd.weight", "embeddings", 1000 * 64, shape=(1000, 64), segment="host"),
          tensor("blk.0.attn_q.weight", "attention", 4000, layer=0),
          tensor("blk.0.attn_k.weight", "attention", 1000, layer=0, shape=(16, 64)),
          tensor("blk.0.attn_norm.weight", "norm", 256, "f32", layer=0),
          tensor("layers.0.router", "router", 512, "f32", layer=0)]
    if head:
        ts.append(tensor("output.weight", "embeddings", 64_000, "q4_0"))
    for e, nbytes in enumerate((300, 500)):  # two experts, top-1: half the time each
        ts += [tensor(f"layers.0.experts.{e}.gate_up", "expert", 2 * nbytes, "q4_0", 0, e, segment=expert_segment),
               tensor(f"layers.0.experts.{e}.down", "expert", nbytes, "q8_0", 0, e, segment=expert_segment)]
    return ts


MODEL = {"moe_layers": [{"layer": 0, "top_k": 1}], "config": {"tie_word_embeddings": False}}
RATES = {"matrix": {"q8_0": 10 * GB, "q4_0": 20 * GB, "f32": 40 * GB}, "experts": {"q4_0": 5 * GB}}


def test_each_part_is_bytes_over_its_schemes_rate_plus_fixed_costs():
    hw = HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_bandwidth=1 * GB, cpu_scheme_bandwidth=RATES,
                         cpu_layer_seconds=1e-6, cpu_token_seconds=3e-6)
    cost = cpu_decode_cost(model_tensors(), MODEL, hw, context=10)
    # one embedding row (64 B of q8_0), q and k (q8_0), the norm and router (f32)
    assert cost.matrices == pytest.approx((64 + 4000 + 1000) / (10 * GB) + (256 + 512) / (40 * GB))
    assert cost.head == pytest.approx(64_000 / (20 * GB))
    # mean of the two experts: gate_up in q4_0 at the experts' rate, down in q8_0 (no experts
    # rate: the matrix rate)
    assert cost.experts == pytest.approx(((600 + 1000) / 2) / (5 * GB) + ((300 + 500) / 2) / (10 * GB))
    assert cost.kv == pytest.approx(10 * 16 * 4 / (40 * GB))  # k's 16 rows a token, f32 cache
    assert cost.fixed == pytest.approx(1e-6 + 3e-6) and cost.layers == 1
    assert cost.seconds == pytest.approx(cost.matrices + cost.head + cost.experts + cost.kv + cost.fixed)
    assert cost.bytes_read == 64 + 4000 + 1000 + 256 + 512 + 64_000 + 1200 + 10 * 16 * 4
    assert cost.calibrated and cost.to_json()["ms_per_token"] == pytest.approx(1e3 * cost.seconds)


def test_without_calibration_every_scheme_reads_at_the_bandwidth():
    hw = HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_bandwidth=2 * GB)
    cost = cpu_decode_cost(model_tensors(), MODEL, hw)
    assert cost.seconds == pytest.approx(cost.bytes_read / (2 * GB)) and not cost.calibrated
    assert rate(hw, "q4_0", "experts") == 2 * GB


def test_a_tied_embedding_is_the_head_and_gpu_experts_have_no_cpu_prediction():
    hw = HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_bandwidth=1 * GB)
    tied = cpu_decode_cost(model_tensors(head=False), {**MODEL, "config": {"tie_word_embeddings": True}}, hw)
    assert tied.head == pytest.approx(64_000 / GB)  # the whole table, read as lm_head
    assert cpu_decode_cost(model_tensors(expert_segment="device"), MODEL, hw) is None


def test_a_calls_fixed_part_in_proportion_below_the_calibrated_call():
    rates = {**RATES, "experts_call_seconds": {"q4_0": 1e-4}, "experts_call_bytes": {"q4_0": 1600.0},
             "matrix_call_seconds": {"q8_0": 1e-5, "q4_0": 2e-5}, "matrix_call_bytes": {"q8_0": 2000.0}}
    hw = HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=rates)
    base = cpu_decode_cost(model_tensors(), MODEL, HardwareProfile(vram_bytes=0, ram_bytes=1,
                                                                   cpu_scheme_bandwidth=RATES))
    cost = cpu_decode_cost(model_tensors(), MODEL, hw)
    assert cost.experts - base.experts == pytest.approx(1e-4 * 1200 / 1600)  # the call reads 1200 B
    # q (4000 B) and k (1000 B) in q8_0: a whole and a half call; the f32 router none (no figure);
    # lm_head in q4_0 (no call size: the whole fixed part); the norm and the embedding row: no call
    assert cost.matrices - base.matrices == pytest.approx(1e-5 * (1 + 0.5))
    assert cost.head - base.head == pytest.approx(2e-5)
    rows = {**RATES, "matrix_row_seconds": {"q8_0": 1e-9}}  # a profile calibrated before the rates a row length
    with_rows = cpu_decode_cost(model_tensors(), MODEL, HardwareProfile(vram_bytes=0, ram_bytes=1,
                                                                        cpu_scheme_bandwidth=rows))
    assert with_rows.matrices - base.matrices == pytest.approx(1e-9 * (64 + 16))  # q's and k's rows
    lengths = {**rows, "matrix@64": {"q8_0": 10 * GB}}  # which hold the rows' cost: no cost a row then
    assert cpu_decode_cost(model_tensors(), MODEL, HardwareProfile(
        vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=lengths)).matrices == pytest.approx(base.matrices)


def test_a_matrix_reads_at_the_rate_of_its_row_length():
    table = {**RATES, "matrix@1024": {"q8_0": 1 * GB}, "matrix@4096": {"q8_0": 3 * GB}, "matrix@2048": {"q4_0": 5 * GB}}
    hw = HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=table)
    assert rate(hw, "q8_0", cols=1024) == 1 * GB and rate(hw, "q8_0", cols=4096) == 3 * GB
    assert rate(hw, "q8_0", cols=2048) == pytest.approx(2 * GB)  # halfway in the length's logarithm
    assert rate(hw, "q8_0", cols=256) == 1 * GB and rate(hw, "q8_0", cols=16384) == 3 * GB  # the nearest past the ends
    assert rate(hw, "q4_0", cols=64) == 5 * GB  # one length measured: that rate
    assert rate(hw, "q8_0") == RATES["matrix"]["q8_0"] and rate(hw, "q8_0", "experts", cols=1024) == rate(hw, "q8_0", "experts")
    assert rate(hw, "bf16", cols=1024) == hw.cpu_bandwidth  # no figure of the scheme
    # every matrix of the model at its own length: q (4000 B) and k (1000 B) have rows of 64 values
    at64 = {**RATES, "matrix@64": {"q8_0": 0.5 * GB}}
    slower = cpu_decode_cost(model_tensors(), MODEL, HardwareProfile(vram_bytes=0, ram_bytes=1,
                                                                     cpu_scheme_bandwidth=at64))
    base = cpu_decode_cost(model_tensors(), MODEL, HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=RATES))
    assert slower.matrices - base.matrices == pytest.approx(5000 / (0.5 * GB) - 5000 / RATES["matrix"]["q8_0"])


def test_the_profile_keeps_the_calibration_and_refuses_a_bad_one(tmp_path):
    hw = HardwareProfile(vram_bytes=5, ram_bytes=7, cpu_scheme_bandwidth=RATES, cpu_layer_seconds=2e-5,
                         cpu_token_seconds=1e-5)
    again = HardwareProfile.from_json(hw.to_json())
    assert again.cpu_scheme_bandwidth == RATES and again.cpu_layer_seconds == 2e-5
    assert again.cpu_token_seconds == 1e-5
    assert "cpu_scheme_bandwidth" not in HardwareProfile(vram_bytes=5, ram_bytes=7).to_json()  # not calibrated
    with pytest.raises(FormatError, match="cpu_scheme_bandwidth.matrix.q8_0"):
        HardwareProfile.from_json({**hw.to_json(), "cpu_scheme_bandwidth": {"matrix": {"q8_0": -1}}})
    with pytest.raises(ConfigError, match="'gpu'"):
        HardwareProfile(vram_bytes=5, ram_bytes=7, cpu_scheme_bandwidth={"gpu": {}})
    with_lengths = {**RATES, "matrix@2048": {"q8_0": 3e9}}
    assert HardwareProfile.from_json({**hw.to_json(), "cpu_scheme_bandwidth": with_lengths}).cpu_scheme_bandwidth \
        == with_lengths
    for bad in ("matrix@", "matrix@0", "matrix@x", "experts@2048"):
        with pytest.raises(ConfigError, match=bad):
            HardwareProfile(vram_bytes=5, ram_bytes=7, cpu_scheme_bandwidth={bad: {}})
