"""q4_0, q8_0, mxfp4 and q4_k rows interleaved 16 at a time (``runtime.interleave``): the copy
is the same bytes reordered (q8_0's codes plus 128), and its products equal the definition
(each block's code values times the activations quantized per 32, scaled by the block's scale
and dx; q4_k's dequantized weights times the activations quantized per 256), for one token and
several."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from ktc.formats.quantize import quantize
from ktc.runtime import interleave, vnni

needs_vnni = pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
SHAPES = [(16, 128), (48, 256), (64, 2048), (160, 768), (32, 4096)]
SCHEMES = pytest.mark.parametrize("scheme", interleave.BLOCK_SCHEMES)
K_SHAPES = [(16, 256), (48, 512), (64, 2048), (160, 768), (32, 4096)]


def _case(rows: int, cols: int, seed: int, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2)
    x = rng.standard_normal(cols).astype(np.float32) * rng.uniform(0.1, 10)
    return quantize(w, scheme), x


def _definition(raw: np.ndarray, x: np.ndarray, scheme: str, per: int = 32) -> np.ndarray:
    """Float64: sum over blocks of d * dx * sum(value * xq), from the row-major bytes (q4_0's
    codes less 8, q8_0's signed, mxfp4's e2m1 values and 2^(e - 127)), the activations quantized
    per ``per`` values."""
    rows, row_bytes = raw.shape
    cols = x.shape[0]
    blocks = cols // 32
    lay = interleave.LAYOUTS[scheme]
    b = raw.reshape(rows, blocks, lay.block)
    codes_at = lay.scale_bytes
    if lay.nibbles:
        codes = np.concatenate([b[..., codes_at:] & 15, b[..., codes_at:] >> 4], axis=2)
    if scheme == "q4_0":
        codes = codes.astype(np.float64) - 8
        scale = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    elif scheme == "mxfp4":
        codes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
        scale = np.ldexp(1.0, b[..., 0].astype(np.int64) - 127)
    else:
        codes = b[..., 2:].copy().view(np.int8).astype(np.float64)
        scale = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    xq, dx, _ = vnni.quantize_activations(x, per)
    dots = (codes * xq.reshape(blocks, 32).astype(np.float64)).sum(axis=2)
    return (scale * np.repeat(dx, per // 32) * dots).sum(axis=1)


@SCHEMES
@pytest.mark.parametrize("shape", SHAPES)
def test_repack_is_the_same_bytes_reordered_and_unpack_undoes_it(shape, scheme):
    raw, _ = _case(*shape, seed=shape[1], scheme=scheme)
    lay = interleave.LAYOUTS[scheme]
    size, at = lay.scale_bytes, lay.scale_bytes  # a block's scale bytes; its codes' start
    packed = interleave.repack(raw, scheme, rows_at_once=32)  # several pieces where there are more rows
    assert packed.shape == raw.shape and packed.ctypes.data % 64 == 0
    stored = raw.copy()  # the bytes the copy holds: q8_0's codes plus 128
    if scheme == "q8_0":
        stored.reshape(shape[0], -1, lay.block)[..., at:] ^= 128
    np.testing.assert_array_equal(np.sort(packed.reshape(-1)), np.sort(stored.reshape(-1)))
    np.testing.assert_array_equal(interleave.unpack(packed, scheme), raw)
    # the first unit of the first group: row r's scale of block j at bytes (16 j + r) * size;
    # line k of block j's codes holds bytes 4k..4k+3 of each row's codes
    unit = packed.reshape(-1)[:interleave.GROUP * lay.unit * lay.block]
    b = stored[:16].reshape(16, -1, lay.block)
    lines = (lay.block - size) // 4
    for j in range(lay.unit):
        np.testing.assert_array_equal(unit[16 * j * size:16 * (j + 1) * size].reshape(16, size), b[:, j, :size])
        for k in (0, 1, lines - 1):
            line = 64 + 64 * (lines * j + k)
            np.testing.assert_array_equal(unit[line:line + 64].reshape(16, 4), b[:, j, at + 4 * k:at + 4 * k + 4])


@pytest.mark.parametrize("scheme, rows, cols", [(scheme, rows, cols) for scheme in interleave.BLOCK_SCHEMES
                                                 for rows, cols in [(15, 128), (8, 96)]]
                         + [("q4_k", 15, 256), ("q4_k", 8, 512)])
def test_what_cannot_be_interleaved_is_refused(scheme, rows, cols):
    raw, x = _case(rows, cols, seed=1, scheme=scheme)
    assert not interleave.fits(rows, cols, scheme) and not interleave.fits(rows, cols, scheme, tail=True)
    with pytest.raises(ValueError, match="cannot be interleaved"):
        interleave.repack(raw, scheme)
    with pytest.raises(ValueError, match="rows are interleaved, not q4_1"):
        interleave.repack(raw, "q4_1")
    good, _ = _case(16, 256 if scheme == "q4_k" else 128, seed=1, scheme=scheme)
    with pytest.raises(ValueError, match="does not multiply 512 values"):
        interleave.matvec(interleave.repack(good, scheme), scheme, np.zeros(512, np.float32))


@needs_vnni
@SCHEMES
@pytest.mark.parametrize("shape", [(16, 32), (32, 96), (48, 160), (32, 2880)])
def test_rows_whose_last_unit_is_not_full_take_a_tail(shape, scheme):
    """Rows of whole blocks that do not fill whole units (gpt-oss's 2880 values are 22.5 units of
    mxfp4's 128; q4_0's and q8_0's units are 64): ``fits`` only with ``tail``; the copy fills the
    last unit out with zero bytes (``copy_row_bytes`` a row) and ``unpack`` gives the rows back;
    one token, several (tiles and single tokens) and the groups' products equal the definition,
    reading only the blocks a row has."""
    rows, cols = shape
    raw, x = _case(rows, cols, seed=cols, scheme=scheme)
    lay = interleave.LAYOUTS[scheme]
    tail = cols // 32 % lay.unit
    assert interleave.fits(rows, cols, scheme) == (tail == 0) and interleave.fits(rows, cols, scheme, tail=True)
    packed = interleave.repack(raw, scheme)
    width = -(-(cols // 32) // lay.unit) * lay.unit * lay.block
    assert packed.shape == (rows, width) == (rows, interleave.copy_row_bytes(scheme, raw.shape[1]))
    np.testing.assert_array_equal(interleave.unpack(packed, scheme, raw.shape[1]), raw)
    assert not interleave.unpack(packed, scheme)[:, raw.shape[1]:].any()  # the filled-out blocks: zero bytes
    want = _definition(raw, x, scheme)
    np.testing.assert_allclose(interleave.matvec(packed, scheme, x), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    xs = np.random.default_rng(rows).standard_normal((9, cols)).astype(np.float32)
    many = np.stack([_definition(raw, row, scheme) for row in xs])
    np.testing.assert_allclose(interleave.matmul(xs, packed, scheme), many, rtol=1e-5, atol=1e-5 * np.abs(many).max())
    # two experts' copies one after another, three and six tokens each (groups_product)
    flat = np.concatenate([packed.reshape(-1), packed.reshape(-1)])
    out = np.empty((9, rows), np.float32)
    interleave.groups_product(interleave.SCHEMES.index(scheme), flat, np.array([0, packed.nbytes], np.int64),
                              width, xs, np.array([0, 3, 9], np.int64), out)
    np.testing.assert_allclose(out, many, rtol=1e-5, atol=1e-5 * np.abs(many).max())


@needs_vnni
@SCHEMES
@pytest.mark.parametrize("shape", SHAPES)
def test_one_token_matches_the_definition_and_the_row_major_kernel(shape, scheme):
    from ktc.runtime.kernels import matvec

    raw, x = _case(*shape, seed=shape[0] + shape[1], scheme=scheme)
    want = _definition(raw, x, scheme)
    got = interleave.matvec(interleave.repack(raw, scheme), scheme, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got, matvec(raw, scheme, x), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_vnni
@SCHEMES
@pytest.mark.parametrize("tokens", [2, 7, 8, 9, 13, 21])
@pytest.mark.parametrize("shape", [(64, 256), (80, 2048), (32, 384)])
def test_several_tokens_equal_the_definition(shape, tokens, scheme):
    """Tiles of several tokens and groups, and the groups and tokens past them one at a time (80
    rows: five groups; 9, 13 and 21 tokens); from PER_256_MIN_TOKENS tokens on where the rows are
    whole 256s the activations per 256, and each token within their rounding of what it alone
    gives (per 32); else each token what it gives alone."""
    raw, _ = _case(*shape, seed=tokens, scheme=scheme)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, shape[1])).astype(np.float32)
    packed = interleave.repack(raw, scheme)
    got = interleave.matmul(x, packed, scheme)
    per_256 = tokens >= interleave.PER_256_MIN_TOKENS[scheme] and shape[1] % 256 == 0
    want = np.stack([_definition(raw, row, scheme, 256 if per_256 else 32) for row in x])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    alone = np.stack([interleave.matvec(packed, scheme, row) for row in x])
    if per_256:
        assert 1e-6 < np.linalg.norm(got - alone) / np.linalg.norm(alone) < 3e-2
    else:
        np.testing.assert_allclose(got, alone, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_the_products_of_many_tokens_quantize_as_the_stored_layout_s():
    from ktc.runtime.kernels import LANES_MIN_TOKENS

    assert {s: LANES_MIN_TOKENS[s] for s in interleave.BLOCK_SCHEMES} == interleave.PER_256_MIN_TOKENS
    assert interleave.K_LANES_MIN_TOKENS == LANES_MIN_TOKENS["q4_k"]


def _k_definition(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Float64: q4_k's dequantized weights (the reference decoder) times the activations
    quantized per 256 (their int8 values times their scale)."""
    from ktc.formats.quantize import dequantize

    w = dequantize(raw, "q4_k", x.shape[0]).astype(np.float64)
    xq, dx, _ = vnni.quantize_activations(x, 256)
    return w @ (xq.astype(np.float64) * np.repeat(dx, 256))


@pytest.mark.parametrize("shape", K_SHAPES)
def test_q4_k_repack_puts_each_super_block_s_16_rows_word_by_word(shape):
    """Line w of a group's super-block holds four-byte word w of each of its 16 rows' 144 bytes
    (d and dmin, three words of scales, 32 of codes); unpack undoes it."""
    raw, _ = _case(*shape, seed=shape[1], scheme="q4_k")
    packed = interleave.repack(raw, "q4_k", rows_at_once=32)
    assert packed.shape == raw.shape and packed.ctypes.data % 64 == 0
    np.testing.assert_array_equal(np.sort(packed.reshape(-1)), np.sort(raw.reshape(-1)))
    np.testing.assert_array_equal(interleave.unpack(packed, "q4_k"), raw)
    blocks = shape[1] // 256
    flat = packed.reshape(-1)
    for g in {0, shape[0] // 16 - 1}:
        for i in {0, blocks - 1}:
            at = (g * blocks + i) * 16 * 144
            for w in (0, 1, 3, 4, 35):
                want = raw[16 * g:16 * g + 16, 144 * i + 4 * w:144 * i + 4 * w + 4]
                np.testing.assert_array_equal(flat[at + 64 * w:at + 64 * w + 64].reshape(16, 4), want)


@needs_vnni
@pytest.mark.parametrize("shape", K_SHAPES)
def test_q4_k_one_token_matches_the_definition_and_the_row_major_kernel(shape):
    from ktc.runtime.kernels import matvec

    raw, x = _case(*shape, seed=shape[0] + shape[1], scheme="q4_k")
    want = _k_definition(raw, x)
    got = interleave.matvec(interleave.repack(raw, "q4_k"), "q4_k", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got, matvec(raw, "q4_k", x), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_vnni
@pytest.mark.parametrize("tokens", [2, 3, 7, 9, 13, 40])
@pytest.mark.parametrize("shape", [(64, 256), (80, 2048), (48, 768)])
def test_q4_k_several_tokens_equal_the_definition_and_each_token_alone(shape, tokens):
    """Tiles of K_TILE_TOKENS tokens by K_TILE_GROUPS groups, and the groups and tokens past them
    (80 and 48 rows: five and three groups) one at a time; from K_LANES_MIN_TOKENS tokens on
    (``kernels.interleaved_linear``) the stored layout's lanes over the rows put back a chunk at a
    time, which give exactly what they give the stored rows: each token what the definition
    gives, and what it gives alone (the same activations per 256)."""
    from ktc.runtime import lanes
    from ktc.runtime.kernels import interleaved_linear

    raw, _ = _case(*shape, seed=tokens, scheme="q4_k")
    x = np.random.default_rng(tokens).standard_normal((tokens, shape[1])).astype(np.float32)
    packed = interleave.repack(raw, "q4_k")
    got = interleaved_linear(x, packed, "q4_k")
    want = np.stack([_k_definition(raw, row) for row in x])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    alone = np.stack([interleave.matvec(packed, "q4_k", row) for row in x])
    np.testing.assert_allclose(got, alone, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if tokens >= interleave.K_LANES_MIN_TOKENS:
        np.testing.assert_array_equal(got, lanes.matmul(x, raw, "q4_k"))


@needs_vnni
@pytest.mark.parametrize("scheme", interleave.SCHEMES)
@pytest.mark.parametrize("shape", [(80, 512), (48, 768)])
def test_the_groups_product_gives_each_expert_what_matmul_gives_it(shape, scheme):
    """Three experts' interleaved matrices in one file, at byte offsets out of order, each with
    its own few tokens (2, 5 and the most ``FEW_TOKENS`` allows: whole tiles, and tokens and
    groups past them), in one call: each expert's rows exactly what ``matmul`` gives its tokens
    (the same tiles and activations)."""
    rows_, cols = shape
    if scheme in interleave.K_SCHEMES and cols % 256:
        pytest.skip("q4_k rows are whole super-blocks")
    counts = [2, 5, interleave.FEW_TOKENS[scheme] - 1]
    packed = [interleave.repack(_case(rows_, cols, seed, scheme)[0], scheme) for seed in range(3)]
    size = packed[0].nbytes
    flat = interleave.aligned_empty(3 * size)
    offsets = np.array([2 * size, 0, size], dtype=np.int64)
    for matrix, at in zip(packed, offsets):
        flat[at:at + size] = matrix.reshape(-1)
    x = np.random.default_rng(7).standard_normal((sum(counts), cols)).astype(np.float32)
    groups = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    out = np.full((len(x), rows_), np.nan, dtype=np.float32)
    interleave.groups_product(interleave.SCHEMES.index(scheme), flat, offsets, packed[0].shape[1], x, groups, out)
    for e in range(3):
        tokens = slice(groups[e], groups[e + 1])
        np.testing.assert_array_equal(out[tokens], interleave.matmul(x[tokens], packed[e], scheme))


def _mappings():
    """This process's mappings (/proc/self/smaps): (first address, end, path or "", the fields
    below the mapping's line by name, each its values)."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                if mapping:
                    yield mapping
                low, high = (int(bound, 16) for bound in head[0].split("-"))
                mapping = (low, high, head[5] if len(head) >= 6 else "", {})
            elif mapping and head:
                mapping[3][head[0].rstrip(":")] = head[1:]
    if mapping:
        yield mapping


def _mapped_rss(path: str) -> int:
    """Bytes of this process's resident pages mapped from ``path`` (/proc/self/smaps)."""
    return sum(int(fields["Rss"][0]) * 1024 for _, _, mapped, fields in _mappings() if mapped == path)


@contextlib.contextmanager
def _numpy_not_asking_for_huge_pages():
    """numpy's advice of huge pages for its large arrays (its default on Linux) turned off for a
    while, where its private switch is there, as ``NUMPY_MADVISE_HUGEPAGE=0`` turns it off."""
    module = next((m for m in (getattr(np, "_core", None), getattr(np, "core", None))
                   if m is not None and hasattr(m.multiarray, "_set_madvise_hugepage")), None)
    was = module.multiarray._set_madvise_hugepage(False) if module is not None else None
    try:
        yield
    finally:
        if module is not None:
            module.multiarray._set_madvise_hugepage(was)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_copies_of_two_megabytes_or_more_lie_in_huge_page_spans():
    """A copy of 2 MB or more starts on a huge page's boundary, its whole length inside memory
    advised for huge pages (``hg`` in the mapping's flags, where Linux has transparent huge
    pages), whether or not numpy advises its own large arrays; a smaller one starts on a cache
    line."""
    with _numpy_not_asking_for_huge_pages():
        for nbytes in (2 << 20, 4_700_000):
            copy = interleave.aligned_empty(nbytes)
            copy[:] = 1
            assert copy.nbytes == nbytes and copy.flags.writeable and copy.ctypes.data % (2 << 20) == 0
            if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
                first, last = copy.ctypes.data, copy.ctypes.data + nbytes - 1
                held = [fields for low, high, _, fields in _mappings() if low <= first and last < high]
                assert held and "hg" in held[0]["VmFlags"]
    small = interleave.aligned_empty(1000)
    assert small.nbytes == 1000 and small.ctypes.data % 64 == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_release_drops_a_copied_tensor_s_pages_from_the_process(tmp_path):
    """``Bundle.release`` (the copies' makers call it for what they copied): the tensor's whole
    pages leave the process's resident memory, and read again they hold the same bytes."""
    import model_factory as mf

    from ktc.compile import compile_bundle
    from ktc.formats.bundle import open_bundle

    folder = mf.write_safetensors(mf.build_hf_model("qwen3_moe", hidden_size=256, head_dim=64), str(tmp_path / "m"))
    path = os.path.realpath(str(tmp_path / "m.ktb"))
    compile_bundle(folder, path, cpu_scheme="f32")
    with open_bundle(path) as bundle:
        name = max(bundle.tensors, key=lambda n: bundle.tensors[n].nbytes)
        view = bundle.tensor_bytes(name)
        want = view.copy()  # every page of it touched
        before = _mapped_rss(path)
        bundle.release(name)
        after = _mapped_rss(path)
        t = bundle.tensors[name]
        whole = ((t.offset + t.nbytes) // 4096 - -(-t.offset // 4096)) * 4096
        assert whole >= 64 * 1024 and before - after >= whole
        assert np.array_equal(view, want)
        assert _mapped_rss(path) > after


@pytest.mark.parametrize("shape", [(16, 128), (48, 2048)])
def test_int8_rows_are_copied_as_q8_0_blocks_with_their_row_scale(shape):
    """int8 rows (codes, then a float32 scale) go into q8_0's interleaved layout: each block of 32
    codes after the row's scale in fp16, so the copy unpacks to those q8_0 rows; a one-token
    product from it gives the stored int8 rows' within the scale's fp16 rounding (2^-11 of a
    row's product). A row scale outside fp16's normal numbers (a row of tiny weights) is not
    copied (``int8_copies``)."""
    rows, cols = shape
    raw, x = _case(rows, cols, 11, "int8")
    as_q8 = interleave.int8_as_q8_0(raw)
    assert as_q8.shape == (rows, cols // 32 * 34)
    scales = raw[:, cols:].copy().view(np.float32)[:, 0]
    blocks = as_q8.reshape(rows, cols // 32, 34)
    np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0],
                                  np.repeat(scales.astype(np.float16)[:, None], cols // 32, axis=1))
    np.testing.assert_array_equal(blocks[..., 2:].reshape(rows, cols), raw[:, :cols])
    copy = interleave.repack(raw, "int8")
    np.testing.assert_array_equal(interleave.unpack(copy, "q8_0"), as_q8)
    assert interleave.int8_copies(raw)
    if vnni.HAVE_VNNI:
        got = interleave.matvec(copy, "q8_0", x)
        codes = raw[:, :cols].view(np.int8).astype(np.float64)
        xq, dx, _ = vnni.quantize_activations(x, 32)
        want = scales * ((codes * xq).reshape(rows, cols // 32, 32).sum(axis=2) * dx).sum(axis=1)
        np.testing.assert_allclose(got, want, rtol=0, atol=6e-4 * np.abs(want).max())
    tiny = raw.copy()
    tiny[3, cols:] = np.array([1e-6], np.float32).view(np.uint8)
    assert not interleave.int8_copies(tiny)


def test_repack_without_the_jit_gives_the_same_bytes(tmp_path):
    """``repack``'s compiled copies (a word a load) and their Python semantics (NUMBA_DISABLE_JIT:
    a byte at a time) give the same bytes, the tail and q8_0's plus 128 included."""
    import os
    import subprocess
    import sys

    script = tmp_path / "repack.py"
    script.write_text(
        "import sys, numpy as np\n"
        "from ktc.formats.quantize import quantize\n"
        "from ktc.runtime import interleave\n"
        "rng = np.random.default_rng(3)\n"
        "for scheme, cols in [('q4_0', 96), ('q8_0', 2880), ('mxfp4', 160), ('q4_k', 512)]:\n"
        "    raw = np.ascontiguousarray(quantize(rng.standard_normal((32, cols)).astype(np.float32), scheme))\n"
        "    np.save(f'{sys.argv[1]}/{scheme}.npy', interleave.repack(raw, scheme, rows_at_once=16))\n")
    for jit in ("0", "1"):
        (tmp_path / jit).mkdir()
        env = dict(os.environ, NUMBA_DISABLE_JIT=jit)
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / jit)], capture_output=True, text=True,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    for scheme in ("q4_0", "q8_0", "mxfp4", "q4_k"):
        compiled, python = (np.load(tmp_path / jit / f"{scheme}.npy") for jit in ("0", "1"))
        np.testing.assert_array_equal(compiled, python)
