"""Device experts in torch, kept at their bundle scheme.

The experts a plan puts on the GPU are uploaded as the bundle's own bytes, stacked per layer and
scheme (``[experts, rows, row_bytes]`` uint8), so they take on the device exactly the bytes the
planner counted. A matrix is decoded with torch operations on the device when its expert runs
(int8 multiplies its codes and applies the row scales after the product), so nothing of the
decoded size stays allocated. Runs on any torch device; CI runs it on the CPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.dequant import FP4_E2M1_VALUES
from ktc.formats.schemes import get_scheme

from . import fp8, kquants


def check_device(device: Any) -> Any:
    """``device`` as a torch device (None stays None), or a ``KtcError`` that says what to do:
    a CUDA device asked for where torch sees none (a CPU build of torch, or no driver) is not
    torch's AssertionError from deep inside the first upload."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise KtcError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KtcError("--device cuda, but torch sees no CUDA device (a CPU build of torch, or no driver)",
                       hint="run on the CPU (--device cpu) or install a CUDA build of torch")
    if dev.type not in ("cuda", "cpu"):
        raise KtcError(f"device {device!r} is not supported; use cpu or cuda")
    return dev




_SHIFTS: dict[Any, Any] = {}  # device -> uint8 [[0], [4]]


def _nibbles(codes: Any) -> Any:
    """[..., n] bytes -> [..., 2n] 4-bit codes: the low nibbles, then the high ones (the order of
    ggml's blocks of 32 and of ktc's int4 groups). Two operations: each a kernel launch on a GPU."""
    import torch

    shifts = _SHIFTS.get(codes.device)
    if shifts is None:
        shifts = _SHIFTS[codes.device] = torch.tensor([[0], [4]], dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-2) >> shifts) & 15).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def _view(raw: Any, dtype: Any) -> Any:
    """Bytes [..., n] reinterpreted as ``dtype`` (copied first when the slice is not contiguous)."""
    return raw.contiguous().view(dtype)


def _leading_half(blocks: Any) -> Any:
    """The float16 in the first two bytes of each block of ``blocks`` [..., block_bytes] (an
    even size), as float32 [..., 1]: read in place where the blocks are contiguous (a copy of
    the slice otherwise, which costs a launch)."""
    import torch

    if blocks.is_contiguous() and blocks.storage_offset() % 2 == 0:
        return blocks.view(torch.float16)[..., :1].float()
    return _view(blocks[..., :2], torch.float16).float()


def dequantize(raw: Any, scheme: str, cols: int, dtype: Any) -> Any:
    """Values [rows, cols] in ``dtype`` of a matrix stored as bytes ``raw`` [rows, row_bytes]
    (uint8, any device) in ``scheme``; the same values as ``ktc.formats.quantize.dequantize``."""
    name = get_scheme(scheme).name
    try:
        decoder = DEVICE_DECODERS[name]
    except KeyError:
        raise ValueError(f"no device decoder for scheme {scheme!r}") from None
    return decoder(raw, cols).to(dtype)


def matmul(x: Any, raw: Any, scheme: str, cols: int, dtype: Any) -> Any:
    """``x @ W.T`` in float32 for ``W`` stored as ``raw`` in ``scheme``, computed in ``dtype``."""
    if scheme in DEVICE_MATMULS:
        return DEVICE_MATMULS[scheme](x, raw, cols, dtype)
    return (x.to(dtype) @ dequantize(raw, scheme, cols, dtype).T).float()


def batched_matmul(x: Any, raw: Any, scheme: str, cols: int, dtype: Any) -> Any:
    """``x[i] @ W_i.T`` [n, tokens, rows] in float32 for the ``n`` matrices stored as ``raw``
    [n, rows, row_bytes] in ``scheme`` and ``x`` [n, tokens, cols], computed in ``dtype``: the
    matrices decoded together and multiplied in one batched product (a matrix a time costs a
    decoder's dozen kernel launches each, which on a GPU takes longer than the work)."""
    import torch

    if scheme in DEVICE_MATMULS:  # their products take a stack of matrices as they take one
        return DEVICE_MATMULS[scheme](x, raw, cols, dtype)
    n, rows_ = raw.shape[0], raw.shape[1]
    values = dequantize(raw.reshape(n * rows_, raw.shape[2]), scheme, cols, dtype).reshape(n, rows_, cols)
    return torch.bmm(x.to(dtype), values.transpose(1, 2)).float()


