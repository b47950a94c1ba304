"""Matrices that share their input in one call (``runtime.projections``) against each matrix's
own kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktc.formats.quantize import quantize
from ktc.runtime import vnni
from ktc.runtime.kernels import matvec
from ktc.runtime.linear import HostLinear
from ktc.runtime.projections import Projections

pytestmark = pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")


def _linear(rng: np.random.Generator, scheme: str, rows: int, cols: int) -> HostLinear:
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1)).astype(np.float32)
    return HostLinear(np.ascontiguousarray(quantize(w, scheme)), scheme, cols, rows)


@pytest.mark.parametrize("schemes,cols", [
    (("q4_0", "q4_0", "q4_0"), 512),
    (("q8_0", "int8", "mxfp4"), 256),  # mixed block kinds: activations in order and in quads
    (("q4_k", "q6_k", "q5_k"), 512),  # K-quants, each with its own sums
    (("q4_k", "q8_0", "q6_k", "q4_0"), 768),  # both families in one region
    (("bf16", "bf16", "bf16"), 256),  # a checkpoint's attention as ktc keeps it: the floats as they are
    (("bf16", "q8_0", "q4_k"), 512),  # bf16 beside quantized activations of both families
    (("int4_g128", "q4_0", "int4_g32", "int4_g64"), 512),  # int4, each group size its own activations
])
def test_one_call_equals_each_matrix_alone(schemes, cols):
    rng = np.random.default_rng(len(schemes) + cols)
    rows = [200, 64, 5, 130][: len(schemes)]  # chunks that end mid-item, a matrix under one item
    linears = [_linear(rng, s, r, cols) for s, r in zip(schemes, rows)]
    x = (rng.standard_normal(cols) * 3).astype(np.float32)
    proj = Projections.of(linears)
    assert proj is not None
    parts = proj.split(proj(x))
    assert [p.shape[0] for p in parts] == rows
    for part, lin in zip(parts, linears):
        want = matvec(lin.raw, lin.scheme, x)
        np.testing.assert_allclose(part, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_sets_one_call_cannot_take_are_refused():
    rng = np.random.default_rng(0)
    q4 = _linear(rng, "q4_0", 8, 256)
    assert Projections.of([q4, _linear(rng, "f32", 8, 256)]) is None  # a float matrix
    assert Projections.of([q4, _linear(rng, "q4_0", 8, 512)]) is None  # inputs of other lengths
    biased = HostLinear(q4.raw, "q4_0", 256, 8, bias=torch.ones(8))
    assert Projections.of([q4, biased]) is None
    # unless the caller adds the biases (runtime.fast_decode): the products without them
    apart = Projections.of([q4, biased], biases_apart=True)
    x = rng.standard_normal(256).astype(np.float32)
    assert apart is not None and np.array_equal(apart(x)[8:], apart(x)[:8])
    assert Projections.of([q4, _linear(rng, "q8_0", 8, 256)]) is not None
    assert Projections.of([_linear(rng, "bf16", 8, 80)]) is None  # rows of a length the kernels do not step


def test_bf16_matrices_kept_as_words_are_read_as_bytes():
    # a bundle's bf16 matrices reach HostLinear as uint16 words [rows, cols]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 256)).astype(np.float32)
    words = HostLinear(quantize(w, "bf16").view(np.uint16), "bf16", 256, 70)
    assert words.raw.dtype == np.uint16
    x = rng.standard_normal(256).astype(np.float32)
    proj = Projections.of([words])
    assert proj is not None
    want = matvec(words.raw, "bf16", x)
    np.testing.assert_allclose(proj(x), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
