"""Numba CPU kernels for experts stored in the bundle's schemes.

Each scheme has a matrix-vector kernel over its raw rows (``[rows, row_bytes]`` bytes, the
layouts of ``docs/bundle-format.md``): one token through one weight matrix, reading every weight
byte once, which is what bounds decode speed. ``expert_forward`` chains them into an expert's
``down(act(gate x) * up x)``; ``expert_forward_batch`` decodes the expert once and multiplies a
batch of tokens routed to it. Kernels release the GIL so the CPU experts of a layer can run in a
thread while torch runs the GPU experts.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
# e2m1 code -> value, and e8m0 exponent byte -> 2^(e - 127) (OCP Microscaling v1.0).
_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
with np.errstate(over="ignore"):
    _E8M0 = np.ldexp(np.float32(1.0), np.arange(256) - 127).astype(np.float32)
_E8M0[255] = np.nan  # 0xFF encodes NaN

_OPTS = dict(cache=True, nogil=True, parallel=True, fastmath=True)


@njit(**_OPTS)
def _matvec_f32(w, x, out):  # pragma: no cover - compiled
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        for j in range(x.shape[0]):
            acc += w[r, j] * x[j]
        out[r] = acc


@njit(**_OPTS)
def _matvec_bf16(w, x, out):  # pragma: no cover - compiled
    # w: uint16 bit patterns [rows, cols]; a bf16 is the top half of a float32.
    cols = x.shape[0]
    for r in prange(w.shape[0]):
        widened = np.empty(cols, dtype=np.uint32)
        for j in range(cols):
            widened[j] = np.uint32(w[r, j]) << np.uint32(16)
        values = widened.view(np.float32)
        acc = np.float32(0.0)
        for j in range(cols):
            acc += values[j] * x[j]
        out[r] = acc


@njit(**_OPTS)
def _matvec_f16(w, x, table, out):  # pragma: no cover - compiled
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        for j in range(x.shape[0]):
            acc += table[w[r, j]] * x[j]
        out[r] = acc


@njit(**_OPTS)
def _matvec_int8(codes, scales, x, out):  # pragma: no cover - compiled
    # codes: int8 [rows, cols] (a view of the row bytes), scales: float32 [rows]
    cols = x.shape[0]
    for r in prange(codes.shape[0]):
        acc = np.float32(0.0)
        for j in range(cols):
            acc += np.float32(codes[r, j]) * x[j]
        out[r] = acc * scales[r]


@njit(**_OPTS)
def _matvec_q8_0(raw, x, table, out):  # pragma: no cover - compiled
    # raw: uint8 [rows, cols / 32 * 34]; block = float16 d, 32 int8
    blocks = x.shape[0] // 32
    for r in prange(raw.shape[0]):
        acc = np.float32(0.0)
        for b in range(blocks):
            base = b * 34
            d = table[np.uint16(raw[r, base]) | (np.uint16(raw[r, base + 1]) << np.uint16(8))]
            s = np.float32(0.0)
            for j in range(32):
                s += np.float32(np.int8(raw[r, base + 2 + j])) * x[b * 32 + j]
            acc += d * s
        out[r] = acc


@njit(**_OPTS)
def _matvec_q4_0(raw, x, table, out):  # pragma: no cover - compiled
    # block = float16 d, 16 bytes: value j low nibble, j + 16 high nibble; value = (q - 8) d
    blocks = x.shape[0] // 32
    for r in prange(raw.shape[0]):
        acc = np.float32(0.0)
        for b in range(blocks):
            base = b * 18
            d = table[np.uint16(raw[r, base]) | (np.uint16(raw[r, base + 1]) << np.uint16(8))]
            s = np.float32(0.0)
            xb = b * 32
            for j in range(16):
                q = raw[r, base + 2 + j]
                s += np.float32(np.int32(q & 15) - 8) * x[xb + j] + np.float32(np.int32(q >> 4) - 8) * x[xb + 16 + j]
            acc += d * s
        out[r] = acc


@njit(**_OPTS)
def _matvec_mxfp4(raw, x, fp4, e8m0, out):  # pragma: no cover - compiled
    # block = e8m0 exponent byte, 16 bytes of e2m1 codes (j low nibble, j + 16 high)
    blocks = x.shape[0] // 32
    for r in prange(raw.shape[0]):
        acc = np.float32(0.0)
        for b in range(blocks):
            base = b * 17
            s = np.float32(0.0)
            xb = b * 32
            for j in range(16):
                q = raw[r, base + 1 + j]
                s += fp4[q & 15] * x[xb + j] + fp4[q >> 4] * x[xb + 16 + j]
            acc += e8m0[raw[r, base]] * s
        out[r] = acc


@njit(**_OPTS)
def _matvec_int4(codes, scales, x, group, out):  # pragma: no cover - compiled
    # codes: uint8 [rows, cols / 2] (runs of 32: j low nibble, j + 16 high, stored as q + 8)
    # scales: float32 [rows, cols / group]
    cols = x.shape[0]
    for r in prange(codes.shape[0]):
        acc = np.float32(0.0)
        for g in range(cols // group):
            s = np.float32(0.0)
            for sub in range(group // 32):
                xb = g * group + sub * 32
                cb = xb // 2
                for j in range(16):
                    q = codes[r, cb + j]
                    s += np.float32(np.int32(q & 15) - 8) * x[xb + j] + np.float32(np.int32(q >> 4) - 8) * x[xb + 16 + j]
            acc += s * scales[r, g]
        out[r] = acc


def matvec(raw: np.ndarray, scheme: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``W @ x`` for a weight stored in ``scheme`` as raw rows ``[rows, row_bytes]`` (uint8; or
    the plain dtype for f32/f16/bf16), ``x`` float32 of the row length. Returns float32 [rows]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    cols = x.shape[0]
    rows = raw.shape[0]
    out = np.empty(rows, dtype=np.float32) if out is None else out
    if scheme == "f32":
        _matvec_f32(raw.view(np.float32).reshape(rows, cols), x, out)
    elif scheme == "bf16":
        _matvec_bf16(raw.view(np.uint16).reshape(rows, cols), x, out)
    elif scheme == "f16":
        _matvec_f16(raw.view(np.uint16).reshape(rows, cols), x, _F16_TO_F32, out)
    elif scheme == "int8":
        codes = raw[:, :cols].view(np.int8)
        scales = np.ascontiguousarray(raw[:, cols:cols + 4]).view(np.float32).reshape(rows)
        _matvec_int8(codes, scales, x, out)
    elif scheme == "q8_0":
        _matvec_q8_0(raw, x, _F16_TO_F32, out)
    elif scheme == "q4_0":
        _matvec_q4_0(raw, x, _F16_TO_F32, out)
    elif scheme == "mxfp4":
        _matvec_mxfp4(raw, x, _FP4, _E8M0, out)
    elif scheme.startswith("int4_g"):
        group = int(scheme[len("int4_g"):])
        codes = raw[:, : cols // 2]
        scales = np.ascontiguousarray(raw[:, cols // 2:]).view(np.float32).reshape(rows, cols // group)
        _matvec_int4(codes, scales, x, group, out)
    else:
        raise ValueError(f"no CPU kernel for scheme {scheme!r}")
    return out


def _act(h: np.ndarray, inter: int, activation: str, limit: float | None, alpha: float | None) -> np.ndarray:
    gate, up = h[..., :inter], h[..., inter:]
    if activation == "swiglu_clamped":  # gpt-oss
        lim = np.float32(limit if limit is not None else 7.0)
        a = np.float32(alpha if alpha is not None else 1.702)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
        return (up + 1) * (gate / (1 + np.exp(-a * gate)))
    return gate / (1 + np.exp(-gate)) * up  # SiLU(gate) * up


def expert_forward(gate_up: np.ndarray, down: np.ndarray, scheme: str, x: np.ndarray, *,
                   activation: str = "silu", gate_up_bias: np.ndarray | None = None,
                   down_bias: np.ndarray | None = None, limit: float | None = None,
                   alpha: float | None = None) -> np.ndarray:
    """One token through one expert: ``down(act(gate x + b) * (up x + b)) + b`` (float32 [hidden])."""
    inter = gate_up.shape[0] // 2
    h = matvec(gate_up, scheme, x)
    if gate_up_bias is not None:
        h += gate_up_bias
    a = _act(h, inter, activation, limit, alpha).astype(np.float32)
    y = matvec(down, scheme, a)
    if down_bias is not None:
        y += down_bias
    return y


def expert_forward_batch(gate_up: np.ndarray, down: np.ndarray, scheme: str, x: np.ndarray, *,
                         activation: str = "silu", gate_up_bias: np.ndarray | None = None,
                         down_bias: np.ndarray | None = None, limit: float | None = None,
                         alpha: float | None = None) -> np.ndarray:
    """Tokens ``x`` [T, hidden] routed to one expert: the weights are decoded once and multiplied
    as matrices (compute-bound, unlike one token)."""
    hidden = x.shape[1]
    inter = gate_up.shape[0] // 2
    h = np.asarray(x, dtype=np.float32) @ _decode(gate_up, scheme, hidden).T
    if gate_up_bias is not None:
        h += gate_up_bias
    a = _act(h, inter, activation, limit, alpha).astype(np.float32)
    y = a @ _decode(down, scheme, inter).T
    if down_bias is not None:
        y += down_bias
    return y


def _decode(raw: np.ndarray, scheme: str, cols: int) -> np.ndarray:
    from ktc.formats.quantize import dequantize

    if scheme == "f32":
        return raw.view(np.float32).reshape(raw.shape[0], cols)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)
    return dequantize(raw, scheme, cols)
