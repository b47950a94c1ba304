"""The Triton kernels of ``triton_experts`` (a module of their own: Triton resolves the helpers a
kernel calls among its module's globals, and importing it needs Triton)."""

import triton
import triton.language as tl


@triton.jit
def _u16(w, at, mask):
    # the little-endian 16-bit words at byte offsets ``at``, as uint32
    low = tl.load(w + at, mask=mask, other=0).to(tl.uint32)
    return low | (tl.load(w + at + 1, mask=mask, other=0).to(tl.uint32) << 8)


@triton.jit
def _f16(w, at, mask):
    # the float16s at byte offsets ``at``, as float32
    return _u16(w, at, mask).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bf16(w, at, mask):
    # the bfloat16s at byte offsets ``at``, as float32
    return (_u16(w, at, mask) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    # the FP4 e2m1 value of 4-bit codes: sign, two exponent bits, one mantissa bit
    v = code & 7
    mant = (v & 1).to(tl.float32)
    e = (v >> 1).to(tl.float32)
    mag = tl.where(v < 2, mant * 0.5, (1.0 + mant * 0.5) * tl.exp2(e - 1.0))
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND: tl.constexpr, BB: tl.constexpr, HEAD: tl.constexpr,
                CODES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr):
    # _rows_dot of ggml's blocks of 32 values: BB bytes each, HEAD of them its scale, then
    # CODES bytes of codes; BLOCKS blocks of each row a step
    b = tl.arange(0, BLOCKS)
    j = tl.arange(0, CODES)
    nblocks = cols // 32
    part = tl.zeros((BLOCK_R, BLOCKS), dtype=tl.float32)
    for start in range(0, nblocks, BLOCKS):
        bb = start + b
        inside = bb < nblocks
        bmask = rmask[:, None] & inside[None, :]
        base = rows[:, None] * row_bytes + bb[None, :] * BB  # [R, B]: each block's first byte
        if KIND == 6:
            scale = tl.exp2(tl.load(w + base, mask=bmask, other=127).to(tl.float32) - 127.0)
        else:
            scale = _f16(w, base, bmask)
        codes = tl.load(w + base[:, :, None] + HEAD + j[None, None, :], mask=bmask[:, :, None], other=0)
        xat = bb[:, None] * 32 + j[None, :]  # [B, CODES]: the values' places in x
        if KIND == 4:
            v = codes.to(tl.int8, bitcast=True).to(tl.float32)
            xv = tl.load(x + xat, mask=inside[:, None], other=0.0)
            dot = tl.sum(v * xv[None, :, :], axis=2)
        else:
            lo = codes & 15
            hi = codes >> 4
            if KIND == 5:
                vlo = lo.to(tl.float32) - 8.0
                vhi = hi.to(tl.float32) - 8.0
            else:
                vlo = _e2m1(lo)
                vhi = _e2m1(hi)
            xlo = tl.load(x + xat, mask=inside[:, None], other=0.0)
            xhi = tl.load(x + xat + 16, mask=inside[:, None], other=0.0)
            dot = tl.sum(vlo * xlo[None, :, :] + vhi * xhi[None, :, :], axis=2)
        part += dot * scale
    return tl.sum(part, axis=1)


