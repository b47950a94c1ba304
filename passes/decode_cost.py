"""The predicted time of one decode step of a compiled bundle run on the CPU (``ktc run`` with
every expert on the CPU), from the bundle's tensors and a hardware profile.

A step reads every non-expert matrix once (attention, routers, shared experts, dense MLPs,
norms, ``lm_head``), one row of the input embedding, each layer's chosen experts and the KV
cache, and pays fixed costs that do not scale with bytes. Its time is

    sum over matrices of  call(scheme, matrix) + bytes / rate(scheme, matrix, row length)
  + sum over MoE layers of  call(schemes, experts) + top_k x mean over experts of (expert bytes / rate(scheme, experts))
  + context x KV bytes a token / rate(f32, matrix)
  + layers x cpu_layer_seconds + cpu_token_seconds + vocabulary x cpu_vocab_seconds

``rate`` is the calibrated bytes per second of ktc's one-token kernels at the scheme
(``HardwareProfile.cpu_scheme_bandwidth``, ``ktc doctor --calibrate``), through the fused
experts call or a matrix-vector product (there at the matrix's row length: between two lengths
measured, interpolated in the length's logarithm; past the ends, the nearest), and ``call`` the
fixed part of such a call (for a
layer's experts the largest of its schemes'), fitted with the rate over two sizes of call and
taken in proportion to a call's bytes below the smaller size: a tiny model's calls cost what
the calibration's probe models measured as their layers' fixed cost. Without a calibration,
every scheme reads at ``cpu_bandwidth``. Routing is taken as uniform (each expert chosen ``top_k / experts`` of the
time): a layer's experts all have the same bytes in a CPU-only bundle of one scheme.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ktc.formats.hardware_profile import HardwareProfile
from ktc.ir import is_input_embedding

KV_BYTES = 4  # the CPU decode step's KV cache is float32


@dataclass(frozen=True)
class DecodeCost:
    """Predicted seconds of one CPU decode step, by part."""

    matrices: float  # attention, routers, norms, shared experts, dense MLPs, the embedding row
    head: float  # lm_head
    experts: float
    kv: float
    layer_fixed: float  # layers x cpu_layer_seconds
    token_fixed: float  # cpu_token_seconds + vocabulary x cpu_vocab_seconds
    layers: int
    bytes_read: int
    calibrated: bool  # the profile has per-scheme kernel rates

    @property
    def fixed(self) -> float:
        return self.layer_fixed + self.token_fixed

    @property
    def seconds(self) -> float:
        return self.matrices + self.head + self.experts + self.kv + self.fixed

    def to_json(self) -> dict[str, Any]:
        return {"ms_per_token": 1e3 * self.seconds, "matrices_ms": 1e3 * self.matrices, "lm_head_ms": 1e3 * self.head,
                "experts_ms": 1e3 * self.experts, "kv_ms": 1e3 * self.kv, "fixed_ms": 1e3 * self.fixed,
                "layer_fixed_ms": 1e3 * self.layer_fixed, "token_fixed_ms": 1e3 * self.token_fixed,
                "layers": self.layers, "bytes_read": self.bytes_read, "calibrated": self.calibrated}


def call_seconds(hw: HardwareProfile, scheme: str, nbytes: float, path: str = "matrix") -> float:
    """The fixed part of a call reading ``nbytes`` of ``scheme`` through ``path`` (see the
    module's docstring; 0 without a calibration)."""
    table = hw.cpu_scheme_bandwidth or {}
    fixed = table.get(path + "_call_seconds", {}).get(scheme, 0.0)
    measured_at = table.get(path + "_call_bytes", {}).get(scheme, 0.0)
    return fixed * min(1.0, nbytes / measured_at) if measured_at > 0 else fixed


def row_seconds(hw: HardwareProfile, scheme: str) -> float:
    """The cost of a matrix row beside its bytes in a matrix-vector product, in a profile
    calibrated before the rates at each row length (which hold it): 0 otherwise."""
    if _row_length_rates(hw, scheme):
        return 0.0
    return float((hw.cpu_scheme_bandwidth or {}).get("matrix_row_seconds", {}).get(scheme, 0.0))


def _row_length_rates(hw: HardwareProfile, scheme: str) -> list[tuple[int, float]]:
    """(row length, bytes/s) of ``scheme``'s matrix rates at each row length measured, shortest first."""
    return sorted((int(path[len("matrix@"):]), float(rates[scheme]))
                  for path, rates in (hw.cpu_scheme_bandwidth or {}).items()
                  if path.startswith("matrix@") and rates.get(scheme))


def rate(hw: HardwareProfile, scheme: str, path: str = "matrix", cols: int | None = None) -> float:
    """Bytes per second at which ktc's kernels read ``scheme`` through ``path`` ("experts" or
    "matrix"; for a matrix with rows of ``cols`` values, the rate at that length: see the
    module's docstring): the calibrated figure, the matrix one where the fused experts call does
    not take the scheme, else the profile's read bandwidth."""
    if path == "matrix" and cols:
        lengths = _row_length_rates(hw, scheme)
        if lengths:
            if cols <= lengths[0][0]:
                return lengths[0][1]
            for (c0, r0), (c1, r1) in zip(lengths, lengths[1:]):
                if cols <= c1:
                    t = math.log(cols / c0) / math.log(c1 / c0)
                    return r0 + t * (r1 - r0)
            return lengths[-1][1]
    table = hw.cpu_scheme_bandwidth or {}
    for where in ((path, "matrix") if path == "experts" else (path,)):
        value = table.get(where, {}).get(scheme)
        if value:
            return float(value)
    return hw.cpu_bandwidth


def cpu_decode_cost(tensors: Iterable[Any], model: dict[str, Any], hw: HardwareProfile,
                    context: int = 0) -> DecodeCost | None:
    """The predicted step of a bundle whose ``tensors`` (``formats.bundle.BundleTensor``s) and
    manifest ``model`` section are given, at ``context`` tokens in the cache; None where it has
    experts on the GPU (the planner's model covers those)."""
    tensors = list(tensors)
    if any(t.role == "expert" and t.segment != "host" for t in tensors):
        return None
    infos = {int(info["layer"]): info for info in model.get("moe_layers", [])}
    tied = bool(model.get("config", {}).get("tie_word_embeddings", False))
    has_head = any(t.role == "embeddings" and not is_input_embedding(t.name) for t in tensors)
    matrices = head = kv = 0.0
    read = 0
    vocab = 0
    expert_seconds: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    expert_bytes: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    expert_schemes: dict[int, set[str]] = defaultdict(set)
    layers = set()
    for t in tensors:
        if t.layer is not None:
            layers.add(int(t.layer))
        if t.role == "expert":
            expert_seconds[t.layer][t.expert] += t.nbytes / rate(hw, t.scheme, "experts")
            expert_bytes[t.layer][t.expert] += t.nbytes
            expert_schemes[t.layer].add(t.scheme)
            continue
        if t.role == "embeddings" and is_input_embedding(t.name) and (has_head or not tied):
            rows = t.shape[0] if t.shape else 1
            row = t.nbytes // max(rows, 1)  # one row a token
            matrices += row / rate(hw, t.scheme)
            read += row
            continue
        if t.role == "embeddings" and t.shape:
            vocab = max(vocab, int(t.shape[0]))
        if len(t.shape) == 2:  # a matrix: one call (a norm's vector is read inside another)
            seconds = (t.nbytes / rate(hw, t.scheme, cols=int(t.shape[1])) + call_seconds(hw, t.scheme, t.nbytes)
                       + t.shape[0] * row_seconds(hw, t.scheme))
        else:
            seconds = t.nbytes / rate(hw, t.scheme)
        if t.role == "embeddings":
            head += seconds
        else:
            matrices += seconds
        read += t.nbytes
        if t.role == "attention" and any(k in t.name for k in ("k_proj", "attn_k.", "v_proj", "attn_v.")):
            kv_bytes = context * t.shape[0] * KV_BYTES
            kv += kv_bytes / rate(hw, "f32")
            read += kv_bytes
    experts = 0.0
    for layer, per_expert in expert_seconds.items():
        top_k = int(infos.get(layer, {}).get("top_k", 1))
        experts += top_k * sum(per_expert.values()) / len(per_expert)
        layer_bytes = top_k * sum(expert_bytes[layer].values()) / len(per_expert)
        experts += max((call_seconds(hw, scheme, layer_bytes, "experts") for scheme in expert_schemes[layer]),
                       default=0.0)
        read += round(layer_bytes)
    return DecodeCost(matrices, head, experts, kv, len(layers) * hw.cpu_layer_seconds,
                      hw.cpu_token_seconds + vocab * hw.cpu_vocab_seconds,
                      len(layers), read, bool(hw.cpu_scheme_bandwidth))


def bundle_decode_cost(bundle: Any, hw: HardwareProfile, context: int = 0) -> DecodeCost | None:
    """``cpu_decode_cost`` of an opened ``formats.bundle.Bundle``."""
    return cpu_decode_cost(bundle.tensors.values(), bundle.manifest.get("model", {}), hw, context)
