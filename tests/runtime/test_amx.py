"""Prefill products through AMX (``runtime/amx.py``): the weights decoded to bf16 a chunk of rows
at a time, the tokens rounded to bf16, float32 sums. Run where the CPU has AMX (and Linux lets
the process use it); elsewhere only what needs no AMX."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from ktc.formats.float_bits import f32_to_bf16_bits
from ktc.formats.quantize import dequantize, quantize
from ktc.runtime import amx, lanes, vnni

needs_amx = pytest.mark.skipif(not amx.HAVE_AMX, reason="this CPU has no AMX (or Linux keeps it off, or the JIT is off)")


def _bf16(values: np.ndarray) -> np.ndarray:
    return (f32_to_bf16_bits(np.ascontiguousarray(values, dtype=np.float32)).astype(np.uint32) << 16).view(
        np.float32).reshape(values.shape)


def _case(scheme: str, rows: int, cols: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    from model_factory import random_blocks

    rng = np.random.default_rng(rows * cols + tokens)
    raw = (random_blocks(scheme, rows, cols, seed=cols) if scheme in ("iq4_nl", "iq4_xs")
           else quantize(rng.standard_normal((rows, cols)).astype(np.float32), scheme))
    return raw, rng.standard_normal((tokens, cols)).astype(np.float32) * rng.uniform(0.1, 10)


@needs_amx
@pytest.mark.parametrize("scheme", sorted(amx.KINDS))
@pytest.mark.parametrize("rows, cols, tokens", [(37, 256, 5), (64, 512, 32), (200, 768, 50), (16, 1024, 17),
                                              (96, 512, 40)])
def test_amx_products_are_the_bf16_products(scheme, rows, cols, tokens):
    """Every row (chunks of 32, the last one short) times every token (groups of 16 in pairs, the
    last padded, a last group of 16 or fewer alone; whole 16 x 16 tiles stored transposed, the
    rest one by one) is the weights' values rounded to bf16 times the tokens rounded to bf16,
    summed in float32 (up to the order of the sums)."""
    raw, x = _case(scheme, rows, cols, tokens)
    assert amx.fits(scheme, cols)
    want = _bf16(x).astype(np.float64) @ _bf16(dequantize(raw, scheme, cols)).astype(np.float64).T
    got = amx.matmul(x, raw, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.abs(want).max())
    exact = x.astype(np.float64) @ dequantize(raw, scheme, cols).astype(np.float64).T
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-2


@needs_amx
def test_linear_takes_amx_from_its_token_count(monkeypatch):
    """``linear`` sends a block scheme's products of ``AMX_MIN_TOKENS`` tokens or more to AMX and
    fewer to ``lanes``, and both agree within the activations' rounding."""
    from ktc.runtime import kernels

    taken = []
    for module in (amx, lanes):
        real = module.matmul
        monkeypatch.setattr(module, "matmul", lambda *args, real=real, name=module.__name__: taken.append(name)
                            or real(*args))
    least = kernels.AMX_MIN_TOKENS["q4_0"]
    raw, x = _case("q4_0", 48, 256, least)
    through_amx = kernels.linear(x, raw, "q4_0")
    through_lanes = kernels.linear(x[: least - 1], raw, "q4_0")
    assert taken == ["ktc.runtime.amx", "ktc.runtime.lanes"]
    np.testing.assert_allclose(through_amx[: least - 1], through_lanes, rtol=2e-2, atol=2e-2 * np.abs(through_lanes).max())


def _have_bf16() -> bool:
    import llvmlite.binding as llvm

    return vnni.HAVE_VNNI and bool(llvm.get_host_cpu_features().get("avx512bf16", False))


