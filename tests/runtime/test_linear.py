"""The host-side weights' wrappers (``runtime.linear``)."""

from __future__ import annotations

import numpy as np
import pytest

from ktc.formats.quantize import dequantize, quantize
from ktc.runtime.linear import BundleEmbedding


@pytest.mark.parametrize("scheme", ["q4_0", "q8_0", "f32"])
def test_one_embedding_row_equals_the_table_lookup(scheme):
    """A decode step's one-row lookup (a view of the table) gives the row of a many-row lookup
    and of the dequantized table; ids out of range are refused."""
    rng = np.random.default_rng(3)
    rows, cols = 40, 64
    table = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(table, scheme))
    embed = BundleEmbedding(raw, scheme, rows, cols)
    many = embed.rows(np.array([0, 17, rows - 1]))
    want = dequantize(raw, scheme, cols).reshape(rows, cols)
    for at, row in zip((0, 17, rows - 1), many):
        one = embed.rows(np.array([at]))
        assert one.shape == (1, cols)
        np.testing.assert_array_equal(one[0], row)
        np.testing.assert_array_equal(one[0], want[at])
    for bad in (-1, rows):
        with pytest.raises(IndexError):
            embed.rows(np.array([bad]))