# Each scheme's device decoder ``(raw, cols) -> values`` (float32, or the plain type itself),
# keyed by the registry's names; a test checks every scheme the registry says runs on the GPU
# has one. ``DEVICE_MATMULS``: schemes with a better product than decode-then-multiply.
DEVICE_DECODERS: dict[str, Any] = {}
DEVICE_MATMULS: dict[str, Any] = {}


def register_device(name: str, decoder: Any, matmul: Any = None) -> None:
    DEVICE_DECODERS[name] = decoder
    if matmul is not None:
        DEVICE_MATMULS[name] = matmul


def _plain(dtype_name: str) -> Any:
    def decode(raw: Any, cols: int) -> Any:
        import torch

        return _view(raw, getattr(torch, dtype_name))

    return decode


def _int8(raw: Any, cols: int) -> Any:
    import torch

    return _view(raw[:, :cols], torch.int8).float() * _view(raw[:, cols:], torch.float32)


def _int8_matmul(x: Any, raw: Any, cols: int, dtype: Any) -> Any:
    import torch

    # the codes are exact in bf16/f16: scale after the product (raw [rows, row_bytes], or a stack
    # [n, rows, row_bytes] with x [n, tokens, cols])
    product = x.to(dtype) @ _view(raw[..., :cols], torch.int8).to(dtype).transpose(-1, -2)
    return product.float() * _view(raw[..., cols:], torch.float32).reshape(*raw.shape[:-2], 1, raw.shape[-2])