@njit
def _decoded_rows(raw, kind, e8m0, cols, halves, out):  # pragma: no cover - compiled
    # raw's rows decoded to bf16 as amx._matmul decodes a chunk's rows: one function for every
    # kind (one defined inside the test, its sizes constants, compiled again for each, 27 s).
    blocks = cols // 32
    w = np.zeros(cols, np.uint8)
    sc = np.zeros(blocks * halves, np.float32)
    mn = np.zeros(blocks * halves, np.float32)
    for r in range(raw.shape[0]):
        amx._decode_row(kind, raw, r, raw.reshape(-1), w, sc, mn, e8m0, blocks, np.float32(lanes._OFFSET[kind]), out,
                        r * cols)


@pytest.mark.skipif(not _have_bf16(), reason="this CPU has no AVX-512 VNNI and BF16 (or the JIT is off)")
@pytest.mark.parametrize("scheme", ["q4_k", "q5_k", "q6_k", "iq4_xs", "int4_g32", "int4_g64", "int4_g128"])
def test_rows_unpacked_by_the_lanes_decode_to_their_values_in_bf16(scheme, monkeypatch):
    """The kinds AMX decodes through ``lanes``' unpacking (codes, then each block's scale and
    minimum: int4's wider groups come from it a span at a time and are spread to their blocks)
    give their dequantized values rounded to bf16, row by row. The decoding needs AVX-512 BF16,
    not AMX: compiled here as on a CPU with AMX (its row intrinsic emits nothing elsewhere)."""
    monkeypatch.setattr(amx, "HAVE_AMX", True)
    cols = 512
    raw, _ = _case(scheme, 5, cols, 1)
    kind = amx.KINDS[scheme]
    out = np.zeros(raw.shape[0] * cols, np.uint16)
    _decoded_rows(raw, kind, vnni._tables()[1], cols, 2 if kind == lanes._HALVES else 1, out)
    got = (out.astype(np.uint32) << 16).view(np.float32).reshape(raw.shape[0], cols)
    want = dequantize(raw, scheme, cols)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())


def test_fp8_rows_decode_to_their_values_in_bf16():
    """fp8_e4m3 rows decoded for AMX (codes to float32 by their bits, times the block's scale,
    rounded to bf16): every one of the 254 finite codes, under block scales small and large,
    gives the bf16 of its value times the scale, as ``dequantize`` makes it."""
    if not amx.HAVE_AMX:
        pytest.skip("this CPU has no AMX (or Linux keeps it off, or the JIT is off)")
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # 0x7F, 0xFF: NaN
    rows = []
    for scale in (np.float32(1.0), np.float32(3.7e-5), np.float32(1234.5), np.float32(2.0 ** -30)):
        row = np.zeros(2 * 132, np.uint8)
        for b in range(2):
            block = np.resize(np.roll(codes, 128 * b), 128)
            row[132 * b: 132 * b + 4] = np.frombuffer(scale.tobytes(), np.uint8)
            row[132 * b + 4: 132 * (b + 1)] = block
        rows.append(row)
    raw = np.stack(rows)

    @njit
    def decoded(flat, rows, row_bytes, out):  # the intrinsic, called from compiled code as amx's rows are
        for r in range(rows):
            amx._blocks_fp8(flat, r * row_bytes, 2, out, r * 256)

    out = np.zeros(raw.shape[0] * 256, np.uint16)
    decoded(raw.reshape(-1), raw.shape[0], raw.shape[1], out)
    want = f32_to_bf16_bits(np.ascontiguousarray(dequantize(raw, "fp8_e4m3", 256), dtype=np.float32))
    np.testing.assert_array_equal(out.reshape(raw.shape[0], 256), want.reshape(raw.shape[0], 256))


