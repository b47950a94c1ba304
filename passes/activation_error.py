"""Each scheme's error on the activations that reach a model's experts (``--calibration-text``).

The planner's quality term weighs a scheme's nominal error: its relative RMS error on Gaussian
weights. What a model loses is the error of each expert's *output* on the hidden states its
router sends it: the weights' error times the activations that reach them (a few large input
channels make some weights matter more than others). Given those hidden states (captured from
the source model over a text: ``runtime.activations``), this measures, per MoE layer and scheme,
the relative error of the experts' outputs when their weights are stored in the scheme:

    || E_q(X_e) - E(X_e) ||_F / || E(X_e) ||_F

over the tokens ``X_e`` routed to expert ``e``, summed over the layer's most chosen experts
(``experts_per_layer``). ``E(x) = down(act(gate x) * up x)``, in float32 with the source's
weights; ``E_q`` the same with each matrix quantized and decoded back by the scheme's codec.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ktc.errors import ConfigError
from ktc.formats.dequant import to_float32
from ktc.formats.quantize import dequantize, quantize
from ktc.formats.schemes import expert_schemes
from ktc.ir import Activation, Expert, ModelIR

MIN_TOKENS = 16  # fewer routed tokens than this: the expert is measured on all the layer's tokens


def _output(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    g = x @ gate.T
    return (g / (1.0 + np.exp(-g)) * (x @ up.T)) @ down.T


def _round_trip(values: np.ndarray, scheme: str) -> np.ndarray:
    return dequantize(np.ascontiguousarray(quantize(values, scheme)).view(np.uint8).reshape(values.shape[0], -1),
                      scheme, values.shape[1])


def expert_errors(expert: Expert, x: np.ndarray, schemes: tuple[str, ...]) -> tuple[np.ndarray, float]:
    """(squared output error of ``expert`` on the rows ``x`` for each expert scheme name in
    ``schemes``, squared norm of its exact output)."""
    gate, up, down = (to_float32(ref).reshape(ref.shape) for ref in (expert.gate, expert.up, expert.down))
    exact = _output(gate, up, down, x)
    errors = np.empty(len(schemes))
    for i, name in enumerate(schemes):
        gu, dn = (s.name for s in expert_schemes(name))
        got = _output(_round_trip(gate, gu), _round_trip(up, gu), _round_trip(down, dn), x)
        errors[i] = float(np.sum((got - exact).astype(np.float64) ** 2))
    return errors, float(np.sum(exact.astype(np.float64) ** 2))


def layer_scheme_errors(ir: ModelIR, inputs: Mapping[int, tuple[np.ndarray, np.ndarray]],
                        schemes: tuple[str, ...], experts_per_layer: int = 4) -> dict[str, tuple[float, ...]]:
    """Per expert scheme name, the relative output error of each MoE layer's experts (in
    ``ir.moe_layer_indices`` order) on ``inputs``: per layer, (hidden states [T, hidden] entering
    its experts, chosen expert ids [T, top_k])."""
    errors = np.zeros((len(ir.moe_layers), len(schemes)))
    for li, layer in enumerate(ir.moe_layers):
        if layer.activation is not Activation.SILU:
            raise ConfigError(f"--calibration-text measures SiLU experts; layer {layer.layer}'s are "
                              f"{layer.activation.value}")
        if layer.layer not in inputs:
            raise ConfigError(f"no hidden states were captured for MoE layer {layer.layer}")
        x, chosen = inputs[layer.layer]
        x = np.asarray(x, dtype=np.float32)
        counts = np.bincount(np.asarray(chosen).reshape(-1), minlength=len(layer.experts))
        squared, reference = np.zeros(len(schemes)), 0.0
        for e in np.argsort(-counts, kind="stable")[:experts_per_layer]:
            rows = x[(np.asarray(chosen) == e).any(axis=1)]
            got, ref = expert_errors(layer.experts[int(e)], rows if len(rows) >= MIN_TOKENS else x, schemes)
            squared += got
            reference += ref
        errors[li] = np.sqrt(squared / reference) if reference > 0 else 0.0
    return {name: tuple(float(v) for v in errors[:, i]) for i, name in enumerate(schemes)}
