"""Every registered scheme through its size function, reference codec and runtime kernels, the way
gguf-py's quant test walks its type table: adding a scheme adds it to these tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_factory import random_blocks

from ktc.formats.quantize import dequantize, quantize
from ktc.formats.schemes import SCHEMES, get_scheme, source_scheme
from ktc.runtime import device, kernels


NAMES = list(SCHEMES)
ROWS, COLS = 12, 512


def blocks_of(name: str, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> np.ndarray:
    """Bytes [rows, row_bytes] of ``name``: quantized Gaussian weights where the scheme has a
    quantizer, else random blocks (``random_blocks``)."""
    if get_scheme(name).quantize is not None:
        rng = np.random.default_rng(seed)
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), name)
    return random_blocks(name, rows, cols, seed)


@pytest.mark.parametrize("name", NAMES)
def test_sizes(name):
    scheme = get_scheme(name)
    assert scheme.matrix_bytes(ROWS, COLS) == blocks_of(name).size
    assert not scheme.fits(scheme.block_elems + 1) or scheme.block_elems == 1
    if scheme.gguf_type:
        from gguf import GGMLQuantizationType, quant_shape_to_byte_shape

        assert quant_shape_to_byte_shape((ROWS, COLS), GGMLQuantizationType[scheme.gguf_type]) == \
            (ROWS, scheme.matrix_bytes(1, COLS))
    for source in scheme.sources:
        assert source_scheme(source) is scheme


@pytest.mark.parametrize("name", NAMES)
def test_reference_codec(name):
    scheme = get_scheme(name)
    raw = blocks_of(name)
    values = dequantize(raw, name, COLS)
    assert values.shape == (ROWS, COLS) and values.dtype == np.float32
    assert np.isfinite(values).all()
    if scheme.gguf_type:  # the gguf package is the reference, bit for bit
        from gguf import GGMLQuantizationType, quants

        np.testing.assert_array_equal(
            values, quants.dequantize(raw, GGMLQuantizationType[scheme.gguf_type]).reshape(ROWS, COLS))
    if scheme.quantize is not None:
        x = np.random.default_rng(3).standard_normal((64, COLS)).astype(np.float32)
        back = dequantize(quantize(x, name), name, COLS)
        rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
        assert rel <= max(1.25 * scheme.error, 1e-7), (rel, scheme.error)
    else:
        with pytest.raises(Exception, match="passes through"):
            quantize(np.zeros((1, COLS), np.float32), name)


@pytest.mark.parametrize("name", [n for n in NAMES if "cpu" in get_scheme(n).devices])
def test_cpu_kernels(name):
    raw = blocks_of(name, seed=1)
    reference = dequantize(raw, name, COLS)
    assert name in kernels.CPU_KERNELS
    np.testing.assert_array_equal(kernels.decode(raw, name, COLS), reference)
    from ktc.formats.quantize import f32_to_bf16_bits

    np.testing.assert_array_equal(kernels.decode(raw, name, COLS, bf16=True), f32_to_bf16_bits(reference))
    np.testing.assert_array_equal(kernels.decode(raw, name, COLS, serial=True), reference)
    rng = np.random.default_rng(2)
    # Rows that are not C-contiguous take each scheme's float kernel (the VNNI ones want whole rows
    # back to back): the path a CPU without VNNI runs.
    padded = np.zeros((raw.shape[0], raw.shape[1] + 64), dtype=raw.dtype)
    padded[:, :raw.shape[1]] = raw
    x = rng.standard_normal(COLS).astype(np.float32)
    want = reference @ x
    got = kernels.matvec(padded[:, :raw.shape[1]], name, x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() + 1e-6, name
    for tokens in (1, 3, kernels.GEMM_MIN_TOKENS + 1):
        x = rng.standard_normal((tokens, COLS)).astype(np.float32)
        want = x @ reference.T
        got = kernels.linear(x, raw, name)
        scale = np.abs(want).max()
        # activations quantized to int8 (VNNI) or rounded to bf16 (batched): under 2% of the largest
        assert np.abs(got - want).max() <= 2e-2 * scale, (tokens, np.abs(got - want).max() / scale)


@pytest.mark.parametrize("name", [n for n in NAMES if "gpu" in get_scheme(n).devices])
def test_device_decoder(name):
    """The torch decoder (here on torch's CPU device) gives the reference's values."""
    raw = blocks_of(name, seed=4)
    assert name in device.DEVICE_DECODERS
    got = device.dequantize(torch.from_numpy(raw), name, COLS, torch.float32).numpy()
    np.testing.assert_allclose(got, dequantize(raw, name, COLS), rtol=1e-6, atol=1e-7)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, COLS)).astype(np.float32))
    product = device.matmul(x, torch.from_numpy(raw), name, COLS, torch.float32).numpy()
    np.testing.assert_allclose(product, x.numpy() @ dequantize(raw, name, COLS).T, rtol=1e-4, atol=1e-4)
    # three matrices at once (the device experts' batched products): each its own product
    stacked = np.stack([raw, blocks_of(name, seed=6), raw[::-1].copy()])
    xs = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 2, COLS)).astype(np.float32))
    batched = device.batched_matmul(xs, torch.from_numpy(stacked), name, COLS, torch.float32).numpy()
    for i in range(3):
        want = xs[i].numpy() @ dequantize(stacked[i], name, COLS).T
        np.testing.assert_allclose(batched[i], want, rtol=1e-4, atol=1e-4)


def test_runtime_tables_match_the_registry():
    for name, scheme in SCHEMES.items():
        assert ("cpu" in scheme.devices) == (name in kernels.CPU_KERNELS), name
        assert ("gpu" in scheme.devices) == (name in device.DEVICE_DECODERS), name
    assert set(kernels.CPU_KERNELS) <= set(SCHEMES) and set(device.DEVICE_DECODERS) <= set(SCHEMES)