@needs_amx
def test_linear_takes_amx_for_fp8_from_its_token_count(monkeypatch):
    """fp8_e4m3 products of ``AMX_MIN_TOKENS`` tokens or more go through AMX (where they decoded
    the whole matrix to bf16 for torch's GEMM from 16 tokens), fewer token by token through the
    one-token kernel; the two agree within the bf16 rounding of weights and tokens."""
    from ktc.runtime import kernels

    taken = []
    real = amx.matmul
    monkeypatch.setattr(amx, "matmul", lambda *args: taken.append(len(args[0])) or real(*args))
    least = kernels.AMX_MIN_TOKENS["fp8_e4m3"]
    raw, x = _case("fp8_e4m3", 70, 384, 40)
    through_amx = kernels.linear(x, raw, "fp8_e4m3")
    one_by_one = kernels.linear(x[: least - 1], raw, "fp8_e4m3")
    assert taken == [40]
    np.testing.assert_allclose(through_amx[: least - 1], one_by_one, rtol=2e-2, atol=2e-2 * np.abs(one_by_one).max())
    exact = x.astype(np.float64) @ dequantize(raw, "fp8_e4m3", 384).astype(np.float64).T
    assert np.linalg.norm(through_amx - exact) / np.linalg.norm(exact) < 1e-2


@needs_amx
@pytest.mark.parametrize("rows, cols, tokens", [(70, 256, 5), (64, 512, 33), (37, 1024, 40), (200, 768, 64),
                                               (70, 256, 161), (200, 768, 160)])
def test_amx_int8_products_are_torchs(rows, cols, tokens, monkeypatch):
    """ktc's int8 rows (codes, then a scale) multiplied where they are stored by ``tdpbssd`` (the
    last chunk's rows copied beside zeros), or copied first each on a 64-byte boundary (from
    ``ALIGNED_PAIRS`` pairs of token groups), give torch's int8 GEMM's products exactly: the same
    per-token quantization, exact int32 sums, the same scaling; ``linear`` takes them from
    ``AMX_INT8_MIN_TOKENS`` tokens."""
    import torch

    from ktc.runtime import kernels

    rng = np.random.default_rng(rows + tokens)
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), "int8")
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    scales = kernels.int8_row_scales(raw, cols)
    got = amx.int8_matmul(x, raw, scales)
    amax = np.abs(x).max(axis=1, keepdims=True)
    x_scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    xq = np.rint(x / x_scale).astype(np.int8)
    sums = torch._int_mm(torch.from_numpy(xq), torch.from_numpy(raw[:, :cols].view(np.int8)).t()).numpy()
    np.testing.assert_array_equal(got, sums.astype(np.float32) * x_scale * scales[None, :])
    default = amx.ALIGNED_PAIRS
    for pairs in (1, 10**6):  # every chunk's rows copied aligned first, or none: the same products
        monkeypatch.setattr(amx, "ALIGNED_PAIRS", pairs)
        np.testing.assert_array_equal(amx.int8_matmul(x, raw, scales), got)
    monkeypatch.setattr(amx, "ALIGNED_PAIRS", default)
    taken = []
    real = amx.int8_matmul
    monkeypatch.setattr(amx, "int8_matmul", lambda *args: taken.append(len(args[0])) or real(*args))
    for count in (kernels.AMX_INT8_MIN_TOKENS - 1, kernels.AMX_INT8_MIN_TOKENS, tokens):
        through_linear = kernels.linear(x[:count], raw, "int8")
        if count >= kernels.AMX_INT8_MIN_TOKENS:
            np.testing.assert_array_equal(through_linear, amx.int8_matmul(x[:count], raw, scales))
    assert taken == [count for count in (kernels.AMX_INT8_MIN_TOKENS, tokens)
                     if count >= kernels.AMX_INT8_MIN_TOKENS for _ in (0, 1)]


def test_tile_configuration():
    """Palette 1, eight tiles of 16 rows of 64 bytes (the layout ``ldtilecfg`` reads)."""
    cfg = amx.tile_config()
    assert cfg.nbytes == 64 and cfg[0] == 1 and not cfg[1:16].any()
    assert (cfg[16:32].view(np.uint16) == 64).all() and (cfg[48:56] == 16).all() and not cfg[56:].any()


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_amx_can_be_turned_off():
    """``KTC_NO_AMX=1`` keeps the AMX path off (the VNNI products run instead)."""
    env = dict(os.environ, KTC_NO_AMX="1")
    out = subprocess.run([sys.executable, "-c", "from ktc.runtime import amx; print(amx.HAVE_AMX)"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
