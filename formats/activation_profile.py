"""Activation profiles: how often each expert of each MoE layer is routed to.

Read from ktc's own JSON (written by ``ktc profile`` and the runtime's routing statistics), from a
KTransformers/SGLang expert-distribution ``.pt`` (``logical_count`` shaped [..., layers, experts]),
or made uniform when there is no profile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from ktc.errors import ConfigError, FormatError

from .json_fields import Fields
from .tensor_file import JSON_LIMIT_BYTES, file_size, read_json

PROFILE_FORMAT = "ktc-activation-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True, eq=False)
class ActivationProfile:
    """Routing counts [len(layers), num_experts] for the MoE layers ``layers``."""

    layers: tuple[int, ...]
    counts: np.ndarray = field(repr=False)
    source: str = "uniform"

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.float64)
        if counts.ndim != 2 or counts.shape[0] != len(self.layers):
            raise ConfigError(f"activation profile: counts have shape {counts.shape}, expected "
                              f"[{len(self.layers)} layers, experts]", path=self.source)
        if not np.all(np.isfinite(counts)):
            raise ConfigError("activation profile has NaN or infinite counts", path=self.source)
        if np.any(counts < 0):
            layer, expert = np.argwhere(counts < 0)[0]
            raise ConfigError(f"activation profile has a negative count (layer "
                              f"{self.layers[layer]}, expert {expert})", path=self.source)
        counts.setflags(write=False)
        object.__setattr__(self, "counts", counts)

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    def selection_probability(self, top_k: int) -> np.ndarray:
        """Per layer and expert, the probability that one token routes to the expert.

        Each token picks ``top_k`` experts, so a layer's probabilities sum to ``top_k``. A layer
        with no recorded tokens is taken as uniform.
        """
        totals = self.counts.sum(axis=1, keepdims=True)
        uniform = np.full_like(self.counts, top_k / self.num_experts)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(totals > 0, top_k * self.counts / totals, uniform)
        return np.clip(p, 0.0, 1.0)

    def to_json(self) -> dict[str, object]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "layers": list(self.layers),
                "num_experts": self.num_experts, "counts": self.counts.tolist()}

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)


def uniform_profile(layers: tuple[int, ...], num_experts: int) -> ActivationProfile:
    return ActivationProfile(layers, np.ones((len(layers), num_experts)), "uniform")


def load_activation_profile(path: str, *, moe_layers: tuple[int, ...], num_layers: int,
                            num_experts: int) -> ActivationProfile:
    """Read a profile and check it against the model: ``moe_layers`` are the model's MoE layer
    indices, ``num_layers`` its decoder layers. A ``.pt`` may cover every decoder layer (dense
    layers then hold zeros, as SGLang writes it) or just the MoE layers."""
    if path.endswith((".pt", ".pth", ".bin")):
        counts, layers = _load_pt(path, moe_layers, num_layers)
    else:
        counts, layers = _load_json(path)
    if counts.shape[1] != num_experts:
        raise ConfigError(f"activation profile has {counts.shape[1]} experts per layer; the model has "
                          f"{num_experts}", path=path, hint="was it recorded on another model?")
    if layers != moe_layers:
        raise ConfigError(f"activation profile covers layers {list(layers)[:6]}...; the model's MoE "
                          f"layers are {list(moe_layers)[:6]}...", path=path,
                          hint="was it recorded on another model?")
    return ActivationProfile(layers, counts, path)


def _load_json(path: str) -> tuple[np.ndarray, tuple[int, ...]]:
    fields = Fields(read_json(path, "activation profile"), path, "activation profile")
    if fields.string("format", default="") != PROFILE_FORMAT:
        raise FormatError(f"not a ktc activation profile (expected \"format\": \"{PROFILE_FORMAT}\")",
                          path=path)
    fields.version(PROFILE_VERSION)
    layers = fields.items("layers")
    rows = fields.items("counts")
    for i, layer in enumerate(layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise fields.error("layers", f"must hold layer indices; item {i} is {layer!r}")
    if len(rows) != len(layers):
        raise fields.error("counts", f"has {len(rows)} rows for {len(layers)} layers")
    width = fields.integer("num_experts", default=len(rows[0]) if rows and isinstance(rows[0], list) else 0,
                           minimum=1)
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            raise fields.error("counts", f"row {i} is not a list of {width} counts (one per expert)")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
            raise fields.error("counts", f"row {i} holds something other than numbers")
    return np.array(rows, dtype=np.float64).reshape(len(rows), width), tuple(layers)


def _load_pt(path: str, moe_layers: tuple[int, ...], num_layers: int) -> tuple[np.ndarray, tuple[int, ...]]:
    import torch

    if file_size(path) > JSON_LIMIT_BYTES:
        raise FormatError(f"expert distribution is larger than {JSON_LIMIT_BYTES >> 20} MiB; not read",
                          path=path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FormatError("activation profile not found", path=path) from None
    except Exception as exc:  # torch raises many types for damaged or unsafe files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FormatError(f"cannot read expert distribution: {first[:200]}", path=path) from exc
    tensor = data.get("logical_count") if isinstance(data, dict) else data
    if not isinstance(tensor, torch.Tensor):
        raise FormatError("expected a dict with a 'logical_count' tensor (KTransformers/SGLang "
                          "expert distribution)", path=path)
    counts = tensor.detach().to(torch.float64).numpy()
    if counts.ndim < 2 or 0 in counts.shape:
        raise ConfigError(f"logical_count has shape {tuple(counts.shape)}; expected [..., layers, experts]",
                          path=path)
    counts = counts.reshape(-1, *counts.shape[-2:]).sum(axis=0)
    if counts.shape[0] == num_layers and num_layers != len(moe_layers):
        counts = counts[list(moe_layers)]
    elif counts.shape[0] != len(moe_layers):
        raise ConfigError(f"logical_count covers {counts.shape[0]} layers; the model has {num_layers} "
                          f"layers, {len(moe_layers)} of them MoE", path=path)
    return counts, moe_layers
