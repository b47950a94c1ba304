"""Device experts in torch, kept at their bundle scheme.

The experts a plan puts on the GPU are uploaded as the bundle's own bytes, stacked per layer and
scheme (``[experts, rows, row_bytes]`` uint8), so they take on the device exactly the bytes the
planner counted. A matrix is decoded with torch operations on the device when its expert runs
(int8 multiplies its codes and applies the row scales after the product), so nothing of the
decoded size stays allocated. Runs on any torch device; CI runs it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.schemes import get_scheme

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


# e2m1 code -> value (OCP Microscaling v1.0), as in the CPU kernels.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _nibbles(codes: Any) -> Any:
    """[..., n] bytes -> [..., 2n] 4-bit codes: the low nibbles, then the high ones (the order of
    ggml's blocks of 32 and of ktc's int4 groups)."""
    import torch

    return torch.cat([codes & 15, codes >> 4], dim=-1)


def _view(raw: Any, dtype: Any) -> Any:
    """Bytes [..., n] reinterpreted as ``dtype`` (copied first when the slice is not contiguous)."""
    return raw.contiguous().view(dtype)


def dequantize(raw: Any, scheme: str, cols: int, dtype: Any) -> Any:
    """Values [rows, cols] in ``dtype`` of a matrix stored as bytes ``raw`` [rows, row_bytes]
    (uint8, any device) in ``scheme``; the same values as ``ktc.formats.quantize.dequantize``."""
    import torch

    name = get_scheme(scheme).name
    rows = raw.shape[0]
    if name in ("f32", "f16", "bf16"):
        plain = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]
        return _view(raw, plain).to(dtype)
    if name == "int8":
        return _view(raw[:, :cols], torch.int8).to(dtype) * _view(raw[:, cols:], torch.float32).to(dtype)
    nb = cols // 32
    if name == "q8_0":
        blocks = raw.reshape(rows, nb, 34)
        d = _view(blocks[..., :2], torch.float16).float()
        q = _view(blocks[..., 2:], torch.int8).float()
        return (q * d).reshape(rows, cols).to(dtype)
    if name == "q4_0":
        blocks = raw.reshape(rows, nb, 18)
        d = _view(blocks[..., :2], torch.float16).float()
        q = _nibbles(blocks[..., 2:]).float() - 8
        return (q * d).reshape(rows, cols).to(dtype)
    if name == "mxfp4":
        blocks = raw.reshape(rows, nb, 17)
        scale = torch.exp2(blocks[..., :1].float() - 127)
        table = torch.tensor(_FP4, dtype=torch.float32, device=raw.device)
        values = table[_nibbles(blocks[..., 1:]).long()]
        return (values * scale).reshape(rows, cols).to(dtype)
    if name.startswith("int4_g"):
        group = get_scheme(name).block_elems
        groups = cols // group
        q = _nibbles(raw[:, : cols // 2].reshape(rows, groups, group // 2)).float()
        params = _view(raw[:, cols // 2:], torch.bfloat16).float()
        return (q * params[:, :groups, None] + params[:, groups:, None]).reshape(rows, cols).to(dtype)
    raise ValueError(f"no device decoder for scheme {scheme!r}")


def matmul(x: Any, raw: Any, scheme: str, cols: int, dtype: Any) -> Any:
    """``x @ W.T`` in float32 for ``W`` stored as ``raw`` in ``scheme``, computed in ``dtype``."""
    if scheme == "int8":  # the codes are exact in bf16/f16: scale after the product
        import torch

        product = x.to(dtype) @ _view(raw[:, :cols], torch.int8).to(dtype).T
        return product.float() * _view(raw[:, cols:], torch.float32).reshape(1, -1)
    return (x.to(dtype) @ dequantize(raw, scheme, cols, dtype).T).float()


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
    """Stack the experts' raw matrices (uint8 [rows, row_bytes] each) and move them to ``device``
    in one copy per tensor."""
    import torch

    def stack(parts: list[np.ndarray]) -> Any:
        return torch.from_numpy(np.stack(parts)).to(device) if parts else None

    return DeviceExperts(scheme, stack(gate_up), stack(down), stack(gate_up_bias), stack(down_bias))
