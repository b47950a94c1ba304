"""Quantization schemes: ggml byte compatibility, round trips, pass-through of quantized sources."""

from __future__ import annotations

import numpy as np
import pytest

from ktc.formats.quantize import dequantize, quantize
from ktc.formats.schemes import SCHEMES, get_scheme


def sample(seed: int, rows: int = 24, cols: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    x[2, :32] = np.float32(0.5)  # ties in the maximum
    x[3, ::7] = -x[3, ::7]
    x[4, :32] = np.arange(32, dtype=np.float32) - 16  # exact halves after scaling
    x[5:7, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
    x[5, 3], x[5, 9] = -2.5, 2.5  # equal magnitudes of both signs: the first decides q4_0's d
    x[6, 3], x[6, 9] = 2.5, -2.5
    x[7, :32] = -0.0
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4", "bf16", "f16", "f32"])
@pytest.mark.parametrize("seed", range(4))
def test_bit_identical_to_gguf(name, seed):
    import gguf

    x = sample(seed)
    qtype = gguf.GGMLQuantizationType[name.upper()] if name not in ("f32", "f16") else \
        {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16}[name]
    ours = quantize(x, name)
    theirs = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(x.shape[0], -1)
    assert ours.shape == theirs.shape
    assert ours.shape[1] == get_scheme(name).matrix_bytes(1, x.shape[1])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(dequantize(ours, name, x.shape[1]),
                                  gguf.quants.dequantize(theirs, qtype).reshape(x.shape).astype(np.float32))


@pytest.mark.parametrize("name, tolerance", [("int8", 0.01), ("int4_g32", 0.075), ("int4_g64", 0.088),
                                             ("int4_g128", 0.097), ("q8_0", 0.01), ("q4_0", 0.12),
                                             ("bf16", 0.005), ("mxfp4", 0.15)])
def test_round_trip_error(name, tolerance):
    x = np.random.default_rng(7).standard_normal((64, 512)).astype(np.float32)
    raw = quantize(x, name)
    assert raw.shape == (64, get_scheme(name).matrix_bytes(1, 512))
    back = dequantize(raw, name, 512)
    rel_rmse = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
    assert rel_rmse < tolerance, rel_rmse


def test_int_schemes_reference():
    """int8 and int4 against a plain numpy statement of their definitions."""
    x = sample(3, rows=8, cols=128)
    raw = quantize(x, "int8")
    scale = np.abs(x).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[:, None] > 0, x * (np.float32(1) / scale[:, None]), 0)
    q = np.sign(q) * np.floor(np.abs(q) + 0.5)
    np.testing.assert_array_equal(raw[:, :128].view(np.int8), q.astype(np.int8))
    np.testing.assert_array_equal(raw[:, 128:].copy().view(np.float32).ravel(), scale)

    raw4 = quantize(x, "int4_g64")
    from ktc.formats.quantize import INT4_STEPS

    groups = x.reshape(16, 64)  # 8 rows of 2 groups
    lo, hi = groups.min(axis=1), groups.max(axis=1)

    def codes_for(v, m, inv):
        return np.clip(np.floor((v - m) * inv + np.float32(0.5)), 0, 15)

    def seq_sum(terms):  # left to right, as the kernel adds
        total = np.zeros(terms.shape[0])
        for j in range(terms.shape[1]):
            total += terms[:, j]
        return total

    sx = seq_sum(groups.astype(np.float64))
    best = np.full(16, np.inf)
    d_best, m_best = np.zeros(16), lo.astype(np.float64)
    for steps in INT4_STEPS:
        q = codes_for(groups, lo[:, None], (steps / (hi - lo))[:, None]).astype(np.float64)
        sq, sqq, sqx = seq_sum(q), seq_sum(q * q), seq_sum(q * groups)
        d = (64 * sqx - sq * sx) / (64 * sqq - sq * sq)
        m = (sx - d * sq) / 64
        err = seq_sum((groups.astype(np.float64) - q * d[:, None] - m[:, None]) ** 2)
        better = err < best
        best, d_best, m_best = np.where(better, err, best), np.where(better, d, d_best), np.where(better, m, m_best)

    def bf16(v):
        bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

    d_bits, m_bits = bf16(d_best), bf16(m_best)
    d = (d_bits.astype(np.uint32) << 16).view(np.float32)
    m = (m_bits.astype(np.uint32) << 16).view(np.float32)
    codes = codes_for(groups, m[:, None], (np.float32(1) / d)[:, None]).astype(np.uint8)
    packed = codes[:, :32] | (codes[:, 32:] << 4)  # per group, byte k: values k and k + 32
    np.testing.assert_array_equal(raw4[:, :64], packed.reshape(8, 64))
    params = raw4[:, 64:].copy().view(np.uint16)
    np.testing.assert_array_equal(params[:, :2].ravel(), d_bits)
    np.testing.assert_array_equal(params[:, 2:].ravel(), m_bits)
    # and the value is code * scale + minimum
    np.testing.assert_allclose(dequantize(raw4, "int4_g64", 128).reshape(16, 64),
                               codes * d[:, None] + m[:, None], rtol=1e-6)


def test_scheme_that_does_not_fit_a_row():
    from ktc.errors import FormatError

    with pytest.raises(FormatError, match="multiple of 32"):
        quantize(np.zeros((2, 40), np.float32), "q8_0")


def test_float16_conversion_matches_numpy():
    from ktc.formats.quantize import f32_to_f16_bits

    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 20000),
        np.array([0.0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, np.inf, -np.inf, 6e-8, 5.96e-8, 2.98e-8,
                  3e-8, 6.1e-5, 6.09e-5, 1.0 + 2**-11, 1.0 + 3 * 2**-11], dtype=np.float32),
        (np.arange(1, 5000, dtype=np.uint32) << 13 | 0x1000).view(np.float32),  # exact ties
    ])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(f32_to_f16_bits(values), expected)


