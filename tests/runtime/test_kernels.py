"""CPU expert kernels against plain numpy references, over several shapes and seeds.

This file also runs with NUMBA_DISABLE_JIT=1 (see test_kernels_without_jit), which checks the
kernels' Python semantics rather than their compiled form.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ktc.formats.kernel_args import read_only
from ktc.formats.quantize import dequantize, quantize
from ktc.runtime import vnni
from ktc.runtime.kernels import expert_forward, expert_forward_batch, matvec
from ktc.runtime.rows import experts_rows

SCHEMES = ["f32", "bf16", "f16", "int8", "q8_0", "q4_0", "mxfp4", "int4_g32", "int4_g64", "int4_g128", "fp8_e4m3"]
SHAPES = [(8, 128), (40, 256), (3, 384)]


def stored(raw: np.ndarray, scheme: str, cols: int) -> np.ndarray:
    """The bundle's view of a tensor: plain types as their dtype, the rest as bytes."""
    if scheme == "f32":
        return raw.view(np.float32).reshape(raw.shape[0], cols)
    if scheme in ("bf16", "f16"):
        return raw.view(np.uint16).reshape(raw.shape[0], cols)
    return raw


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matvec_matches_numpy(scheme, shape, seed):
    rows, cols = shape
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    raw = quantize(w, scheme)
    reference = dequantize(raw, scheme, cols).astype(np.float64) @ x.astype(np.float64)
    got = matvec(stored(raw, scheme, cols), scheme, x)
    tolerance = one_token_tolerance(scheme)
    np.testing.assert_allclose(got, reference, rtol=tolerance, atol=tolerance * np.abs(reference).max())


def test_fp8_rows_take_denormal_activations_as_zeros():
    """fp8_e4m3's rows multiply the activations as floats, so denormal ones (the SiLU of gates
    below about -87) are made zeros first (each had cost a microcode assist: a Mixtral-shaped down
    matrix 21 ms instead of 1.8 with half of them denormal): one matrix and the multi-expert rows
    give exactly what the activations with those values zeroed give."""
    rng = np.random.default_rng(4)
    raw = quantize(rng.standard_normal((70, 384)).astype(np.float32), "fp8_e4m3")
    x = rng.standard_normal(384).astype(np.float32)
    x[::3] = np.float32(1e-40) * rng.choice([-1, 1], 128)
    zeroed = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)
    np.testing.assert_array_equal(vnni.without_denormals(x), zeroed)
    assert (vnni.without_denormals(x)[1::3] == x[1::3]).all()  # the rest as they are
    np.testing.assert_array_equal(matvec(raw, "fp8_e4m3", x), matvec(raw, "fp8_e4m3", zeroed))
    file = np.zeros(raw.nbytes + 8, np.uint8)
    file[4:4 + raw.nbytes] = raw.reshape(-1)
    both = [experts_rows(file, "fp8_e4m3", np.array([4], dtype=np.int64), 70, v[None, :]) for v in (x, zeroed)]
    np.testing.assert_array_equal(both[0], both[1])


