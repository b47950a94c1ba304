"""The runtime: open a bundle (zero-copy), run its MoE layers (Numba CPU kernels beside torch
device experts), record routing counts. Imports neither click, networkx nor transformers."""

from ktc.formats.bundle import Bundle, open_bundle

from .moe import MoELayer, moe_layers, routing_profile

__all__ = ["Bundle", "MoELayer", "moe_layers", "open_bundle", "routing_profile"]