@triton.jit
def _rows_dot(w, rows, rmask, row_bytes, x, cols, KIND: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_K: tl.constexpr):
    # [BLOCK_R] dot products of rows ``rows`` of the matrix at w (row_bytes a row: its values
    # for the plain kinds) with x [cols] (float32)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if KIND <= 2:  # f32, f16, bf16: values
        k = tl.arange(0, BLOCK_K)
        for start in range(0, cols, BLOCK_K):
            kk = start + k
            kmask = kk < cols
            v = tl.load(w + rows[:, None] * row_bytes + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            xv = tl.load(x + kk, mask=kmask, other=0.0)
            acc += tl.sum(v * xv[None, :], axis=1)
    elif KIND == 3:  # int8: the row's codes, then its float32 scale
        k = tl.arange(0, BLOCK_K)
        for start in range(0, cols, BLOCK_K):
            kk = start + k
            kmask = kk < cols
            c = tl.load(w + rows[:, None] * row_bytes + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0).to(tl.int8, bitcast=True).to(tl.float32)
            xv = tl.load(x + kk, mask=kmask, other=0.0)
            acc += tl.sum(c * xv[None, :], axis=1)
        at = rows * row_bytes + cols
        acc = acc * (_u16(w, at, rmask) | (_u16(w, at + 2, rmask) << 16)).to(tl.float32, bitcast=True)
    elif KIND == 4:  # q8_0: fp16 scale, 32 int8
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 34, 2, 32, BLOCK_R, BLOCK_K // 32)
    elif KIND == 5:  # q4_0: fp16 scale, 16 bytes of nibbles (the low ones values 0-15, the high 16-31)
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 18, 2, 16, BLOCK_R, BLOCK_K // 32)
    elif KIND == 6:  # mxfp4: e8m0 scale, the same nibbles
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 17, 1, 16, BLOCK_R, BLOCK_K // 32)
    else:  # the K-quants and int4: 256 values a step, each value's bytes found from its place
        acc = _wide_dot(w, rows, rmask, row_bytes, x, cols, KIND, BLOCK_R)
    return acc


@triton.jit
def _wide_dot(w, rows, rmask, row_bytes, x, cols, KIND: tl.constexpr, BLOCK_R: tl.constexpr):
    # _rows_dot of q4_k (7), q5_k (8), q6_k (9: ggml's super-blocks of 256 values, their byte
    # layouts as ggml's dequantize_row_q*_K reads them) and int4 g32, g64, g128 (10-12: a row's
    # codes, two a byte, a group's low nibbles its first half; then bf16 scales and minimums a
    # group: value = code * scale + minimum); 256 values a step
    v = tl.arange(0, 256)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    row = rows[:, None] * row_bytes
    for start in range(0, cols, 256):
        col = start + v
        inside = col < cols
        m = rmask[:, None] & inside[None, :]
        if KIND == 7:
            value = _k4_values(w, row + (start // 256) * 144, v, m, rmask, 16, False)
        elif KIND == 8:
            value = _k4_values(w, row + (start // 256) * 176, v, m, rmask, 48, True)
        elif KIND == 9:
            value = _q6_k_values(w, row + (start // 256) * 210, v, m, rmask)
        elif KIND == 10:
            value = _int4_values(w, row, col, m, cols, 32)
        elif KIND == 11:
            value = _int4_values(w, row, col, m, cols, 64)
        else:
            value = _int4_values(w, row, col, m, cols, 128)
        xv = tl.load(x + col, mask=inside, other=0.0)
        acc += tl.sum(tl.where(m, value, 0.0) * xv[None, :], axis=1)
    return acc


@triton.jit
def _int4_values(w, row, col, m, cols, G: tl.constexpr):
    # [R, 256] values at columns ``col`` of int4 rows with groups of G
    g = col // G
    within = col % G
    b = tl.load(w + row + (g * (G // 2) + within % (G // 2))[None, :], mask=m, other=0)
    code = ((b >> (4 * (within // (G // 2))).to(tl.uint8)[None, :]) & 15).to(tl.float32)
    groups = cols // G
    scale = _bf16(w, row + (cols // 2 + 2 * g)[None, :], m)
    return code * scale + _bf16(w, row + (cols // 2 + 2 * (groups + g))[None, :], m)


@triton.jit
def _q6_k_values(w, base, v, m, rmask):
    # [R, 256] values of the q6_k super-blocks at byte ``base`` [R, 1]: ql[128], qh[64], int8
    # scales[16], fp16 d; value v = 128 n + 32 q + lane
    n = v // 128
    q = (v // 32) % 4
    lane = v % 32
    ql = tl.load(w + base + (n * 64 + lane + 32 * (q % 2))[None, :], mask=m, other=0)
    qh = tl.load(w + base + (128 + n * 32 + lane)[None, :], mask=m, other=0)
    low4 = (ql >> (4 * (q // 2)).to(tl.uint8)[None, :]) & 15
    high2 = (qh >> (2 * q).to(tl.uint8)[None, :]) & 3
    code = (low4 | (high2 << 4)).to(tl.float32) - 32.0
    sc = tl.load(w + base + (192 + n * 8 + lane // 16 + 2 * q)[None, :], mask=m, other=0)
    return _f16(w, base + 208, rmask[:, None]) * sc.to(tl.int8, bitcast=True).to(tl.float32) * code


@triton.jit
def _k4_values(w, base, v, m, rmask, QS: tl.constexpr, HIGH: tl.constexpr):
    # [R, 256] values of q4_k (QS 16) or q5_k (QS 48, HIGH: a fifth bit a value from qh[32] at
    # byte 16) super-blocks at byte ``base`` [R, 1]: fp16 d and dmin, 12 bytes of 6-bit scales
    # and minimums (8 of each), then the nibbles; value v = 32 sub + lane
    sub = v // 32
    lane = v % 32
    qs = tl.load(w + base + (QS + (sub // 2) * 32 + lane)[None, :], mask=m, other=0)
    code = (qs >> (4 * (sub % 2)).to(tl.uint8)[None, :]) & 15
    if HIGH:
        qh = tl.load(w + base + (16 + lane)[None, :], mask=m, other=0)
        code = code | (((qh >> sub.to(tl.uint8)[None, :]) & 1) << 4)
    # get_scale_min_k4: sub j < 4: s[j] & 63, s[j + 4] & 63; else
    # (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, (s[j + 4] >> 4) | (s[j] >> 6) << 4
    first = sub < 4
    s_j = tl.load(w + base + (4 + sub)[None, :], mask=m, other=0).to(tl.int32)
    s_j4 = tl.load(w + base + (8 + sub)[None, :], mask=m, other=0).to(tl.int32)
    s_jm4 = tl.load(w + base + (4 + tl.where(first, 0, sub - 4))[None, :], mask=m, other=0).to(tl.int32)
    sc = tl.where(first[None, :], s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4)).to(tl.float32)
    mn = tl.where(first[None, :], s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4)).to(tl.float32)
    return _f16(w, base, rmask[:, None]) * sc * code.to(tl.float32) - _f16(w, base + 2, rmask[:, None]) * mn


@triton.jit
def gate_up(w, index, x, a, bias, cols, inter, row_bytes, expert_size, limit, alpha, KIND: tl.constexpr,
            CLAMPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (i, r): rows r * BLOCK_R.. of the gate and the up matrices of expert index[i],
    # their activation into a[i]
    i = tl.program_id(0)
    e = tl.load(index + i).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < inter
    we = w + e * expert_size
    g = _rows_dot(we, rows, rmask, row_bytes, x, cols, KIND, BLOCK_R, BLOCK_K)
    u = _rows_dot(we, rows + inter, rmask, row_bytes, x, cols, KIND, BLOCK_R, BLOCK_K)
    if HAS_BIAS:
        g += tl.load(bias + e * 2 * inter + rows, mask=rmask, other=0.0)
        u += tl.load(bias + e * 2 * inter + inter + rows, mask=rmask, other=0.0)
    if CLAMPED:  # gpt-oss: clamp(gate, max=limit) * sigmoid(alpha * gate) * (clamp(up, +-limit) + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        act = g * tl.sigmoid(alpha * g) * u
    else:
        act = g * tl.sigmoid(g) * u
    tl.store(a + i * inter + rows, act, mask=rmask)


@triton.jit(do_not_specialize=["n"])  # one build for any number of experts (Triton would make n == 1 its own)
def down(w, index, weights, a, out, bias, n, hidden, inter, row_bytes, expert_size, KIND: tl.constexpr,
         HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program r: rows r * BLOCK_R.. of out += sum over i, in order, of weights[i] * (down
    # rows of expert index[i] times a[i], plus its bias)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < hidden
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(n):
        e = tl.load(index + i).to(tl.int64)
        y = _rows_dot(w + e * expert_size, rows, rmask, row_bytes, a + i * inter, inter, KIND, BLOCK_R, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(bias + e * hidden + rows, mask=rmask, other=0.0)
        total += tl.load(weights + i) * y
    prior = tl.load(out + rows, mask=rmask, other=0.0)
    tl.store(out + rows, prior + total, mask=rmask)

