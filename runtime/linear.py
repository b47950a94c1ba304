"""Small torch modules over a bundle's stored matrices, for the non-expert weights of a whole
model: a ``nn.Linear`` replacement and an embedding lookup that read the bundle's bytes in their
scheme (f32, bf16, int8, q8_0, the 4-bit schemes).

On the host the bytes stay in the mapped bundle (zero-copy) and products go through ktc's
kernels (``kernels.linear``: one token through the matrix-vector kernels, which read each weight
byte once, so a CPU-only bundle reads no more bytes per token than its scheme's size); q4_0,
q8_0, mxfp4 and q4_k matrices on a VNNI CPU are read from a copy with their rows interleaved instead
(``runtime.interleave``: the same bytes reordered, which the kernels multiply faster), unless
``interleave=False``. On a device the bytes are uploaded once and decoded by torch when used
(``device.matmul``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ktc.formats.kernel_args import read_only

from .device import matmul
from . import interleave as interleaving
from . import kernels, vnni
from .kernels import decode, int8_row_scales, interleaved_linear, linear


SMALL_LOOKUP = 64  # rows up to which an embedding lookup decodes on the calling thread


def _plain_view(raw: np.ndarray, scheme: str, cols: int) -> torch.Tensor | None:
    """A zero-copy torch view of plain-typed rows (f32, bf16, f16), else None."""
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}.get(scheme)
    if dtype is None:
        return None
    bits = raw.view(np.uint8).reshape(raw.shape[0], -1)
    return torch.from_numpy(bits).view(dtype).reshape(raw.shape[0], cols)


class HostLinear(torch.nn.Module):
    """``y = x W^T + b`` for ``W`` [out, in] stored in ``scheme`` as the bundle's raw rows,
    computed on the CPU in float32 (float32 inputs and outputs). ``interleaved``: the rows'
    interleaved copy (``runtime.interleave``) that every product reads instead of ``raw``, made
    here for a q4_0, q8_0, mxfp4 or q4_k matrix on a VNNI CPU whose shape allows it where ``interleave`` (the copy's
    memory is ``raw``'s size again; the map's pages of ``raw`` are no longer read, so the
    kernel can reclaim them)."""

    def __init__(self, raw: np.ndarray, scheme: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, *, interleave: bool = True) -> None:
        super().__init__()
        self.raw = raw
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        # read-only once here, not a view made again by every product's call
        interleave = (interleave and scheme in interleaving.SCHEMES and vnni.HAVE_VNNI and raw.dtype == np.uint8
                      and interleaving.fits(out_features, in_features, scheme))
        self.interleaved = read_only(interleaving.repack(raw, scheme)) if interleave else None
        # f32 weights are used in place by torch: the same products as an nn.Linear.
        self._weight = _plain_view(raw, scheme, in_features) if scheme == "f32" else None
        self._scales = int8_row_scales(raw, in_features) if scheme == "int8" else None

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``W x + b`` for one float32 vector (numpy in and out), through ktc's kernels."""
        if self.interleaved is not None:
            y = interleaving.matvec(self.interleaved, self.scheme, x)
        else:
            y = kernels.matvec(self.raw, self.scheme, x, scales=self._scales)
        if self.bias is not None:
            y += self.bias.detach().numpy()
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight is not None:
            return torch.nn.functional.linear(x.float(), self._weight, self.bias)
        if x.numel() == self.in_features and x.dtype == torch.float32:  # one token: fewest steps
            return torch.from_numpy(self.matvec(x.detach().numpy().reshape(-1))).reshape(*x.shape[:-1],
                                                                                       self.out_features)
        flat = x.detach().reshape(-1, self.in_features).to(torch.float32)
        if self.interleaved is not None:
            y = torch.from_numpy(interleaved_linear(flat.numpy(), self.interleaved, self.scheme))
        else:
            y = torch.from_numpy(linear(flat.numpy(), self.raw, self.scheme, self._scales))
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        interleaved = ", interleaved" if self.interleaved is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{interleaved}"


class DeviceLinear(torch.nn.Module):
    """The same for a weight uploaded to a torch device at its quantized scheme (uint8 rows),
    decoded by torch ops when used; products in ``dtype``."""

    def __init__(self, raw: torch.Tensor, scheme: str, in_features: int, out_features: int,
                 dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.raw = raw
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = matmul(flat, self.raw, self.scheme, self.in_features, self.dtype).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class BundleEmbedding(torch.nn.Module):
    """Token embedding rows looked up in the bundle's table (kept in host memory, one row read
    per token), decoded from ``scheme`` and moved to ``device`` in ``dtype``. ``scale``
    multiplies the rows (models that scale their embeddings)."""

    def __init__(self, raw: np.ndarray, scheme: str, num_embeddings: int, embedding_dim: int, *,
                 device: Any = "cpu", dtype: torch.dtype = torch.float32, scale: float | None = None) -> None:
        super().__init__()
        self.raw = raw
        self.scheme = scheme
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.scale = scale

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Float32 rows [len(ids), embedding_dim]."""
        if len(ids) == 1:  # a decode step: a view (numpy's fancy indexing took about 80 us there,
            # among streaming weights that evict its code from the caches)
            at = int(ids[0])
            if not 0 <= at < self.num_embeddings:
                raise IndexError(f"token id {at} out of range 0..{self.num_embeddings - 1}")
            picked = self.raw[at:at + 1]
        else:
            picked = np.ascontiguousarray(self.raw[ids])
        # A decode step looks up one row: on this thread, not in a parallel region (waking the
        # kernels' threads right after torch's took 0.6 ms per token here).
        return decode(picked, self.scheme, self.embedding_dim, serial=len(ids) <= SMALL_LOOKUP)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range 0..{self.num_embeddings - 1}")
        values = torch.from_numpy(np.ascontiguousarray(self.rows(ids)))
        if self.scale is not None:
            values = values * self.scale
        return values.reshape(*input_ids.shape, self.embedding_dim).to(self.device, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}"
