"""The hardware profile the planner reads: budgets and bandwidths, from flags or a JSON file.

Defaults and where they come from (docs/planner.md repeats them):

- ``reserve``: 1 GiB for the CUDA context, cuBLAS workspaces and allocator fragmentation. A CUDA
  context alone takes 300-500 MiB on current drivers; the rest is headroom.
- ``cpu_bandwidth``: 60 GB/s. Dual-channel DDR5-4800 moves 76.8 GB/s in theory and sustains
  about 80% of it on reads. Servers with 8-12 channels reach 250-400 GB/s: measure yours
  (``ktc doctor --write-profile``) rather than trusting this.
- ``gpu_bandwidth``: 900 GB/s. An RTX 4090 (the common 24 GB card) is specified at 1008 GB/s;
  batch-1 kernels reach about 90% of it.
- ``pcie_bandwidth``: 25 GB/s. PCIe 4.0 x16 is 31.5 GB/s in theory, ~25 GB/s for pinned copies.
- ``sync_seconds``: 50 us per layer that runs experts on the CPU: a stream synchronisation, a
  hand-off to the CPU worker thread and back, and two small copies, each 5-20 us.
- ``device_step_seconds``: none by default (not modelled). The runtime's fixed cost of a MoE
  layer's step that runs experts on the device: its kernel launches, torch's dispatch, the
  synchronising copies and the hand-off, whatever the experts' bytes. ``ktc doctor
  --calibrate`` measures it on a CUDA machine. On an H200 machine (a VM, slow Python) a
  Qwen3-30B-A3B-shaped layer's step took about 1.2 ms with 10-50% of its experts on the GPU,
  where bandwidths alone said 0.07-0.21 ms: with such a cost, small experts on the GPU lose to
  the CPU, and the planner keeps them there.
- ``cpu_scheme_bandwidth``, ``cpu_layer_seconds``, ``cpu_token_seconds``, ``cpu_vocab_seconds``:
  none by default. ``ktc doctor --calibrate`` measures them on the machine (ktc's kernels'
  bytes per second at each scheme, through the fused experts call and a matrix-vector product;
  the fixed cost of a decoder layer's step and of a token's, and how the latter grows with the
  vocabulary), for the CPU decode cost model
  (``passes/decode_cost.py``). Without them every scheme reads at ``cpu_bandwidth`` and fixed
  costs are left out.
- ``cpu_prefill_ops``: none by default; ``ktc doctor --calibrate`` measures the multiply-adds a
  second (each two ops) of ktc's batched CPU expert products, which price the prefill offload
  (``ktc.streaming``). Without it the offload starts at llama.cpp's 32 tokens.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ktc.errors import ConfigError, FormatError

from .json_fields import Fields
from .tensor_file import read_json

GiB = 1024**3
PROFILE_FORMAT = "ktc-hardware-profile"
PROFILE_VERSION = 1

# One rule for every size: K, M, G, T (and KB, MB, GB, TB) are powers of 1000; KiB, MiB, GiB, TiB
# powers of 1024. A "24GB" card is 24e9 bytes, 22.4 GiB.
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int | float) -> int:
    """'24GiB' -> 25769803776; '24GB' and '24G' -> 24000000000; '512MiB' -> 536870912."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or text < 0:
            raise ConfigError(f"a size must be a finite number of bytes, at least 0, not {text}")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; write it like 24GiB, 24GB or 512MiB")
    number, unit = float(match.group(1)), match.group(2)
    if not unit and number != 0:  # "--vram 24" meaning 24 bytes is never what was meant
        raise ConfigError(f"the size {text.strip()!r} has no unit; write {match.group(1)}GiB "
                          f"(2^30 bytes) or {match.group(1)}GB (10^9 bytes)")
    return int(number * _UNITS[unit.lower()])