def _ggml_32(block_bytes: int, values: Any) -> Any:
    """A decoder of ggml's blocks of 32: ``values(blocks)`` gives the 32 values of each."""

    def decode(raw: Any, cols: int) -> Any:
        return values(raw.reshape(raw.shape[0], cols // 32, block_bytes)).reshape(raw.shape[0], cols)

    return decode


def _q8_0(blocks: Any) -> Any:
    import torch

    return _view(blocks[..., 2:], torch.int8).float() * _leading_half(blocks)


def _q4_0(blocks: Any) -> Any:
    return (_nibbles(blocks[..., 2:]).float() - 8) * _leading_half(blocks)


def _mxfp4(blocks: Any) -> Any:
    import torch

    table = torch.from_numpy(FP4_E2M1_VALUES).to(blocks.device)
    return table[_nibbles(blocks[..., 1:]).long()] * torch.exp2(blocks[..., :1].float() - 127)


def _int4(group: int) -> Any:
    def decode(raw: Any, cols: int) -> Any:
        import torch

        rows, groups = raw.shape[0], cols // group
        q = _nibbles(raw[:, : cols // 2].reshape(rows, groups, group // 2)).float()
        params = _view(raw[:, cols // 2:], torch.bfloat16).float()
        return (q * params[:, :groups, None] + params[:, groups:, None]).reshape(rows, cols)

    return decode


register_device("f32", _plain("float32"))
register_device("f16", _plain("float16"))
register_device("bf16", _plain("bfloat16"))
register_device("int8", _int8, _int8_matmul)
register_device("q8_0", _ggml_32(34, _q8_0))
register_device("q4_0", _ggml_32(18, _q4_0))
register_device("mxfp4", _ggml_32(17, _mxfp4))
for _group in (32, 64, 128):
    register_device(f"int4_g{_group}", _int4(_group))
register_device("fp8_e4m3", fp8.device_decode)
for _name in kquants.KINDS:
    register_device(_name, kquants.device_decoder(_name))


@dataclass
class DeviceExperts:
    """The device experts of one layer that share a scheme: their raw bytes stacked."""

    scheme: str
    gate_up: Any  # uint8 [n, 2 * inter, row_bytes]
    down: Any  # uint8 [n, hidden, row_bytes]
    gate_up_bias: Any = None  # float32 [n, 2 * inter]
    down_bias: Any = None  # float32 [n, hidden]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down, self.gate_up_bias,
                                                            self.down_bias) if t is not None)


def upload(scheme: str, gate_up: list[np.ndarray], down: list[np.ndarray],
           gate_up_bias: list[np.ndarray], down_bias: list[np.ndarray], device: Any) -> DeviceExperts:
    """Stack the experts' raw matrices (uint8 [rows, row_bytes] each) on ``device``: each
    matrix's bytes copied from where they lie (the bundle's map) into its place in the stack
    through ``Staging``; the biases (small) stacked on the host and copied once each."""
    import torch

    device = torch.device(device)

    def stack(parts: list[np.ndarray]) -> Any:
        if not parts:
            return None
        if any(p.shape != parts[0].shape for p in parts):
            raise ValueError(f"a stack of matrices of shapes {sorted({p.shape for p in parts})}")
        out = torch.empty((len(parts), *parts[0].shape), dtype=torch.uint8, device=device)
        staging = Staging.of(device)
        for i, part in enumerate(parts):
            staging.copy(out[i], part)
        return out

    def small(parts: list[np.ndarray]) -> Any:
        return torch.from_numpy(np.stack(parts)).to(device) if parts else None

    return DeviceExperts(scheme, stack(gate_up), stack(down), small(gate_up_bias), small(down_bias))


def from_host(array: np.ndarray, device: Any) -> Any:
    """``array`` as a tensor on ``device``. On CUDA through page-locked memory without waiting
    (torch's caching host allocator keeps the block until the copy is done): a copy from pageable
    memory waits for the device's queue to reach it, a synchronisation each (a decode step's
    indices and weights, and its CPU experts' sum, every layer). On the CPU the array's own
    memory (no copy), elsewhere a plain copy."""
    import torch

    tensor = torch.from_numpy(array)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Staging:
    """Copies host bytes to a device through two buffers in turn, page-locked on CUDA: a chunk
    is copied into one (on the host, by the calling thread) while the other's chunk is still on
    its way to the device (an asynchronous copy, ordered on the caller's current stream). Before,
    an upload stacked the experts on the host (``np.stack``: one more copy of every byte) and
    copied the stack from pageable memory, which the driver copies once more through buffers of
    its own: on an H200 machine the prefill offload's copies ran far below the 55 GB/s its
    page-locked copies reach (README, "The device path on an H200 machine"). One per device,
    shared by the threads that upload (a lock: the layers' workers copy a layer ahead while the
    model's thread copies for this one). On torch's CPU device the buffers are plain memory and
    the copies synchronous: the same chunks, for the tests."""

    CHUNK = 16 << 20  # bytes a buffer
    _each: dict[Any, Staging] = {}
    _made = threading.Lock()

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._chunk = self.CHUNK
        self._buffers = [torch.empty(self._chunk, dtype=torch.uint8) for _ in range(2)]
        if self._cuda:
            self._buffers = [b.pin_memory() for b in self._buffers]
        self._views = [b.numpy() for b in self._buffers]
        self._done: list[Any] = [None, None]  # each buffer's last copy to the device (a CUDA event)
        self._turn = 0

    @classmethod
    def of(cls, device: Any) -> Staging:
        """The staging of ``device`` (made on first use)."""
        with cls._made:
            staging = cls._each.get(device)
            if staging is None or staging._chunk != cls.CHUNK:
                staging = cls._each[device] = cls(device)
            return staging

    def copy(self, dst: Any, src: np.ndarray) -> None:
        """dst (a contiguous uint8 tensor on the device) = the bytes of ``src`` (the same count)."""
        import torch

        flat_src = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        flat_dst = dst.view(-1)
        if flat_dst.numel() != flat_src.size:
            raise ValueError(f"copy of {flat_src.size} bytes into {flat_dst.numel()}")
        with self._lock:
            for start in range(0, flat_src.size, self._chunk):
                part = flat_src[start: start + self._chunk]
                i = self._turn
                self._turn ^= 1
                if self._done[i] is not None:
                    self._done[i].synchronize()  # the buffer's last chunk has left it
                np.copyto(self._views[i][: part.size], part)
                flat_dst[start: start + part.size].copy_(self._buffers[i][: part.size], non_blocking=self._cuda)
                if self._cuda:
                    self._done[i] = torch.cuda.Event()
                    self._done[i].record(torch.cuda.current_stream(self.device))