# llama.cpp's own quantizer on the same weights: relative RMS error of
# np.random.default_rng(0).standard_normal((64, 4096)) through ggml_quantize_chunk (what
# llama-quantize calls, without an importance matrix), from libggml-base of llama.cpp as built by
# ../shared/tools/build-llamacpp.sh (llama-cpp-python 0.3.36), decoded by the gguf package. ktc's
# bytes were identical to ggml's on these weights when measured.
LLAMACPP_RMS = {"q4_k": 0.07147, "q5_k": 0.03618, "q6_k": 0.01776}
# The same for one expert matrix at Mixtral-8x7B's shape, (default_rng(1) normal [14336, 4096]) * 0.02
# (transformers' initializer range): the same bytes as ggml's (benchmarks/kquant_bytes.py).
LLAMACPP_RMS_MIXTRAL_W1 = {"q4_k": 0.07135, "q5_k": 0.03612, "q6_k": 0.01775}


def _rel_rms(x: np.ndarray, name: str) -> float:
    back = dequantize(quantize(x, name), name, x.shape[1])
    return float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2)))


@pytest.mark.parametrize("name", list(LLAMACPP_RMS))
def test_kquant_quantizers_match_llamacpp_error(name):
    x = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
    assert _rel_rms(x, name) <= 1.05 * LLAMACPP_RMS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LLAMACPP_RMS_MIXTRAL_W1))
def test_kquant_quantizers_at_mixtral_shape(name):
    x = (np.random.default_rng(1).standard_normal((14336, 4096)) * 0.02).astype(np.float32)
    assert _rel_rms(x, name) <= 1.05 * LLAMACPP_RMS_MIXTRAL_W1[name]


def test_kquant_quantizer_edge_blocks():
    """All-zero, constant, one-outlier and all-negative super-blocks decode finite and close."""
    x = np.zeros((4, 512), np.float32)
    x[1] = 0.5
    x[2, 7] = 100.0
    x[3] = -np.abs(np.random.default_rng(2).standard_normal(512)).astype(np.float32)
    for name in LLAMACPP_RMS:
        back = dequantize(quantize(x, name), name, 512)
        assert np.isfinite(back).all()
        np.testing.assert_array_equal(back[0], 0.0)
        assert np.abs(back[2, 7] - 100.0) < 1.0, (name, back[2, 7])
        assert np.abs(back[1] - 0.5).max() < 0.05 and np.abs(back[3] - x[3]).max() < 0.5
