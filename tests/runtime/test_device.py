"""Device experts at their bundle scheme, on torch's CPU device (the same code runs on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.formats.bundle import open_bundle
from ktc.formats.quantize import dequantize, quantize
from ktc.formats.schemes import ExpertShape, expert_footprint
from ktc.runtime import device as dev
from ktc.runtime import vnni
from ktc.runtime.moe import MoELayer

SCHEMES = ["f32", "f16", "bf16", "int8", "q8_0", "q4_0", "mxfp4", "int4_g32", "int4_g64", "int4_g128"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows, cols, seed", [(8, 128, 0), (5, 256, 1), (3, 384, 2)])
def test_device_decode_matches_numpy(scheme, rows, cols, seed):
    if cols % 128 and scheme == "int4_g128":
        pytest.skip("row not whole groups")
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3)).astype(np.float32)
    raw = quantize(w, scheme)
    want = dequantize(raw, scheme, cols)
    got = dev.dequantize(torch.from_numpy(raw), scheme, cols, torch.float32).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    product = dev.matmul(torch.from_numpy(x), torch.from_numpy(raw), scheme, cols, torch.float32).numpy()
    np.testing.assert_allclose(product, x @ want.T, rtol=1e-4, atol=1e-4 * np.abs(x @ want.T).max())


def _device_bytes(schemes: list[str], biases: bool = False) -> int:
    shape = ExpertShape(mf.HIDDEN, 32, biases)
    return sum(expert_footprint(shape, s).data_bytes for s in schemes)


def _check_against_cpu(path: str, layer: int, hidden: np.ndarray, schemes, biases: bool = False) -> None:
    with open_bundle(path) as bundle:
        on_device = MoELayer(bundle, layer, device="cpu")
        on_cpu = MoELayer(bundle, layer)
        assert on_cpu.gpu_experts == () and on_cpu.device_bytes == 0
        assert on_device.gpu_experts == tuple(e for e in range(mf.EXPERTS) if schemes(e))
        assert sorted(on_device.experts._device_weights) == sorted({schemes(e) for e in on_device.gpu_experts})
        assert on_device.device_bytes == _device_bytes([schemes(e) for e in on_device.gpu_experts], biases)
        want = on_cpu.forward(hidden)
        got = on_device.forward(hidden)
        # 4-bit schemes, q8_0 and int8 on a VNNI CPU multiply int8-quantized activations (the device
        # does not)
        quantized_x = ("int4", "q4_0", "mxfp4", "q8_0", "int8")
        vnni_schemes = vnni.HAVE_VNNI and any(str(schemes(e)).startswith(quantized_x) for e in range(mf.EXPERTS))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-2 if vnni_schemes else 1e-5)
        on_device.close()
        on_cpu.close()


@pytest.mark.parametrize("scheme", ["int8", "int4_g32", "q8_0", "q4_0", "mxfp4", "bf16"])
def test_device_experts_stay_at_their_scheme(scheme, tiny_models, tmp_path):
    """Device experts take exactly their scheme's bytes and give the CPU kernels' output."""
    def schemes(e):
        return scheme if e % 3 == 0 else None

    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path,
                                   lambda e: f"gpu:{scheme}" if schemes(e) else f"cpu:{scheme}")
    hidden = np.random.default_rng(3).standard_normal((6, mf.HIDDEN)).astype(np.float32)
    for layer in (0, 2):
        _check_against_cpu(path, layer, hidden, schemes)


def test_mixed_device_schemes_in_one_layer(tiny_models, tmp_path):
    """A plan may give the device experts of one layer different schemes: each keeps its own
    (gpt-oss: biases and the clamped SwiGLU on the device too)."""
    gpu_schemes = ["int8", "q4_0", "bf16", "int4_g32"]

    def schemes(e):
        return gpu_schemes[(e // 2) % 4] if e % 2 == 0 else None

    path = mf.compile_with_placement(tiny_models["gpt_oss"]["safetensors"], tmp_path,
                                   lambda e: f"gpu:{schemes(e)}" if schemes(e) else "cpu:int8")
    hidden = np.random.default_rng(4).standard_normal((9, mf.HIDDEN)).astype(np.float32)
    _check_against_cpu(path, 1, hidden, schemes, biases=True)


@pytest.mark.parametrize("family, scheme", [("qwen3_moe", "q4_0"), ("qwen3_moe", "int8"), ("qwen3_moe", "q8_0"),
                                            ("gpt_oss", "int4_g32"), ("gpt_oss", "mxfp4")])
def test_a_token_alone_takes_the_one_token_path_to_the_same_sums(family, scheme, tiny_models, tmp_path):
    """Every expert on the device: a token alone (a decode step: one copy of indices and weights,
    the experts' outputs summed by a matrix product) gives what the same token gives among
    others (padded batches, a scatter), biases and the clamped SwiGLU included (gpt-oss)."""
    path = mf.compile_with_placement(tiny_models[family]["safetensors"], tmp_path, lambda e: f"gpu:{scheme}")
    hidden = np.random.default_rng(6).standard_normal((7, mf.HIDDEN)).astype(np.float32)
    with open_bundle(path) as bundle:
        layer = MoELayer(bundle, 1, device="cpu")
        together = layer.forward(hidden)
        for i in range(len(hidden)):
            np.testing.assert_allclose(layer.forward(hidden[i: i + 1])[0], together[i], rtol=1e-5,
                                       atol=1e-6 * np.abs(together).max())
        layer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_is_the_device_experts_bytes(tiny_models, tmp_path):
    """On CUDA: no device experts, no device memory; otherwise exactly their bytes, and the
    output (bf16 products on the device) stays close to the CPU kernels'."""
    src = tiny_models["qwen3_moe"]["safetensors"]
    hidden = np.random.default_rng(5).standard_normal((6, mf.HIDDEN)).astype(np.float32)
    for where in (lambda e: "cpu:int8", lambda e: "gpu:int4_g32" if e % 2 else "cpu:int8"):
        path = mf.compile_with_placement(src, tmp_path, where)
        torch.cuda.synchronize()
        mf.warm_cuda()
        before = torch.cuda.memory_allocated()
        with open_bundle(path) as bundle:
            on_device = MoELayer(bundle, 1, device="cuda")
            torch.cuda.synchronize()
            grown = torch.cuda.memory_allocated() - before
            tensors = 4 * len(on_device.experts._device_weights)  # the allocator rounds each up to 512 bytes
            assert on_device.device_bytes <= grown <= on_device.device_bytes + 512 * tensors
            assert (grown == 0) == (on_device.gpu_experts == ())
            on_cpu = MoELayer(bundle, 1)
            want = on_cpu.forward(hidden)
            got = on_device.forward(hidden)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
            on_device.close()
            on_cpu.close()
        (tmp_path / "m.ktb").unlink()


def test_observers_see_each_forward_once(tiny_models, tmp_path):
    """``ExpertSet.observers`` (``ktc profile``'s trace and pre-gating) see each forward's hidden
    states and routing once, whether the experts run on the CPU alone or some on the device (that
    path goes through torch)."""
    from ktc.runtime.experts import ExpertSet

    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path,
                                   lambda e: "gpu:int8" if e % 2 else "cpu:int8")
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((5, mf.HIDDEN)).astype(np.float32)
    idx = np.stack([rng.choice(mf.EXPERTS, 2, replace=False) for _ in range(5)])
    weights = np.full((5, 2), 0.5, dtype=np.float32)
    with open_bundle(path) as bundle:
        for device in ("cpu", None):
            experts = ExpertSet(bundle, 0, device=device)
            seen: list[tuple[np.ndarray, np.ndarray]] = []
            experts.observers.append(lambda h, i: seen.append((h.copy(), i.copy())))
            experts.forward(hidden, idx, weights)
            experts.forward(hidden[:1], idx[:1], weights[:1])
            on_device = tuple(range(1, mf.EXPERTS, 2)) if device else ()
            assert len(seen) == 2 and experts.gpu_experts == on_device
            np.testing.assert_array_equal(np.concatenate([i for _, i in seen]), np.concatenate([idx, idx[:1]]))
            np.testing.assert_array_equal(np.concatenate([h for h, _ in seen]), np.concatenate([hidden, hidden[:1]]))
            experts.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_uploads_go_through_the_staging_buffers_in_chunks(device, monkeypatch):
    """A stack's bytes are each matrix's, in order, whatever the chunks: matrices longer than
    a buffer and not a whole number of them, the two buffers taken in turn (page-locked on
    CUDA), from a view of the map as from an array."""
    monkeypatch.setattr(dev.Staging, "CHUNK", 1000)
    rng = np.random.default_rng(9)
    parts = [rng.integers(0, 256, (7, 333), dtype=np.uint8) for _ in range(3)]
    shared = rng.integers(0, 256, (2, 7, 666), dtype=np.uint8)[:, :, ::2]  # strided, as no map is
    stack = dev.upload("q8_0", parts, list(shared), [], [], device)
    assert stack.gate_up_bias is None
    np.testing.assert_array_equal(stack.gate_up.cpu().numpy(), np.stack(parts))
    np.testing.assert_array_equal(stack.down.cpu().numpy(), shared)
    staging = dev.Staging.of(torch.device(device))
    assert staging._chunk == 1000
    with pytest.raises(ValueError, match="a stack of matrices of shapes"):
        dev.upload("q8_0", [parts[0], parts[0].T.copy()], parts[:2], [], [], device)
    with pytest.raises(ValueError, match="copy of 10 bytes into 12"):
        staging.copy(torch.empty(12, dtype=torch.uint8, device=device), np.zeros(10, np.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_copy_to_the_host_keeps_every_bit(dtype):
    """A device layer's hidden states, indices and routing weights reach the host in one copy
    (``experts.host_copy``, one synchronisation on a GPU): the same values as three copies,
    denormals, a NaN's payload, negative zero and large indices included."""
    from ktc.runtime.experts import host_copy

    rng = np.random.default_rng(9)
    hidden = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    hidden[0, :4] = torch.tensor([1e-40, -0.0, float("inf"), 3.4e38])
    hidden[1, 0] = torch.from_numpy(np.array([0x7FC00123], dtype=np.uint32).view(np.float32))[0]  # a NaN payload
    hidden = hidden.to(dtype)
    idx = torch.tensor([[0, 511], [70000, 3], [2, 1]], dtype=torch.int64)
    weights = torch.from_numpy(rng.random((3, 2)).astype(np.float32)).to(dtype)
    host, idx_np, weights_np = host_copy(hidden, idx, weights)
    want = hidden.to(torch.float32).numpy()
    assert host.dtype == np.float32 and host.shape == (3, 64) and host.flags.c_contiguous
    np.testing.assert_array_equal(host.view(np.uint32), want.view(np.uint32))
    assert idx_np.dtype == np.int64 and idx_np.tolist() == idx.tolist()
    assert weights_np.dtype == np.float32
    np.testing.assert_array_equal(weights_np, weights.to(torch.float32).numpy())


def test_a_layer_with_one_copy_to_the_host_gives_the_same_outputs(tiny_models, tmp_path, monkeypatch):
    """A layer with device and CPU experts whose inputs reach the host through the one copy a GPU
    takes (``host_copy``, forced here on torch's CPU device): the same outputs, a token alone
    and several."""
    from ktc.runtime import experts as ex

    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path,
                                   lambda e: "gpu:q4_0" if e % 2 else "cpu:int8")
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((6, mf.HIDDEN)).astype(np.float32)
    idx = np.stack([rng.choice(mf.EXPERTS, 2, replace=False) for _ in range(6)])
    weights = rng.random((6, 2)).astype(np.float32)
    with open_bundle(path) as bundle:
        experts = ex.ExpertSet(bundle, 0, device="cpu")
        want = [experts.forward(hidden, idx, weights), experts.forward(hidden[:1], idx[:1], weights[:1])]
        copies: list[int] = []
        real = ex.host_copy
        monkeypatch.setattr(ex.ExpertSet, "_host_inputs",
                            lambda self, h, i, w: copies.append(1) or real(h, i, w))
        got = [experts.forward(hidden, idx, weights), experts.forward(hidden[:1], idx[:1], weights[:1])]
        experts.close()
    assert len(copies) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_copies_to_the_device_do_not_depend_on_the_host_array_after(device):
    """``device.from_host`` (page-locked and asynchronous on CUDA): the tensor holds the array's
    values as they were at the call, whatever the host does with the array after; on the CPU it
    is the array's own memory (no copy)."""
    array = np.arange(4096, dtype=np.float32)
    tensor = dev.from_host(array, device)
    assert tensor.device.type == device
    if device == "cpu":
        assert tensor.data_ptr() == array.ctypes.data
        return
    array[:] = -1.0
    np.testing.assert_array_equal(tensor.cpu().numpy(), np.arange(4096, dtype=np.float32))
