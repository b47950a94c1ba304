"""The fused device kernels (``runtime/triton_experts.py``): on torch's CPU device through
Triton's interpreter, against numpy's reference and the torch path; on CUDA (``gpu``) compiled."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.formats.bundle import open_bundle
from ktc.formats.quantize import dequantize, quantize
from ktc.runtime import device as dev
from ktc.runtime import triton_experts
from ktc.runtime.moe import MoELayer

pytest.importorskip("triton")

SCHEMES = list(triton_experts.KINDS)


def _fresh_kernels() -> None:
    # the kernels module is Triton's interpreted or compiled kind as the environment said when
    # it was imported: import it again
    sys.modules.pop("ktc.runtime.triton_kernels", None)
    triton_experts._KERNELS, triton_experts._TRIED = None, False
    triton_experts._failed.clear()


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels run by Triton's interpreter on torch's CPU device (chosen for the run by
    conftest.py where there is no CUDA), a device where they run only when asked."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a CUDA machine: the gpu tests run the kernels)")
    monkeypatch.setenv("KTC_DEVICE_KERNELS", "triton")
    _fresh_kernels()
    yield
    _fresh_kernels()


def _silu_experts(gate_up, down, gate_up_bias, down_bias, x, clamped):
    # one expert's output from float matrices: SiLU(gate) * up, or gpt-oss's clamped SwiGLU
    inter = gate_up.shape[0] // 2
    h = gate_up @ x + gate_up_bias
    g, u = h[:inter], h[inter:]
    if clamped:
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0) + 1
        a = g / (1 + np.exp(-1.702 * g)) * u
    else:
        a = g / (1 + np.exp(-g)) * u
    return down @ a + down_bias


# values a row's length must be a whole number of
WHOLE = {"q8_0": 32, "q4_0": 32, "mxfp4": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256, "int4_g32": 32, "int4_g64": 64,
         "int4_g128": 128}


def _check_token(gate_up_scheme, down_scheme, hidden, inter, clamped, biases):
    """A token through 3 of 5 experts of a stack, weighted and added to what ``out`` holds,
    against the numpy reference on the stored weights' values."""
    rng = np.random.default_rng(hidden + inter)
    experts = 5
    gate_up = [rng.standard_normal((2 * inter, hidden)).astype(np.float32) * 0.3 for _ in range(experts)]
    down = [rng.standard_normal((hidden, inter)).astype(np.float32) * 0.3 for _ in range(experts)]
    gu_bias = [rng.standard_normal(2 * inter).astype(np.float32) if biases else np.zeros(2 * inter, np.float32)
               for _ in range(experts)]
    dn_bias = [rng.standard_normal(hidden).astype(np.float32) if biases else np.zeros(hidden, np.float32)
               for _ in range(experts)]
    raw_gu = [quantize(w, gate_up_scheme).view(np.uint8).reshape(w.shape[0], -1) for w in gate_up]
    raw_dn = [quantize(w, down_scheme).view(np.uint8).reshape(w.shape[0], -1) for w in down]
    scheme = gate_up_scheme if gate_up_scheme == down_scheme else f"{gate_up_scheme}+{down_scheme}"
    stack = dev.upload(scheme, raw_gu, raw_dn, gu_bias if biases else [], dn_bias if biases else [], "cpu")
    chosen, weights = [3, 0, 4], np.array([0.5, 0.3, 0.2], dtype=np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    before = rng.standard_normal(hidden).astype(np.float32)
    out = torch.from_numpy(before.copy())
    assert triton_experts.token(stack, gate_up_scheme, down_scheme, torch.tensor(chosen, dtype=torch.float32),
                                torch.from_numpy(weights), torch.from_numpy(x), out, hidden, inter, clamped, 7.0,
                                1.702)
    want = before.copy()
    for w, e in zip(weights, chosen):
        want += w * _silu_experts(dequantize(raw_gu[e], gate_up_scheme, hidden),
                                  dequantize(raw_dn[e], down_scheme, inter), gu_bias[e], dn_bias[e], x, clamped)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# (hidden, inter, clamped SwiGLU and biases): 608 columns, a row longer than one step of the
# kernels' loop (512 values) and not a whole number of steps; the K-quants and int4 take 256
# values a step: 512 columns (two super-blocks), 288 (not a whole number of steps)
_SHAPES = {"narrow": [(64, 96, False), (96, 32, True), (608, 64, False)], "kquant": [(512, 256, True)],
           "int4": [(256, 128, True), (288, 32, False)]}
_CASES = [(scheme, *shape) for scheme in SCHEMES
          for shape in _SHAPES["kquant" if scheme.endswith("_k") else "int4" if scheme.startswith("int4") else "narrow"]
          if not (shape[0] % WHOLE.get(scheme, 1) or shape[1] % WHOLE.get(scheme, 1))]


@pytest.mark.parametrize("scheme, hidden, inter, clamped", _CASES)
def test_kernels_equal_the_reference(scheme, hidden, inter, clamped, interpreted):
    """Every scheme the kernels read (gpt-oss's rows, 2880 values, are not whole steps either)."""
    _check_token(scheme, scheme, hidden, inter, clamped, clamped)


@pytest.mark.parametrize("gate_up_scheme, down_scheme", [("q4_k", "q6_k"), ("q4_0", "q8_0"), ("bf16", "int4_g64")])
def test_gate_up_and_down_in_two_schemes(gate_up_scheme, down_scheme, interpreted):
    """As llama.cpp's Q4_K_M keeps some layers' experts: q4_k gate/up, q6_k down."""
    _check_token(gate_up_scheme, down_scheme, 512, 256, False, False)


@pytest.mark.parametrize("family, scheme", [("qwen3_moe", "q4_0"), ("gpt_oss", "mxfp4"), ("qwen3_moe", "int8"),
                                            ("gpt_oss", "int4_g32")])
def test_a_decode_step_takes_the_kernels_to_the_torch_path_s_sums(family, scheme, tiny_models, tmp_path, monkeypatch,
                                                                   interpreted):
    """A layer with its experts on the device: the kernels are built at load; one token's
    experts go through them (one call a token), with the torch path's result; several tokens
    keep the torch path."""
    path = mf.compile_with_placement(tiny_models[family]["safetensors"], tmp_path, lambda e: f"gpu:{scheme}")
    hidden = np.random.default_rng(7).standard_normal((3, mf.HIDDEN)).astype(np.float32)
    calls = []
    original = triton_experts.token
    monkeypatch.setattr(triton_experts, "token", lambda *a, **k: calls.append(1) or original(*a, **k))
    from ktc.runtime import experts as experts_module

    # the torch path decodes at most this many values at once: one expert a chunk here; the
    # fused kernels decode nothing in memory and take a stack's experts in one call
    monkeypatch.setattr(experts_module, "DECODED_ELEMENTS", 1)
    with open_bundle(path) as bundle:
        layer = MoELayer(bundle, 1, device="cpu")
        assert len(calls) == 1  # built at load, on the stack's first expert (``warm``)
        fused = [layer.forward(hidden[i: i + 1])[0] for i in range(len(hidden))]
        assert len(calls) == 1 + len(hidden)
        together = layer.forward(hidden)  # several tokens: the torch path
        assert len(calls) == 1 + len(hidden)
        monkeypatch.setenv("KTC_DEVICE_KERNELS", "torch")
        alone = [layer.forward(hidden[i: i + 1])[0] for i in range(len(hidden))]
        assert len(calls) == 1 + len(hidden)
        # what ktc run reports: a call a token through the kernels, a call an expert on the torch path
        assert layer.experts.token_kernels == {"fused": len(hidden), "torch": len(hidden) * layer.top_k}
        layer.close()
    for i in range(len(hidden)):
        scale = np.abs(alone[i]).max()
        np.testing.assert_allclose(fused[i], alone[i], rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(fused[i], together[i], rtol=1e-5, atol=1e-5 * scale)


def test_the_cache_slots_kernels_are_built_at_load_too(tiny_models, tmp_path, monkeypatch, interpreted):
    """Each device stack's kernels are built when the layer loads: the plan's residents' and the
    cache's slots' (another scheme here), so that no decode step waits for Triton."""
    from ktc.runtime.experts import ExpertSet

    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path,
                                     lambda e: "gpu:q8_0" if e < 2 else "cpu:q4_0")
    built = []
    monkeypatch.setattr(triton_experts, "warm", lambda stack, *a: built.append(stack.scheme))
    with open_bundle(path) as bundle:
        experts = ExpertSet(bundle, 1, device="cpu", cache_slots=2)
        assert sorted(built) == ["q4_0", "q8_0"]
        experts.close()


def test_a_scheme_the_kernels_do_not_read_keeps_the_torch_path():
    assert triton_experts.supported("q4_0", "q4_0")
    assert triton_experts.supported("q4_0", "q8_0")
    assert triton_experts.supported("q4_k", "q6_k")
    assert not triton_experts.supported("iq4_xs", "iq4_xs")
    assert not triton_experts.supported("q4_0", "fp8_e4m3")


def test_kernels_that_do_not_build_warn_once_and_give_way(monkeypatch, interpreted):
    """A Triton that cannot build the kernels (an old one, a new GPU): one warning, the
    scheme pair marked, and the caller told to take the torch path."""
    rng = np.random.default_rng(0)
    raw = [quantize(rng.standard_normal((64, 32)).astype(np.float32), "q4_0").view(np.uint8).reshape(64, -1)]
    raw_down = [quantize(rng.standard_normal((32, 32)).astype(np.float32), "q4_0").view(np.uint8).reshape(32, -1)]
    stack = dev.upload("q4_0", raw, raw_down, [], [], "cpu")

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no such target")

    triton_experts._kernels()
    monkeypatch.setitem(triton_experts._KERNELS, "gate_up", Broken())
    out = torch.zeros(32)
    with pytest.warns(RuntimeWarning, match="did not build"):
        assert not triton_experts.token(stack, "q4_0", "q4_0", torch.zeros(1), torch.ones(1), torch.ones(32), out,
                                        32, 32, False, 7.0, 1.702)
    assert not triton_experts.supported("q4_0", "q4_0")
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if mf.HIDDEN % WHOLE.get(s, 1) == 0])
def test_compiled_kernels_on_cuda_equal_the_torch_path(scheme, tiny_models, tmp_path, monkeypatch):
    """On CUDA the kernels compile and give the torch path's sums (bf16 products there: 2%); the
    tiny models' rows (32 values) are too short for the K-quants, which the interpreted tests
    cover."""
    _fresh_kernels()
    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path, lambda e: f"gpu:{scheme}")
    hidden = np.random.default_rng(8).standard_normal((4, mf.HIDDEN)).astype(np.float32)
    with open_bundle(path) as bundle:
        layer = MoELayer(bundle, 1, device="cuda")
        fused = np.stack([layer.forward(hidden[i: i + 1])[0] for i in range(len(hidden))])
        assert triton_experts.supported(scheme, scheme), "the kernels did not build"
        assert layer.experts.token_kernels == {"fused": len(hidden), "torch": 0}
        monkeypatch.setenv("KTC_DEVICE_KERNELS", "torch")
        torch_path = np.stack([layer.forward(hidden[i: i + 1])[0] for i in range(len(hidden))])
        layer.close()
    assert np.linalg.norm(fused - torch_path) / np.linalg.norm(torch_path) < 2e-2