def format_bytes(n: float) -> str:
    """Binary units, the unit chosen so the number shows: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_parts(parts: Iterable[tuple[str, float]]) -> str:
    """Named byte counts, the empty ones left out: 'kv cache 16.0 MiB, workspace 25.6 MiB'."""
    return ", ".join(f"{name.replace('_', ' ')} {format_bytes(n)}" for name, n in parts if n)


def parse_bandwidth(text: str | int | float) -> float:
    """'60GB/s' -> bytes per second (a number, from Python, is GB/s); a string needs its unit."""
    if isinstance(text, (int, float)):
        return float(text) * 1e9
    cleaned = text.strip().lower().removesuffix("/s")
    if re.fullmatch(r"[0-9]*\.?[0-9]+", cleaned):
        raise ConfigError(f"the bandwidth {text.strip()!r} has no unit; write it like {cleaned}GB/s")
    try:
        return float(parse_bytes(cleaned))
    except ConfigError:
        raise ConfigError(f"cannot read {text!r} as a bandwidth; write it like 60GB/s") from None


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * GiB


_CPU_FIXED = ("cpu_layer_seconds", "cpu_token_seconds", "cpu_vocab_seconds")
_RATE_TABLES = (*(f"{path}{part}" for path in ("experts", "matrix") for part in ("", "_call_seconds", "_call_bytes")),
                "matrix_row_seconds")
_ROW_LENGTH_TABLE = re.compile(r"matrix@[1-9][0-9]*")  # a matrix rate at rows of that many values


@dataclass(frozen=True)
class HardwareProfile:
    """Budgets in bytes, bandwidths in bytes per second, sync cost in seconds."""

    vram_bytes: int
    ram_bytes: int
    reserve_bytes: int = 1 * GiB
    cpu_bandwidth: float = 60e9
    gpu_bandwidth: float = 900e9
    pcie_bandwidth: float = 25e9
    sync_seconds: float = 50e-6
    # the runtime's fixed cost of a MoE layer's step with device experts (``ktc doctor
    # --calibrate`` on a CUDA machine); 0: not measured, not modelled
    device_step_seconds: float = 0.0
    # the read bandwidth of the disk the bundle is on (``ktc doctor``); 0: unknown, no disk tier
    disk_bandwidth: float = 0.0
    # ops a second (a multiply-add is two) of the batched CPU expert products at prefill sizes
    # (``ktc doctor --calibrate``); 0: unknown
    cpu_prefill_ops: float = 0.0
    source: str = "defaults"
    # {"experts": {scheme: bytes/s}, "experts_call_seconds": {scheme: s}, "experts_call_bytes":
    # {scheme: bytes}, the same three of "matrix", and "matrix@COLS": {scheme: bytes/s} for rows
    # of COLS values}, measured (``ktc doctor --calibrate``); profiles written before the rates a
    # row length may hold "matrix_row_seconds": {scheme: s} instead
    cpu_scheme_bandwidth: dict[str, dict[str, float]] | None = field(default=None, compare=False)
    cpu_layer_seconds: float = 0.0
    cpu_token_seconds: float = 0.0
    cpu_vocab_seconds: float = 0.0  # a token's cost more per word of the vocabulary

    @property
    def cpu_only(self) -> bool:
        """No GPU (``--vram 0``): the plan is for the CPU alone."""
        return self.vram_bytes == 0

    def __post_init__(self) -> None:
        for name in ("vram_bytes", "ram_bytes", "reserve_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hardware profile: {name} is negative")
        for name in ("cpu_bandwidth", "gpu_bandwidth", "pcie_bandwidth"):
            if not math.isfinite(getattr(self, name)) or not getattr(self, name) > 0:
                raise ConfigError(f"hardware profile: {name} must be a positive, finite number")
        for name in ("sync_seconds", "device_step_seconds", "disk_bandwidth", "cpu_prefill_ops", *_CPU_FIXED):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"hardware profile: {name} must be a finite number, at least 0")
        for path, rates in (self.cpu_scheme_bandwidth or {}).items():
            if not (path in _RATE_TABLES or _ROW_LENGTH_TABLE.fullmatch(path)) or not isinstance(rates, dict):
                raise ConfigError(f"hardware profile: cpu_scheme_bandwidth has {path!r}; it holds 'experts' "
                                  "and 'matrix' tables of scheme: bytes per second, their '_call_seconds' "
                                  "and '_call_bytes', 'matrix@COLS' tables (rows of COLS values) and "
                                  "'matrix_row_seconds'")
            for scheme, value in rates.items():
                seconds = path.endswith("_seconds")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value < 0 or (value == 0 and not seconds):
                    raise ConfigError(f"hardware profile: cpu_scheme_bandwidth.{path}.{scheme} must be a "
                                      f"{'' if seconds else 'positive, '}finite number"
                                      f"{', at least 0' if seconds else ' of bytes per second'}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.cpu_scheme_bandwidth is None:  # not calibrated: the file says nothing of it
            for name in ("cpu_scheme_bandwidth", *_CPU_FIXED):
                del data[name]
        for name in ("device_step_seconds", "disk_bandwidth", "cpu_prefill_ops"):
            if not data[name]:  # not measured: the file says nothing of it
                del data[name]
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "<profile>", *,
                  vram_bytes: int | None = None) -> HardwareProfile:
        """The profile in ``data``; ``vram_bytes`` (from ``--vram``) stands in for a file without
        one (``ktc doctor`` on a machine without a GPU writes none)."""
        fields = Fields(data, path, "hardware profile")
        if fields.string("format", default="") != PROFILE_FORMAT:
            raise FormatError(f"not a hardware profile (format is {data.get('format')!r}, expected "
                              f"{PROFILE_FORMAT!r})", path=path)
        fields.version(PROFILE_VERSION)
        if "vram_bytes" not in fields and vram_bytes is None:
            raise FormatError("hardware profile has no vram_bytes (written on a machine without a GPU)",
                              path=path, hint="give the serving GPU's memory too: --vram 24GiB")
        values: dict[str, Any] = {"vram_bytes": fields.integer("vram_bytes", default=vram_bytes, minimum=0),
                                  "ram_bytes": fields.integer("ram_bytes", default=_total_ram(), minimum=0)}
        if "reserve_bytes" in fields:
            values["reserve_bytes"] = fields.integer("reserve_bytes", minimum=0)
        for name in ("cpu_bandwidth", "gpu_bandwidth", "pcie_bandwidth"):
            if name in fields:
                values[name] = fields.number(name, positive=True)
        for name in ("sync_seconds", "device_step_seconds", "disk_bandwidth", "cpu_prefill_ops", *_CPU_FIXED):
            if name in fields:
                values[name] = fields.number(name, minimum=0)
        if "cpu_scheme_bandwidth" in fields:
            table = data["cpu_scheme_bandwidth"]
            if not isinstance(table, dict):
                raise FormatError("cpu_scheme_bandwidth must be an object", path=path)
            values["cpu_scheme_bandwidth"] = table
        try:
            return cls(**values, source=path)
        except ConfigError as exc:
            raise FormatError(str(exc), path=path) from None


def load_hardware_profile(path: str, *, vram_bytes: int | None = None) -> HardwareProfile:
    return HardwareProfile.from_json(read_json(path, "hardware profile"), path, vram_bytes=vram_bytes)


def make_hardware_profile(*, profile_path: str | None = None, vram: str | int | None = None,
                          ram: str | int | None = None, reserve: str | int | None = None,
                          cpu_bandwidth: str | float | None = None,
                          gpu_bandwidth: str | float | None = None,
                          pcie_bandwidth: str | float | None = None,
                          sync_us: float | None = None,
                          disk_bandwidth: str | float | None = None,
                          device_step_us: float | None = None) -> HardwareProfile:
    """A profile from a JSON file and/or flags; flags override the file."""
    if profile_path:
        base = load_hardware_profile(profile_path, vram_bytes=None if vram is None else parse_bytes(vram))
    elif vram is None:
        raise ConfigError("no VRAM budget: give --vram (e.g. --vram 24GiB) or --hardware FILE")
    else:
        base = HardwareProfile(vram_bytes=parse_bytes(vram), ram_bytes=_total_ram(), source="flags")
    flags = (("vram_bytes", vram, parse_bytes), ("ram_bytes", ram, parse_bytes),
             ("reserve_bytes", reserve, parse_bytes), ("cpu_bandwidth", cpu_bandwidth, parse_bandwidth),
             ("gpu_bandwidth", gpu_bandwidth, parse_bandwidth),
             ("pcie_bandwidth", pcie_bandwidth, parse_bandwidth),
             ("sync_seconds", sync_us, lambda us: float(us) * 1e-6),
             ("device_step_seconds", device_step_us, lambda us: float(us) * 1e-6),
             ("disk_bandwidth", disk_bandwidth, parse_bandwidth))
    changes: dict[str, Any] = {field: parse(value) for field, value, parse in flags if value is not None}
    return replace(base, **changes) if changes else base
