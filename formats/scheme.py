"""One quantization scheme: its layout and codec (``Scheme``), and the registry that each codec
module (``codec_*.py``) adds its schemes to. ``formats/schemes.py`` imports every codec module and
looks schemes up; code outside the codecs imports from there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Scheme:
    """A storage scheme for a 2-D weight [rows, cols]: one registered object per scheme.

    Layout: each row is ``cols / block_elems`` blocks of ``block_bytes`` bytes (scales inside
    the blocks, as ggml does), plus ``row_extra_bytes`` per row (a per-row scale). Codec:
    ``quantize(values, out)`` (float32 [rows, cols] -> uint8 [rows, row_bytes], into ``out``
    when given; None where the scheme only passes through) and ``dequantize(raw, cols)`` (the
    reference decoder). ``error``: nominal relative RMS error on Gaussian weights, which the
    planner weighs. ``sources``: source storage types whose bytes are this scheme's, passed
    through unchanged. ``half_scales`` / ``e8m0_scales``: byte offsets in a block of its fp16
    / e8m0 scales (a block's values are finite when they are). ``devices``: where the runtime
    runs it (``"cpu"``, ``"gpu"``); the runtime's kernel tables are keyed by ``name`` and a
    test checks they agree.
    """

    name: str
    bits: float  # nominal bits per weight, for people
    block_elems: int
    block_bytes: int
    dequantize: Callable[[np.ndarray, int], np.ndarray] = field(compare=False, repr=False)
    quantize: Callable[..., np.ndarray] | None = field(default=None, compare=False, repr=False)
    error: float = 0.1
    row_extra_bytes: int = 0
    gguf_type: str | None = None  # byte-compatible ggml type, when there is one
    sources: tuple[str, ...] = ()
    # Source types stored with a separate scale tensor that convert to this scheme exactly
    # (FP8 with block scales, gpt-oss's MXFP4 blocks): ``from_scaled(ref, start, stop, finite)``
    # gives rows start:stop of such a tensor in this scheme.
    scaled_sources: tuple[str, ...] = ()
    from_scaled: Callable[..., np.ndarray] | None = field(default=None, compare=False, repr=False)
    half_scales: tuple[int, ...] = ()
    e8m0_scales: tuple[int, ...] = ()
    devices: frozenset[str] = frozenset({"cpu", "gpu"})
    description: str = ""

    def __post_init__(self) -> None:
        if self.block_elems <= 0 or self.block_bytes <= 0 or self.row_extra_bytes < 0:
            raise ValueError(f"scheme {self.name}: block sizes must be positive")

    def fits(self, cols: int) -> bool:
        return cols % self.block_elems == 0

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] matrix; ``ValueError`` if a row is not whole blocks."""
        if not self.fits(cols):
            raise ValueError(f"scheme {self.name} needs rows that are a multiple of "
                             f"{self.block_elems} values; this row has {cols}")
        return rows * (cols // self.block_elems * self.block_bytes + self.row_extra_bytes)

    @property
    def plain(self) -> bool:
        """One stored value per weight (f32, f16, bf16): no blocks, no scales."""
        return self.block_elems == 1 and not self.row_extra_bytes


# Every scheme, in order of bits per weight (most first). The codec modules (``codec_*.py``) fill
# it through ``register``; ``formats/schemes.py`` imports them all.
SCHEMES: dict[str, Scheme] = {}
# Short names people type.
ALIASES = {"int4": "int4_g128", "fp16": "f16", "fp32": "f32", "float16": "f16", "bfloat16": "bf16"}


def register(*schemes: Scheme) -> None:
    """Add schemes to the registry (a name registered twice is a programming error)."""
    for scheme in schemes:
        if scheme.name in SCHEMES or scheme.name in ALIASES:
            raise ValueError(f"scheme {scheme.name} registered twice")
        SCHEMES[scheme.name] = scheme
    ordered = sorted(SCHEMES.values(), key=lambda s: (-s.bits, s.name))
    SCHEMES.clear()
    SCHEMES.update((s.name, s) for s in ordered)