def test_fp8_rows_read_every_code_exactly():
    """fp8_e4m3's one-token kernel (``vnni.fp8_rows``: each code made a float32 from its bits, not
    looked up) gives every finite code's value times its block's scale exactly, subnormals and
    negative zero included, read one column at a time, and so does its decoder; and a row's sum
    over several blocks as float64 does within float32's rounding."""
    from ktc.formats.codec_fp8 import pack
    from ktc.formats.dequant import FP8_E4M3_VALUES

    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # the NaN codes (ktc's import refuses or replaces them)
    scales = np.array([[0.75], [3.0e-3]], dtype=np.float32)
    raw = pack(codes, scales)
    want = FP8_E4M3_VALUES[codes].astype(np.float32) * scales
    for j in range(128):
        x = np.zeros(128, np.float32)
        x[j] = 1.0
        np.testing.assert_array_equal(matvec(raw, "fp8_e4m3", x), want[:, j])
    # its decoder (the bf16 GEMM's path): the codes' values from their bits too, float32 and bf16
    from ktc.formats.quantize import f32_to_bf16_bits
    from ktc.runtime.kernels import decode

    np.testing.assert_array_equal(decode(raw, "fp8_e4m3", 128), want)
    np.testing.assert_array_equal(decode(raw, "fp8_e4m3", 128, bf16=True), f32_to_bf16_bits(want))
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (5, 640), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = rng.uniform(1e-3, 2, (5, 5)).astype(np.float32)
    x = rng.standard_normal(640).astype(np.float32)
    want = (FP8_E4M3_VALUES[codes].reshape(5, 5, 128) * scales[:, :, None]).reshape(5, 640).astype(np.float64) @ x
    np.testing.assert_allclose(matvec(pack(codes, scales), "fp8_e4m3", x), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


VNNI_SCHEMES = ("int4_g32", "int4_g64", "int4_g128", "q4_0", "mxfp4", "q8_0", "int8")


def one_token_tolerance(scheme: str) -> float:
    """The kernels through VNNI (4-bit, int8 and q8_0) multiply
    int8-quantized activations (the tests below check that exactly); every other kernel is
    float32 throughout."""
    return 2e-2 if scheme in VNNI_SCHEMES and vnni.HAVE_VNNI else 1e-4


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(9, 256), (64, 1024), (3, 384), (5, 352), (4, 320), (2, 64), (5, 1216)])
def test_int4_vnni_matches_its_definition(group, shape):
    """The VNNI kernel computes sum_g scale_g dx_g (codes . xq)_g + min_g dx_g sum(xq_g) exactly,
    with xq, dx the activations quantized per group (vnni.quantize_activations); rows of fewer
    than sixteen groups, whole sixteens (g32, g64: their scales in vectors) and sixteens with
    groups past them (1216 values: 38 and 19 groups)."""
    rows, cols = shape
    if cols % group:
        pytest.skip("row not whole groups")
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    raw = quantize(w, f"int4_g{group}")
    groups = cols // group
    packed = raw[:, : cols // 2].reshape(rows, groups, group // 2)
    codes = np.concatenate([packed & 15, packed >> 4], axis=2).astype(np.float64)
    params = (raw[:, cols // 2:].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    scale, minimum = params[:, :groups].astype(np.float64), params[:, groups:].astype(np.float64)
    xq, dx, xsum = vnni.quantize_activations(x, group)
    dots = (codes * xq.reshape(groups, group).astype(np.float64)).sum(axis=2)
    want = (scale * dx * dots).sum(axis=1) + minimum @ xsum.astype(np.float64)
    got = vnni.matvec_int4(raw, x, group, np.empty(rows, np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(xq.astype(np.float64).reshape(groups, group) * dx[:, None] - x.reshape(groups, group)).max() \
        <= 0.5 * dx.max() * (1 + 1e-6)


@pytest.mark.parametrize("group,row", [(32, 0), (32, 256), (32, 352), (64, 0), (128, 0)])
def test_quantized_activations_match_their_definition(group, row):
    """Each group's int8 values are rint(x / d) with d its largest magnitude over 127 (1 for an
    all-zero group), its sum is d times theirs; with ``row``, each 128 values of a row sit in
    quad_layout (the four blocks' first 16 values, then their last 16), the rest in order."""
    rng = np.random.default_rng(group + row)
    x = (rng.standard_normal(2 * (row or 256)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[group:2 * group] = 0  # a group of zeros
    x[5] = -40.0  # a negative largest magnitude
    xq, dx, sums = vnni.quantize_activations(x, group, row)
    blocks = x.reshape(-1, group)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    d[d == 0] = 1
    codes = np.rint(blocks * (np.float32(1) / d)[:, None]).astype(np.int8)
    np.testing.assert_array_equal(dx, d)
    np.testing.assert_allclose(sums, codes.astype(np.float32).sum(axis=1) * d, rtol=1e-6)
    placed = np.empty_like(xq)
    for j in range(x.shape[0]):
        placed[vnni.quad_layout(j, row) if row else j] = codes.reshape(-1)[j]
    np.testing.assert_array_equal(xq, placed)
    if row:  # the layout moves values within each row's whole 128s only
        within = np.arange(row) // 128 < row // 128
        assert not np.array_equal(xq.reshape(-1, row)[:, within], codes.reshape(-1, row)[:, within])


@pytest.mark.parametrize("cols", [16, 48, 80, 2048, 40])
def test_bf16_rows_match_float64(cols):
    """bf16 rows (a router's) times float32 values: 16 lanes a step over four accumulators, the
    steps past the last whole four, and rows of a length not a multiple of 16 (the plain loop)."""
    from ktc.formats.float_bits import f32_to_bf16_bits
    from ktc.runtime.kernels import _matvec_bf16

    rng = np.random.default_rng(cols)
    w = f32_to_bf16_bits(rng.standard_normal((7, cols)).astype(np.float32))
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(7, np.float32)
    _matvec_bf16(w, x, out)
    want = (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("clamped", [False, True])
def test_activation_with_and_without_biases(clamped):
    """SiLU(gate) * up, or gpt-oss's clamped SwiGLU, with and without biases (SiLU without them
    has a loop of its own), against numpy."""
    rng = np.random.default_rng(int(clamped))
    k, inter = 3, 96
    h = (rng.standard_normal((k, 2 * inter)) * 6).astype(np.float32)
    for bias in (None, rng.standard_normal((k, 2 * inter)).astype(np.float32)):
        got = vnni.activate(h, inter, clamped, np.float32(7.0), np.float32(1.702),
                            np.zeros((1, 1), np.float32) if bias is None else bias, bias is not None)
        v = h.astype(np.float64) + (0 if bias is None else bias)
        gate, up = v[:, :inter], v[:, inter:]
        if clamped:
            gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0) + 1
        want = gate / (1 + np.exp(-(1.702 if clamped else 1.0) * gate)) * up
        np.testing.assert_allclose(got, want.reshape(-1), rtol=2e-6, atol=1e-6)


def reference_expert(w_gate, w_up, w_down, x, activation="silu", b_gate_up=None, b_down=None,
                     limit=7.0, alpha=1.702):
    gate, up = w_gate @ x.T, w_up @ x.T
    if b_gate_up is not None:
        inter = w_gate.shape[0]
        gate, up = gate + b_gate_up[:inter, None], up + b_gate_up[inter:, None]
    if activation == "silu":
        h = gate / (1 + np.exp(-gate)) * up
    else:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
        h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
    y = (w_down @ h).T
    return y + b_down if b_down is not None else y


@pytest.mark.parametrize("scheme", ["f32", "int8", "q8_0", "q4_0", "mxfp4", "int4_g32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_expert_forward_one_token_and_batch(scheme, activation):
    rng = np.random.default_rng(3)
    hidden, inter = 128, 64
    w_gate, w_up = rng.standard_normal((2, inter, hidden)).astype(np.float32) * 0.1
    w_down = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1
    b_gu = rng.standard_normal(2 * inter).astype(np.float32) if activation != "silu" else None
    b_d = rng.standard_normal(hidden).astype(np.float32) if activation != "silu" else None
    gate_up = quantize(np.concatenate([w_gate, w_up]), scheme)
    down = quantize(w_down, scheme)
    dq = lambda raw, cols: dequantize(raw, scheme, cols).astype(np.float64)  # noqa: E731
    gu = dq(gate_up, hidden)
    x = rng.standard_normal((5, hidden)).astype(np.float32)
    want = reference_expert(gu[:inter], gu[inter:], dq(down, inter), x.astype(np.float64), activation, b_gu, b_d)
    kw = dict(activation=activation, gate_up_bias=b_gu, down_bias=b_d)
    one = expert_forward(stored(gate_up, scheme, hidden), stored(down, scheme, inter), scheme, x[0], **kw)
    tolerance = one_token_tolerance(scheme)
    np.testing.assert_allclose(one, want[0], rtol=tolerance, atol=tolerance * np.abs(want).max())
    batch = expert_forward_batch(stored(gate_up, scheme, hidden), stored(down, scheme, inter), scheme, x, **kw)
    # under 16 tokens a quantized expert runs its tokens through the one-token kernels
    np.testing.assert_allclose(batch, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    # From 16 tokens on, int8 experts run as an int8 GEMM (activations in int8) and block schemes
    # as a bf16 GEMM: close to the float reference, not equal.
    many = rng.standard_normal((40, hidden)).astype(np.float32)
    want = reference_expert(gu[:inter], gu[inter:], dq(down, inter), many.astype(np.float64), activation, b_gu, b_d)
    got = expert_forward_batch(stored(gate_up, scheme, hidden), stored(down, scheme, inter), scheme, many, **kw)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1.5e-2 if scheme != "f32" else 1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_dequantize(scheme, shape):
    from ktc.formats.quantize import f32_to_bf16_bits
    from ktc.runtime.kernels import decode

    rows, cols = shape
    if cols % 128 and scheme == "int4_g128":
        pytest.skip("row not whole groups")
    w = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, scheme)
    want = dequantize(raw, scheme, cols)
    np.testing.assert_allclose(decode(stored(raw, scheme, cols), scheme, cols), want, rtol=1e-6, atol=0)
    # the one-thread twins (an embedding row of a decode step)
    np.testing.assert_allclose(decode(stored(raw, scheme, cols), scheme, cols, serial=True), want, rtol=1e-6, atol=0)
    bits = decode(stored(raw, scheme, cols), scheme, cols, bf16=True)
    np.testing.assert_array_equal(bits, f32_to_bf16_bits(decode(stored(raw, scheme, cols), scheme, cols)))


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="already running without JIT")
def test_kernels_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "not without_jit and not shape2"],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", ["q4_0", "mxfp4", "iq4_nl"])
@pytest.mark.parametrize("shape", [(9, 256), (64, 1024), (3, 384), (5, 352), (2, 96)])
def test_block_vnni_matches_its_definition(scheme, shape):
    """q4_0, mxfp4 and iq4_nl through VNNI compute each block's integer codes (q - 8; twice the
    e2m1 value; the iq4 level) times the activations quantized per 32, scaled by the block's
    scale (d; half the e8m0 power of two; d) and dx, exactly."""
    from model_factory import random_blocks

    from ktc.runtime.kernels import _E8M0

    rows, cols = shape
    rng = np.random.default_rng(cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    raw = random_blocks(scheme, rows, cols, seed=cols) if scheme == "iq4_nl" else quantize(w, scheme)
    blocks = cols // 32
    size = 17 if scheme == "mxfp4" else 18
    b = raw.reshape(rows, blocks, size)
    packed = b[..., size - 16:]
    codes = np.concatenate([packed & 15, packed >> 4], axis=2)
    if scheme != "mxfp4":
        levels = np.arange(16) - 8 if scheme == "q4_0" else np.array(vnni.IQ4_LEVELS_INT)
        ints = levels.astype(np.float64)[codes]
        scale = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    else:
        ints = np.array(vnni.E2M1_TWICE_PLUS_12, dtype=np.float64)[codes] - 12
        scale = 0.5 * _E8M0[b[..., 0]].astype(np.float64)
    xq, dx, _ = vnni.quantize_activations(x, 32)
    dots = (ints * xq.reshape(blocks, 32).astype(np.float64)).sum(axis=2)
    want = (scale * dx * dots).sum(axis=1)
    np.testing.assert_allclose(ints * scale[..., None], dequantize(raw, scheme, cols).reshape(rows, blocks, 32))
    got = matvec(raw, scheme, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _blocks_case(scheme: str, rows: int, cols: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A random matrix of ``scheme`` (iq4_nl and iq4_xs have no quantizer: random blocks) and tokens."""
    from model_factory import random_blocks

    rng = np.random.default_rng(rows * cols + tokens)
    raw = (random_blocks(scheme, rows, cols, seed=cols) if scheme in ("iq4_nl", "iq4_xs")
           else quantize(rng.standard_normal((rows, cols)).astype(np.float32), scheme))
    return raw, rng.standard_normal((tokens, cols)).astype(np.float32) * rng.uniform(0.1, 10)


def _as_the_lanes_take_them(raw: np.ndarray, scheme: str, cols: int, tokens: int) -> np.ndarray:
    """The dequantized weights, int4_g32's minimums (where its rows are whole 256s, from
    ``PAIRED_INT4_TOKENS`` tokens on) rounded as ``lanes._int16_minimums`` rounds them: each
    super-block's 8 to int16 multiples of their largest magnitude / 32767."""
    from ktc.runtime.lanes import PAIRED_INT4_TOKENS

    weights = dequantize(raw, scheme, cols).astype(np.float64)
    if scheme != "int4_g32" or cols % 256 or tokens < PAIRED_INT4_TOKENS:
        return weights
    groups = cols // 32
    bits = np.ascontiguousarray(raw[:, cols // 2 + 2 * groups:]).view(np.uint16).astype(np.uint32)
    minimums = (bits << 16).view(np.float32).reshape(len(raw), groups // 8, 8)
    top = np.abs(minimums).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        unit = np.where(top > 0, top / np.float32(32767), np.float32(1)).astype(np.float32)
        inverse = np.where(top > 0, np.float32(32767) / top, np.float32(0)).astype(np.float32)
    rounded = np.rint(minimums * inverse).astype(np.float64) * unit
    moved = (rounded - minimums).reshape(len(raw), groups)
    return weights + np.repeat(moved, 32, axis=1)


TILED = ["q8_0", "q4_0", "mxfp4", "iq4_nl", "q4_k", "q5_k", "q6_k"]  # row tiles for a few tokens
IN_PLACE = TILED + ["iq4_xs", "int4_g32", "int4_g64", "int4_g128", "int8"]


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", TILED)
@pytest.mark.parametrize("rows, cols, tokens", [(37, 256, 5), (16, 512, 2), (9, 1024, 7), (40, 256, 3)])
def test_batched_blocks_equal_the_one_token_kernels(scheme, rows, cols, tokens):
    """A few tokens multiplied in place (tiles of rows x tokens; the rows and tokens past the last
    whole tile one by one) give what the one-token kernel gives each token, which reads the same
    int8 activations (per 32; per 256 for the K-quants); and the dequantized weights times the
    tokens within the activations' rounding."""
    from ktc.runtime.kernels import LANES_MIN_TOKENS, cpu_kernels, linear

    raw, x = _blocks_case(scheme, rows, cols, tokens)
    fits, _ = cpu_kernels(scheme).in_place
    assert fits(scheme, cols) and tokens < LANES_MIN_TOKENS[scheme]
    got = linear(x, raw, scheme)
    one = np.stack([matvec(raw, scheme, row) for row in x])
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())
    want = x.astype(np.float64) @ dequantize(raw, scheme, cols).astype(np.float64).T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", IN_PLACE)
@pytest.mark.parametrize("rows, cols, tokens", [(37, 256, 16), (9, 1024, 21), (40, 512, 33), (3, 256, 50)])
def test_lanes_match_their_definition(scheme, rows, cols, tokens):
    """Many tokens (16 a vector, the last group padded; tiles of three groups where three fit in
    rows of up to ``TRIPLE_COLS`` values, of two, of one; chunks of 16 rows, the last one short)
    give the dequantized weights times each token's activations quantized to int8 per 256 values
    where the row is whole 256s (per 32 where not, int4_g64 per 64; int4_g128 per 128), up to
    float rounding; ``linear`` sends them there (below
    ``AMX_MIN_TOKENS`` where the CPU has AMX; int8 not at all there)."""
    from ktc.runtime import amx, kernels, lanes
    from ktc.runtime.kernels import AMX_MIN_TOKENS, LANES_MIN_TOKENS, linear

    raw, x = _blocks_case(scheme, rows, cols, tokens)
    assert lanes.fits(scheme, cols) and tokens >= LANES_MIN_TOKENS[scheme]
    group = lanes.activation_group(scheme, cols)
    assert group == {"int4_g64": 256 if cols % 256 == 0 else 64, "int4_g128": 128, "int8": min(256, cols),
                     "q4_k": 256, "q5_k": 256, "q6_k": 256, "iq4_xs": 256}.get(scheme, 256 if cols % 256 == 0 else 32)
    want = _lanes_definition(raw, x, scheme, cols)
    got = lanes.matmul(x, raw, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if not amx.HAVE_AMX or (scheme != "int8" and tokens < AMX_MIN_TOKENS[scheme]):
        np.testing.assert_array_equal(got, linear(x, raw, scheme))
        assert kernels._by_lanes(raw, scheme, tokens, cols)


def _lanes_definition(raw: np.ndarray, x: np.ndarray, scheme: str, cols: int) -> np.ndarray:
    """What ``lanes.matmul`` gives by definition: the tokens quantized as the lanes quantize them
    (``activation_group``) times the weights as the lanes take them (float64)."""
    from ktc.runtime import lanes

    group = lanes.activation_group(scheme, cols)
    quantized = np.stack([np.repeat(dx, group) * xq
                          for xq, dx, _ in (vnni.quantize_activations(row, group) for row in x)])
    return quantized.astype(np.float64) @ _as_the_lanes_take_them(raw, scheme, cols, x.shape[0]).T


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", IN_PLACE)
@pytest.mark.parametrize("rows, cols, tokens", [(21, 4352, 40), (37, 12544, 70)])
def test_lanes_slice_long_rows(scheme, rows, cols, tokens):
    """Rows of more than ``TRIPLE_COLS`` values (whole 256s) go in slices of at most that many
    from ``SLICE_MIN_TOKENS`` tokens on (two slices of 8 and 9 super-blocks; four of 12 and 13),
    the sums carried from one to the next: still the definition's products, by token and by row
    (the direct path of whole chunks too); the first tokens alone, in one piece, the same up to
    the order of the float sums."""
    from ktc.runtime import lanes

    assert cols > lanes.TRIPLE_COLS and cols % 256 == 0 and tokens >= lanes.SLICE_MIN_TOKENS
    raw, x = _blocks_case(scheme, rows, cols, tokens)
    want = _lanes_definition(raw, x, scheme, cols)
    got = lanes.matmul(x, raw, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(lanes.matmul(x, raw, scheme, by_row=True)[:, :tokens].T, got)
    few = lanes.SLICE_MIN_TOKENS - 1
    np.testing.assert_allclose(lanes.matmul(x[:few], raw, scheme), got[:few], rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("cols", [256, 512, 768])
def test_lanes_take_int4_g32_minimums_as_integers_from_enough_tokens(cols):
    """From ``PAIRED_INT4_TOKENS`` tokens on int4_g32's minimums go in as q4_k's do, int16 a
    super-block (an odd last one converted alone where a row has 3): the products are the weights
    with those minimums times the quantized tokens; with fewer tokens the bf16 minimums, exactly."""
    from ktc.runtime import lanes

    for tokens in (lanes.PAIRED_INT4_TOKENS - 1, lanes.PAIRED_INT4_TOKENS + 2):
        raw, x = _blocks_case("int4_g32", 21, cols, tokens)
        quantized = np.stack([np.repeat(dx, 256) * xq
                              for xq, dx, _ in (vnni.quantize_activations(row, 256) for row in x)])
        want = quantized.astype(np.float64) @ _as_the_lanes_take_them(raw, "int4_g32", cols, tokens).T
        got = lanes.matmul(x, raw, "int4_g32")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        exact = quantized.astype(np.float64) @ dequantize(raw, "int4_g32", cols).astype(np.float64).T
        if tokens >= lanes.PAIRED_INT4_TOKENS:  # the rounding shows against the bf16 minimums
            assert np.abs(got - exact).max() > 1e-7 * np.abs(exact).max()


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", IN_PLACE)
def test_lanes_wide_chunks_match_the_narrow_ones(scheme, monkeypatch):
    """Chunks of WIDE_CHUNK_ROWS rows (two whole, the last short; their sums transposed 16 rows
    at a time) give the products of 16-row chunks, token by token and by row."""
    from ktc.runtime import lanes

    assert lanes.chunk_rows(256, 4096, 14336, 2) == lanes.chunk_rows(16, 4096, 4096, 2) == lanes.WIDE_CHUNK_ROWS
    assert lanes.chunk_rows(32, 4096, 14336, 2) == lanes.chunk_rows(256, 500, 4096, 2) == lanes.CHUNK_ROWS
    raw, x = _blocks_case(scheme, 2 * lanes.WIDE_CHUNK_ROWS + 5, 256, 50)
    narrow = lanes.matmul(x, raw, scheme), lanes.matmul(x, raw, scheme, by_row=True)
    monkeypatch.setattr(lanes, "chunk_rows", lambda n, rows, cols, workers: lanes.WIDE_CHUNK_ROWS)
    wide = lanes.matmul(x, raw, scheme), lanes.matmul(x, raw, scheme, by_row=True)
    for got, want in zip(wide, narrow):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(wide[1][:, :50].T, wide[0])


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "mxfp4", "iq4_nl", "int4_g32"])
@pytest.mark.parametrize("cols", [96, 160, 224, 288, 544])
def test_lanes_unpack_blocks_four_at_a_time_and_the_rest_alone(scheme, cols):
    """The block kinds' rows (and int4_g32's groups) are unpacked four blocks a call and the last
    (a row of 3, 5, 7, 9 or 17 blocks) one by one, int4's scales and minimums 16 a vector and the
    rest one by one: every block's codes and scale where the tiles read them (the products equal
    the dequantized weights times the quantized tokens)."""
    from ktc.runtime import lanes

    raw, x = _blocks_case(scheme, 19, cols, 18)
    quantized = np.stack([np.repeat(dx, 32) * xq for xq, dx, _ in (vnni.quantize_activations(row, 32) for row in x)])
    want = quantized.astype(np.float64) @ dequantize(raw, scheme, cols).astype(np.float64).T
    np.testing.assert_allclose(lanes.matmul(x, raw, scheme), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_int8_products_take_the_lanes_between_their_token_counts(monkeypatch):
    """int8 on a VNNI CPU without AMX: below LANES_MIN_TOKENS token by token, from there the
    lanes, from LANES_MAX_TOKENS torch's int8 GEMM (on a CPU with AMX its int8 product as before);
    each within the activations' rounding of the float product."""
    from ktc.runtime import amx, kernels

    if amx.HAVE_AMX:
        pytest.skip("int8 goes through AMX's int8 product on this CPU")
    taken = []
    for module, name in ((kernels, "stepwise"), (kernels.lanes, "matmul"), (kernels, "_int8_gemm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name: taken.append(name) or real(*args))
    monkeypatch.setattr(kernels, "LANES_MAX_TOKENS", {"int8": 24})
    least = kernels.LANES_MIN_TOKENS["int8"]
    raw, x = _blocks_case("int8", 40, 256, 24)
    for tokens in (least - 1, least, 23, 24):
        want = x[:tokens].astype(np.float64) @ dequantize(raw, "int8", 256).astype(np.float64).T
        got = kernels.linear(x[:tokens], raw, "int8")
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    assert taken == ["stepwise", "matmul", "matmul", "_int8_gemm"]
    assert kernels._by_lanes(raw, "int8", 23, 256) and not kernels._by_lanes(raw, "int8", 24, 256)


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("cols, group", [(96, 32), (128, 32), (224, 32), (256, 256), (2304, 256)])
def test_int8_lanes_quantize_per_span(cols, group):
    """int8 rows (one scale a row) take their activations per 256 values where the row is whole
    256s (else per 32), and their products sum as integers over them: the dequantized
    weights times the tokens so quantized, up to float rounding."""
    from ktc.runtime import lanes

    raw, x = _blocks_case("int8", 21, cols, 19)
    assert lanes.activation_group("int8", cols) == group
    quantized = np.stack([np.repeat(dx, group) * xq
                          for xq, dx, _ in (vnni.quantize_activations(row, group) for row in x)])
    want = quantized.astype(np.float64) @ dequantize(raw, "int8", cols).astype(np.float64).T
    np.testing.assert_allclose(lanes.matmul(x, raw, "int8"), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", IN_PLACE)
@pytest.mark.parametrize("rows, cols, tokens", [(37, 256, 16), (40, 512, 33), (3, 256, 50)])
def test_lanes_by_row_is_the_transpose(scheme, rows, cols, tokens):
    """``lanes.matmul(by_row=True)`` stores each row's sums for every token, the tokens padded to
    whole vectors of 16 with zeros: the transpose of the products by token, exactly (the same
    tiles' sums; rows past the last whole chunk through the chunk's buffer)."""
    from ktc.runtime import lanes

    raw, x = _blocks_case(scheme, rows, cols, tokens)
    by_row = lanes.matmul(x, raw, scheme, by_row=True)
    assert by_row.shape == (rows, -(-tokens // 16) * 16)
    np.testing.assert_array_equal(by_row[:, :tokens], lanes.matmul(x, raw, scheme).T)
    assert not by_row[:, tokens:].any()


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", IN_PLACE)
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("tokens, inter", [(37, 256), (200, 2048)])
def test_activated_is_the_activation_quantized(scheme, activation, tokens, inter):
    """Gate/up products given by row (``lanes.activated``: the activation and down's quantization
    16 tokens at a time, an item one group or, with enough spans to share out, all 13 groups)
    multiply down as the activation computed token by token and quantized by ``lanes.matmul`` do
    (within the exponential's rounding); the padding tokens' products, whatever they hold,
    change nothing."""
    from ktc.runtime import lanes
    from ktc.runtime.kernels import _act

    rng = np.random.default_rng(5)
    down, _ = _blocks_case(scheme, 24, inter, tokens)
    h = rng.standard_normal((tokens, 2 * inter)).astype(np.float32) * 3
    bias = rng.standard_normal(2 * inter).astype(np.float32) if activation != "silu" else None
    h_rows = np.full((2 * inter, -(-tokens // 16) * 16), 1e3, np.float32)
    h_rows[:, :tokens] = h.T
    clamped = activation == "swiglu_clamped"
    got = lanes.product(lanes.activated(h_rows, tokens, inter, scheme, clamped, 7.0, 1.702, bias), tokens, inter,
                        down, scheme)
    with np.errstate(over="ignore"):
        a = _act(h if bias is None else h + bias, inter, activation, 7.0, 1.702).astype(np.float32)
    want = lanes.matmul(a, down, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_batched_expert_by_row_equals_token_by_token(monkeypatch):
    """An expert whose gate/up and down both go to ``lanes.matmul`` takes gate/up by row and its
    activation quantized 16 tokens at a time: the same output as product, activation, product
    (within the exponential's rounding); calls of other sizes between, which reuse the thread's
    scratch arrays, change nothing."""
    from ktc.runtime import kernels

    rng = np.random.default_rng(8)
    hidden, inter = 128, 96
    gate_up = quantize(rng.standard_normal((2 * inter, hidden)).astype(np.float32), "q4_0")
    down = quantize(rng.standard_normal((hidden, inter)).astype(np.float32), "q8_0")
    x = rng.standard_normal((40, hidden)).astype(np.float32)
    bias = rng.standard_normal(hidden).astype(np.float32)
    first = expert_forward_batch(gate_up, down, "q4_0+q8_0", x, down_bias=bias)
    expert_forward_batch(gate_up, down, "q4_0+q8_0", x[:20])
    expert_forward_batch(gate_up, down, "q4_0+q8_0", np.concatenate([x, x]))
    np.testing.assert_array_equal(expert_forward_batch(gate_up, down, "q4_0+q8_0", x, down_bias=bias), first)
    monkeypatch.setattr(kernels, "_by_lanes", lambda *args: False)
    apart = expert_forward_batch(gate_up, down, "q4_0+q8_0", x, down_bias=bias)
    np.testing.assert_allclose(first, apart, rtol=1e-4, atol=1e-4 * np.abs(apart).max())


@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_many_tokens_activation_compiled_equals_numpy(activation, monkeypatch):
    """Many tokens' activation (``kernels._act`` from ``ACT_PARALLEL_VALUES`` gate/up values on,
    compiled on every thread) equals numpy's within float rounding, large gates included."""
    from ktc.runtime import kernels

    h = np.random.default_rng(4).standard_normal((40, 2 * 1000)).astype(np.float32) * 6
    monkeypatch.setattr(kernels, "ACT_PARALLEL_VALUES", h.size)
    got = kernels._act(h, 1000, activation, None, None)
    monkeypatch.setattr(kernels, "ACT_PARALLEL_VALUES", h.size + 1)
    with np.errstate(over="ignore"):
        want = kernels._act(h, 1000, activation, None, None)
    assert got.shape == want.shape == (40, 1000)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_scratch_arrays_are_kept_per_thread_up_to_a_size(monkeypatch):
    """``lanes.scratch`` gives the same aligned array again for its key (a larger one when asked
    for more), another thread its own, and keeps none above ``SCRATCH_KEEP_BYTES``."""
    import threading

    from ktc.runtime import lanes

    first = lanes.scratch("test", 100, np.float32)
    assert first.ctypes.data % 64 == 0 and first.shape == (100,)
    assert lanes.scratch("test", 50, np.float32).ctypes.data == first.ctypes.data
    grown = lanes.scratch("test", 1000, np.float32)
    assert grown.shape == (1000,) and lanes.scratch("test", 10, np.float32).ctypes.data == grown.ctypes.data
    other = []
    thread = threading.Thread(target=lambda: other.append(lanes.scratch("test", 10, np.float32).ctypes.data))
    thread.start()
    thread.join()
    assert other[0] != grown.ctypes.data
    monkeypatch.setattr(lanes, "SCRATCH_KEEP_BYTES", 4096)
    big = lanes.scratch("test", 2000, np.float32)
    assert big.shape == (2000,) and lanes.scratch("test", 10, np.float32).ctypes.data == grown.ctypes.data


def test_bf16_gemm_decodes_in_tiles(monkeypatch):
    """The bf16 path decodes a matrix a tile of rows at a time; the tiles (the last one short) put
    together give the product of the whole matrix decoded at once."""
    import torch

    from ktc.runtime import kernels

    rng = np.random.default_rng(11)
    raw = quantize(rng.standard_normal((100, 256)).astype(np.float32), "q4_0")
    x = rng.standard_normal((20, 256)).astype(np.float32)
    whole = torch.from_numpy(kernels.decode(raw, "q4_0", 256, bf16=True)).view(torch.bfloat16)
    want = (torch.from_numpy(x).to(torch.bfloat16) @ whole.T).float().numpy()
    monkeypatch.setattr(kernels, "DECODE_TILE_BYTES", 16 * 2 * 256)  # 16 rows a tile
    np.testing.assert_allclose(kernels._bf16_gemm(x, raw, "q4_0"), want, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_batched_blocks_outside_their_tiles(monkeypatch):
    """Rows that are not whole steps of the row tiles' loop (q4_0 at 96 columns) go 16 tokens a
    vector even for a few tokens; whole steps take the tiles below LANES_MIN_TOKENS and the
    lanes from there; each gives the same products."""
    from ktc.runtime import lanes
    from ktc.runtime.kernels import LANES_MIN_TOKENS, linear

    taken = []
    for module, name in ((lanes, "matmul"), (vnni, "matmul_blocks")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name: taken.append(name) or real(*args))
    rng = np.random.default_rng(3)
    least = LANES_MIN_TOKENS["q4_0"]
    for cols, tokens in ((96, 4), (128, least - 1), (128, least)):
        raw = quantize(rng.standard_normal((24, cols)).astype(np.float32), "q4_0")
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        want = x.astype(np.float64) @ dequantize(raw, "q4_0", cols).astype(np.float64).T
        assert np.linalg.norm(linear(x, raw, "q4_0") - want) / np.linalg.norm(want) < 1e-2
    assert taken == ["matmul", "matmul_blocks", "matmul"]
    assert not vnni.batched_fits("q4_0", 96) and vnni.batched_fits("q4_0", 128) and lanes.fits("q4_0", 96)
    assert not vnni.batched_fits("int8", 128) and lanes.fits("int8", 128) and not lanes.fits("int8", 112)


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("shape", [(9, 256), (64, 2048), (3, 384)])
def test_int8_vnni_matches_its_definition(shape):
    """int8 through VNNI: each row's codes times the activations quantized per 32, summed with
    the blocks' dx, times the row's scale, exactly."""
    rows, cols = shape
    rng = np.random.default_rng(cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    raw = quantize(w, "int8")
    codes = raw[:, :cols].view(np.int8).astype(np.float64).reshape(rows, cols // 32, 32)
    scale = raw[:, cols:].copy().view(np.float32)[:, 0].astype(np.float64)
    xq, dx, _ = vnni.quantize_activations(x, 32)
    want = scale * (dx * (codes * xq.reshape(cols // 32, 32)).sum(axis=2)).sum(axis=1)
    got = matvec(raw, "int8", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("shape", [(9, 256), (64, 2048), (3, 384)])
def test_q8_0_vnni_matches_its_definition(shape):
    """q8_0 through VNNI: each block's int8 codes times the activations quantized per 32,
    scaled by d and dx, exactly (as llama.cpp's q8_0 x q8_0 dot product)."""
    rows, cols = shape
    rng = np.random.default_rng(cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    raw = quantize(w, "q8_0")
    blocks = cols // 32
    b = raw.reshape(rows, blocks, 34)
    codes = b[..., 2:].view(np.int8).astype(np.float64)
    scale = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    xq, dx, _ = vnni.quantize_activations(x, 32)
    want = (scale * dx * (codes * xq.reshape(blocks, 32)).sum(axis=2)).sum(axis=1)
    got = matvec(raw, "q8_0", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _per_256(x: np.ndarray) -> np.ndarray:
    """x quantized per 256 values as q4_k's kernel reads it, dequantized: rint(x / d) * d, d the
    block's largest magnitude over 127."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    d[d == 0] = 1
    return (np.rint(blocks * (np.float32(1) / d)[:, None]) * d[:, None]).reshape(-1).astype(np.float64)


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("shape", [(9, 256), (64, 2048), (3, 768), (3, 8192)])
def test_q4_k_q5_k_and_q6_k_vnni_match_their_definition(scheme, shape):
    """q4_k, q5_k and q6_k through VNNI: the dequantized weights times the activations quantized
    per 256 values (llama.cpp's q4_K, q5_K and q6_K x q8_K products), exactly but for float
    rounding; the activations' layouts and sums are what the kernels read."""
    from ktc.runtime import kquants

    rows, cols = shape
    rng = np.random.default_rng(cols + rows)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    x[:32] = 0  # a zero sub-block
    raw = quantize(w, scheme)
    want = dequantize(raw, scheme, cols).reshape(rows, cols).astype(np.float64) @ _per_256(x)
    got = matvec(raw, scheme, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    yk, dk, bsum = kquants.superblock_activations(x, 1, cols, True, True)
    codes = np.rint(_per_256(x).reshape(-1, 256) / dk[0][:, None]).astype(np.int64)
    order = [0, 2, 1, 3, 4, 6, 5, 7]  # q4_k, q5_k: each 128 values' sub-blocks as the codes' nibbles hold them
    np.testing.assert_array_equal(yk[0, :cols].reshape(-1, 8, 32), codes.reshape(-1, 8, 32)[:, order])
    np.testing.assert_array_equal(yk[0, cols:], codes.reshape(-1))  # q6_k: in order
    np.testing.assert_array_equal(bsum[0], codes.reshape(-1, 16).sum(axis=1))


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme", sorted(vnni.FUSED))
@pytest.mark.parametrize("cols", [384, 352, 1024])
@pytest.mark.parametrize("shared", [True, False])
def test_fused_experts_equal_one_by_one(scheme, cols, shared):
    """The multi-expert kernel (the same matrix of k experts of a layer, placed anywhere in the
    file) gives each expert's rows as the one-matrix kernel does, with one activation vector for
    all (gate/up of one token) or one each (down); column counts with and without a tail past
    the last whole four blocks."""
    from model_factory import random_blocks

    from ktc.formats.schemes import get_scheme

    if get_scheme(scheme).block_elems == 256:  # K-quant super-blocks: 512 and 768 in place of 384 and 352
        cols = {384: 512, 352: 768}.get(cols, cols)
    if cols % max(get_scheme(scheme).block_elems, 32):
        pytest.skip("row not whole groups")
    rng = np.random.default_rng(cols)
    rows, k = 70, 3  # more rows than one 64-row work item
    mats = [quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, scheme)
            if get_scheme(scheme).quantize else random_blocks(scheme, rows, cols, e) for e in range(k)]
    stride = (mats[0].nbytes + 4 * 37) // 4 * 4  # unused bytes between the experts; 4-aligned as in a bundle
    file = np.zeros(k * stride + 4, dtype=np.uint8)
    offsets = np.array([e * stride + 4 for e in range(k)][::-1], dtype=np.int64)
    for e, raw in enumerate(mats):
        file[offsets[e]:offsets[e] + raw.nbytes] = raw.reshape(-1)
    x = rng.standard_normal((1 if shared else k, cols)).astype(np.float32)
    got = experts_rows(file, scheme, offsets, rows, x)
    for e, raw in enumerate(mats):
        want = matvec(raw, scheme, x[0 if shared else e])
        np.testing.assert_allclose(got[e], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("cols", [384, 352])
@pytest.mark.parametrize("shared", [True, False])
def test_fused_experts_of_mixed_schemes(cols, shared):
    """Experts of one layer in different schemes (a plan's hot experts in int8, the rest in
    4 bits) through one multi-expert call: each expert's rows as its one-matrix kernel gives."""
    schemes = ["q4_0", "int8", "mxfp4", "int4_g32", "q8_0", "q4_0", "int4_g32"]
    rng = np.random.default_rng(cols)
    rows = 70
    mats = [quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, s) for s in schemes]
    offsets, at = [], 8
    for raw in mats:
        offsets.append(at)
        at += (raw.nbytes + 4 * 13) // 4 * 4
    file = np.zeros(at + 4, dtype=np.uint8)
    for off, raw in zip(offsets, mats):
        file[off:off + raw.nbytes] = raw.reshape(-1)
    x = rng.standard_normal((1 if shared else len(schemes), cols)).astype(np.float32)
    got = experts_rows(file, schemes, np.array(offsets, dtype=np.int64), rows, x)
    for e, (scheme, raw) in enumerate(zip(schemes, mats)):
        want = matvec(raw, scheme, x[0 if shared else e])
        np.testing.assert_allclose(got[e], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=scheme)


@pytest.mark.parametrize("clamped", [False, True])
def test_activation_matches_its_definition(clamped):
    """The experts' activation between gate/up and down (``vnni.activate``, its exponential a
    polynomial in 16-lane loops) against SiLU(gate) * up and gpt-oss's clamped SwiGLU in float64,
    with biases, element by element, for gates from -50 to 50 (exp(-1.702 * gate) near float32's
    largest)."""
    rng = np.random.default_rng(5)
    k, inter = 3, 400
    h = (rng.standard_normal((k, 2 * inter)) * rng.choice([0.1, 3.0, 20.0], (k, 2 * inter))).astype(np.float32)
    bias = rng.standard_normal((k, 2 * inter)).astype(np.float32)
    h = np.clip(h + bias, -50, 50) - bias
    limit, alpha = np.float32(7.0), np.float32(1.702)
    got = vnni.activate(h, inter, clamped, limit, alpha, bias, True)
    gate, up = (h + bias)[:, :inter].astype(np.float64), (h + bias)[:, inter:].astype(np.float64)
    if clamped:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit) + 1
    want = gate / (1 + np.exp(-(alpha if clamped else 1) * gate)) * up
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("threads,total", [(1, 5), (2, 1), (2, 7), (2, 96), (3, 10), (4, 3), (5, 64)])
def test_work_items_taken_once_each(threads, total):
    """``vnni.work_item``: under any order of the threads' turns every item is taken exactly
    once, a thread's own part in increasing order before it takes from another's, and each
    thread gets -1 once none is left."""
    rng = np.random.default_rng(threads * 100 + total)
    for _ in range(20):
        counters = vnni.work_counters(threads)
        taken = {t: [] for t in range(threads)}
        running = list(range(threads))
        while running:
            t = running[rng.integers(len(running))]
            item = vnni.work_item(counters, t, threads, total)
            if item < 0:
                running.remove(t)
            else:
                taken[t].append(item)
        assert sorted(i for items in taken.values() for i in items) == list(range(total))
        for t, items in taken.items():
            own = [i for i in items if t * total // threads <= i < (t + 1) * total // threads]
            assert items[:len(own)] == own == sorted(own)


def _experts_file(rng, parts, hidden, inter):
    """Random experts of (gate/up, down) schemes ``parts``, quantized, one after another in one
    byte array (padded to whole float32 words): (the experts' matrices, the array, the gate/up
    and down byte offsets). The array is read-only, as a bundle's map is (the compiled calls'
    type: ``ktc.formats.kernel_args``)."""
    experts = [(quantize(rng.standard_normal((2 * inter, hidden)).astype(np.float32) * 0.1, gu),
                quantize(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1, dn)) for gu, dn in parts]
    file = np.concatenate([np.concatenate([gu.reshape(-1), dn.reshape(-1)]) for gu, dn in experts])
    file = np.concatenate([file, np.zeros(-len(file) % 4 + 4, dtype=np.uint8)])
    sizes = [gu.nbytes + dn.nbytes for gu, dn in experts]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return experts, read_only(file), starts, starts + np.array([gu.nbytes for gu, _ in experts])


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "q4_0", "mxfp4", "int4_g32", "q4_k", "q5_k", "q4_k+q6_k",
                                    ("q4_0", "q4_k+q6_k", "q8_0"), "fp8_e4m3", ("fp8_e4m3", "q4_0", "q4_k+q6_k")])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_experts_token_equals_experts_one_by_one(scheme, activation):
    """One token through k experts of a layer at once (the fused decode path: int8's float
    kernel, or VNNI for every scheme, the block kinds and K-quants in one call, gate/up and down
    in different schemes, each expert in its own; also run with NUMBA_DISABLE_JIT=1 by
    test_kernels_without_jit) equals the weighted sum of each expert's own forward."""
    from ktc.formats.schemes import expert_schemes
    from ktc.runtime.kernels import experts_token

    if scheme != "int8" and not vnni.HAVE_VNNI:
        pytest.skip("the fused path of this scheme needs AVX-512 VNNI")
    rng = np.random.default_rng(11)
    k = 3
    names = [scheme] * k if isinstance(scheme, str) else list(scheme)
    pairs = [tuple(part.name for part in expert_schemes(name)) for name in names]
    hidden, inter = 256, 256 if any(part.endswith("_k") for pair in pairs for part in pair) else 128
    experts, file, gate_up_offsets, down_offsets = _experts_file(rng, pairs, hidden, inter)
    x = rng.standard_normal(hidden).astype(np.float32)
    weights = rng.uniform(0.1, 1, k).astype(np.float32)
    biases = ((rng.standard_normal((k, 2 * inter)).astype(np.float32), rng.standard_normal((k, hidden)).astype(np.float32))
              if activation != "silu" else (None, None))
    got = experts_token(file, scheme if isinstance(scheme, str) else names, gate_up_offsets, down_offsets, hidden,
                        inter, x, weights, activation=activation, gate_up_bias=biases[0], down_bias=biases[1])
    want = sum(weights[e] * expert_forward(gu, dn, names[e], x, activation=activation,
                                           gate_up_bias=None if biases[0] is None else biases[0][e],
                                           down_bias=None if biases[1] is None else biases[1][e])
               for e, (gu, dn) in enumerate(experts))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scheme,inter", [("q8_0", 2048), ("q4_0", 4096), ("int8", 128)])
def test_experts_token_long_down_rows_equal_experts_one_by_one(scheme, inter):
    """Down rows long enough for spans of every expert (``rows.SPAN_BYTES``: their sum inside
    the down region), and short ones (an expert at a time, then the sum), equal the weighted sum
    of each expert's own forward."""
    from ktc.formats.schemes import get_scheme
    from ktc.runtime import rows
    from ktc.runtime.kernels import experts_token

    if scheme != "int8" and not vnni.HAVE_VNNI:
        pytest.skip("the fused path of this scheme needs AVX-512 VNNI")
    long_rows = get_scheme(scheme).matrix_bytes(1, inter) * rows.ROWS_PER_ITEM >= rows.SPAN_BYTES
    assert long_rows == (inter > 128)
    rng = np.random.default_rng(13)
    k, hidden = 3, 64
    experts, file, gate_up_offsets, down_offsets = _experts_file(rng, [(scheme, scheme)] * k, hidden, inter)
    x = rng.standard_normal(hidden).astype(np.float32)
    weights = rng.uniform(0.1, 1, k).astype(np.float32)
    got = experts_token(file, scheme, gate_up_offsets, down_offsets, hidden, inter, x, weights)
    want = sum(weights[e] * expert_forward(gu, dn, scheme, x) for e, (gu, dn) in enumerate(experts))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="the pairs' one call needs AVX-512 VNNI")
@pytest.mark.parametrize("scheme,activation", [("q4_0", "silu"), ("q4_k+q6_k", "silu"),
                                               (("q8_0", "q4_0", "mxfp4", "q4_k"), "swiglu_clamped")])
def test_pairs_of_an_expert_and_a_token_equal_each_expert_s_forward(scheme, activation):
    """Experts given one token each, in one compiled call (``rows.pairs_token``: a prompt chunk's
    experts of one token), equal each expert's own forward of its token, weighted and added to
    the token's row: a token may appear in several pairs, an expert in none."""
    from ktc.formats.schemes import expert_schemes
    from ktc.runtime import rows

    rng = np.random.default_rng(12)
    count = 4  # experts of the layer
    names = [scheme] * count if isinstance(scheme, str) else list(scheme)
    parts = [tuple(part.name for part in expert_schemes(name)) for name in names]
    hidden, inter = 256, 256
    experts, file, starts, down_offsets = _experts_file(rng, parts, hidden, inter)
    gu_kinds, gu_rows = rows.layout(tuple(p[0] for p in parts), hidden)
    dn_kinds, dn_rows = rows.layout(tuple(p[1] for p in parts), inter)
    f16, e8m0 = vnni._tables()
    clamped = activation != "silu"
    biases = ((rng.standard_normal((count, 2 * inter)).astype(np.float32),
               rng.standard_normal((count, hidden)).astype(np.float32)) if clamped else (None, None))
    none = np.zeros((1, 1), np.float32)
    n = 3  # tokens
    xs = rng.standard_normal((n, hidden)).astype(np.float32)
    pair_experts = np.array([2, 0, 3, 1, 2], dtype=np.int64)
    pair_tokens = np.array([0, 0, 2, 2, 2], dtype=np.int64)  # token 1 in none
    weights = rng.uniform(0.1, 1, len(pair_experts)).astype(np.float32)
    got = rows.pairs_token(file, file.view(np.float32), f16, e8m0, gu_kinds, starts, gu_rows, dn_kinds,
                           down_offsets, dn_rows, inter, clamped,
                           np.float32(7.0), np.float32(1.702), biases[0] if clamped else none, clamped,
                           biases[1] if clamped else none, clamped, pair_experts, pair_tokens, weights,
                           xs[pair_tokens], n)
    want = np.zeros((n, hidden), np.float32)
    for e, t, w in zip(pair_experts, pair_tokens, weights):
        gu, dn = experts[e]
        want[t] += w * expert_forward(gu, dn, names[e], xs[t], activation=activation,
                                      gate_up_bias=None if biases[0] is None else biases[0][e],
                                      down_bias=None if biases[1] is None else biases[1][e])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[1].any()


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="the batched row tiles need AVX-512 VNNI")
@pytest.mark.parametrize("scheme,activation", [("q4_0", "silu"), ("q8_0", "swiglu_clamped"), ("mxfp4", "silu"),
                                               ("q4_k+q6_k", "silu"), ("q5_k", "swiglu_clamped")])
def test_experts_of_a_few_tokens_in_one_call_equal_each_expert_s_forward(scheme, activation):
    """Experts of a few tokens each (``rows.experts_groups``: a prompt chunk's experts of 2-11
    tokens; the block kinds' and the K-quants' row tiles, gate/up and down in different kinds)
    in one compiled call equal each expert's own forward of each of its tokens, weighted and
    added to the token's row: groups of 2, 3 (past the last whole tile of two tokens) and 5
    tokens, a token in several groups, a token in none."""
    from ktc.formats.schemes import expert_schemes
    from ktc.runtime import rows

    rng = np.random.default_rng(13)
    parts = [tuple(part.name for part in expert_schemes(scheme))] * 3
    hidden, inter = 256, 256 if "_k" in scheme else 128
    experts, file, starts, down_offsets = _experts_file(rng, parts, hidden, inter)
    gu_kind, dn_kind = rows.kind(parts[0][0]), rows.kind(parts[0][1])
    gu_row_bytes, dn_row_bytes = experts[0][0].shape[1], experts[0][1].shape[1]
    f16, e8m0 = vnni._tables()
    n = 6
    xs = rng.standard_normal((n, hidden)).astype(np.float32)
    order = np.array([2, 0, 1], dtype=np.int64)  # the experts, in the call's order
    tokens = np.array([0, 4, 1, 2, 4, 0, 1, 2, 3, 4], dtype=np.int64)  # token 5 in none
    groups = np.array([0, 2, 5, 10], dtype=np.int64)
    weights = rng.uniform(0.1, 1, len(tokens)).astype(np.float32)
    clamped = activation != "silu"
    biases = ((rng.standard_normal((3, 2 * inter)).astype(np.float32),
               rng.standard_normal((3, hidden)).astype(np.float32)) if clamped else (None, None))
    per_token = np.repeat(order, np.diff(groups))
    none = np.zeros((1, 1), np.float32)
    got = rows.experts_groups(file, f16, e8m0, gu_kind, starts[order], gu_row_bytes, dn_kind, down_offsets[order],
                              dn_row_bytes, inter, clamped, np.float32(7.0), np.float32(1.702),
                              biases[0] if clamped else none, clamped, biases[1] if clamped else none, clamped,
                              groups, per_token, xs[tokens], weights, tokens, n)
    want = np.zeros((n, hidden), np.float32)
    for e, t, w in zip(per_token, tokens, weights):
        gu, dn = experts[e]
        want[t] += w * expert_forward(gu, dn, scheme, xs[t], activation=activation,
                                      gate_up_bias=None if biases[0] is None else biases[0][e],
                                      down_bias=None if biases[1] is None else biases[1][e])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[5].any()


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="the float kernel is what runs here already")
def test_int4_float_kernel_where_there_is_no_vnni():
    """KTC_NO_VNNI=1 runs the 4-bit schemes through the float kernels, as on a CPU without VNNI."""
    env = dict(os.environ, KTC_NO_VNNI="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "(int4 or q4_0 or mxfp4 or q8_0 or int8) and not vnni and not without_jit"],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_no_vnni_kernels_for_another_compile_target():
    """With NUMBA_CPU_NAME naming a portable target, VNNI instructions could not be compiled:
    the float kernels are used."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic")
    env.pop("NUMBA_CPU_FEATURES", None)
    proc = subprocess.run([sys.executable, "-c", "from ktc.runtime import vnni; print(vnni.HAVE_VNNI)"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


@pytest.mark.slow  # 80-95 s here, most of it compiling the kernels again in a cache of their own
@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_q4_blocks_read_either_way(tmp_path):
    """q4_0's and iq4_nl's four blocks a step are read in two 64-byte loads and permutes or in
    four 16-byte loads, by the CPU (``vnni._q4_blocks_by_permute``): the way this CPU does not
    take, compiled apart (a Numba cache of its own), passes the same kernel tests."""
    selected = "(q4_0 or iq4_nl) and (block_vnni or batched_blocks or experts_token)"
    code = ("import sys, pytest\nfrom ktc.runtime import vnni\nvnni._Q4_PERMUTE = not vnni._Q4_PERMUTE\n"
            f"sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', {__file__!r}, '-k', {selected!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path)), cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("zen5", [True, False])
def test_one_token_rows_prefetch_non_temporally(zen5, monkeypatch):
    """A one-token row asks for its weights non-temporally (read once: they should not evict what a
    decode step reads again) and 8 KB ahead, the batched tiles' rows into L2 (read again for every
    pair of tokens) and 4 KB ahead: the instructions the compiled code holds (``vnni._ONCE``,
    ``vnni._AGAIN``, ``vnni._ahead``). The block kinds' one-token rows ask non-temporally on Zen 5
    only, elsewhere as the tiles do (``vnni._block_locality``); both rules compiled here, whatever
    this CPU is."""
    import re

    from numba import njit

    from ktc.runtime import kquants

    monkeypatch.setattr(vnni, "_NON_TEMPORAL_BLOCKS", zen5)

    @njit
    def row(flat, xq, lanes, e8m0):  # pragma: no cover - compiled
        return vnni._q4_0_row(flat, 0, 2, xq, lanes, 0, 16, e8m0)

    @njit
    def k_row(flat, yk, dk, bsum):  # pragma: no cover - compiled
        return kquants._q4_k_whole_row(flat, 0, 1, yk, 0, dk, bsum)

    @njit
    def tile(flat, xq, lanes, e8m0, out):  # pragma: no cover - compiled
        vnni._q4_0_tile(flat, 0, 144, 2, xq, 0, 256, lanes, 0, 16, 64, e8m0, out, 0, 4)

    flat, xq, lanes, e8m0 = (np.zeros(4096, np.uint8), np.zeros(1024, np.int8), np.zeros(1024, np.float32),
                             np.zeros(256, np.float32))
    row(flat, xq, lanes, e8m0)
    k_row(flat, np.zeros(256, np.int8), np.zeros(1, np.float32), np.zeros(16, np.int16))
    tile(flat, xq, lanes, e8m0, np.zeros(64, np.float32))
    block_row = ("prefetchnta", 8192) if zen5 else ("prefetcht2", 4096)
    for fn, (hint, ahead) in ((row, block_row), (k_row, ("prefetchnta", 8192)), (tile, ("prefetcht2", 4096))):
        asm = next(iter(fn.inspect_asm().values()))
        assert hint in asm
        assert ("prefetcht2" if hint == "prefetchnta" else "prefetchnta") not in asm
        # each line of a step asked for ``ahead`` bytes past the step (plus the line's place in it)
        distances = [int(d) for d in re.findall(hint + r"\s+(\d+)\(", asm)]
        assert distances and min(distances) == ahead, distances


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_one_token_q6_k_rows_ask_into_l2_where_long():
    """A one-token q6_k row asks for its weights non-temporally, 8 KB ahead, or into L2
    ``Q6_LONG_ROW_AHEAD`` bytes ahead where it has ``Q6_LONG_ROW_BLOCKS`` super-blocks or more
    (its activations crowd L1): the loop compiled for both (which one runs is the row's length's
    choice at run time)."""
    import re

    from numba import njit

    from ktc.runtime import kquants

    @njit
    def k6_row(flat, blocks, yk, dk, bsum):  # pragma: no cover - compiled
        return kquants._q6_k_whole_row(flat, 0, blocks, yk, blocks * 256, dk, bsum)

    k6_row(np.zeros(4096, np.uint8), 1, np.zeros(1024, np.int8), np.zeros(4, np.float32), np.zeros(64, np.int16))
    asm = next(iter(k6_row.inspect_asm().values()))
    for hint, ahead in (("prefetchnta", vnni._ONCE_PREFETCH_BYTES), ("prefetcht2", kquants.Q6_LONG_ROW_AHEAD)):
        distances = [int(d) for d in re.findall(hint + r"\s+(\d+)\(", asm)]
        assert distances and min(distances) == ahead, (hint, distances)


@pytest.mark.parametrize("row_bytes,rows,threads", [(1152, 151936, 2), (2304, 32000, 2), (1152, 512, 2),
                                                     (2304, 2048, 2), (1152, 4096, 4), (8064, 100, 2)])
def test_one_token_items_are_about_512_kb_and_enough_for_every_thread(row_bytes, rows, threads):
    """The one-token products' work items (``vnni.item_rows``): about ``ITEM_BYTES`` of rows, but at
    least 8 a thread where the matrix is smaller (one 512 KB item of a small matrix left one thread
    idle), and at least 16 rows."""
    size = vnni.item_rows(row_bytes, rows, threads)
    items = -(-rows // size)
    assert size >= 16
    assert size * row_bytes <= vnni.ITEM_BYTES or size == 16
    if rows * row_bytes < 8 * threads * vnni.ITEM_BYTES and rows >= 16 * 8 * threads:
        assert items >= 8 * threads
    if rows * row_bytes >= 8 * threads * vnni.ITEM_BYTES:
        assert size == max(16, vnni.ITEM_BYTES // row_bytes)
