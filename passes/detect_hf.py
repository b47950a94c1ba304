"""Find the experts from transformers' own model structure, when transformers is installed.

The model class of the checkpoint's ``config.json`` is built on the meta device; its experts
modules (the classes decorated with ``@use_experts_implementation``) say which layers are MoE,
how many experts each has, their width and, from the router next to them, the top-k, whatever
the config calls these (``moe_k``, ``moe_topk``, ``num_experts_per_tok``, ...). The checkpoint's
tensor names are mapped onto those modules' parameters the way transformers' own loading maps
them (its checkpoint conversion mapping: per-expert ``w1``/``w3`` tensors stacked into
``gate_up_proj``, and so on). The result is a ``LayoutTable`` like the declarative ones in
``adapters.py``, so everything after (shape checks, the IR) is shared: a family transformers
implements with its experts interface needs no table of its own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ktc.formats.checkpoint import Checkpoint
from ktc.formats.transformers_model import (
    config_from_dict, hf_name_map, import_transformers, is_experts_module, meta_model,
)
from ktc.ir import GateUpLayout

from .adapters import _HF_ROLES, LayoutTable, PerExpertNames, SharedNames, StackedNames

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_k", "moe_topk", "experts_per_token")
# KTC_NO_TRANSFORMERS_DETECTION=1 detects with the declarative tables only.
DISABLE_ENV = "KTC_NO_TRANSFORMERS_DETECTION"


@dataclass(frozen=True)
class DerivedLayout:
    """What transformers' structure says about a checkpoint's experts."""

    table: LayoutTable
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    intermediate_size: int
    num_layers: int


class _NotDerivable(Exception):
    """The structure does not fit a layout table (the declarative tables are tried instead)."""


def derive_layout(ckpt: Checkpoint) -> DerivedLayout | None:
    """The checkpoint's layout from transformers' model structure, or None when transformers is
    not installed, does not know the model type, routes no experts through its experts
    interface, or names them in a way a layout table cannot describe."""
    if ckpt.format == "gguf" or not ckpt.raw_config or os.environ.get(DISABLE_ENV):
        return None
    try:
        transformers = import_transformers()
        config = config_from_dict(transformers, ckpt.raw_config, ckpt.path)
        model = meta_model(transformers, config, path=ckpt.path)
    except Exception:  # not installed, an unknown type, a config its class rejects: the tables decide
        return None
    experts = [(name, module) for name, module in model.named_modules() if is_experts_module(module)]
    if not experts:
        return None
    try:
        return _derive(ckpt, model, experts)
    except _NotDerivable:
        return None


def _derive(ckpt: Checkpoint, model: Any, experts: list[tuple[str, Any]]) -> DerivedLayout:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    rename = hf_name_map(model)
    converters = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightConverter)]
    by_param: dict[str, list[tuple[str, str | None]]] = {}
    for name in ckpt.tensors:
        key, pattern = rename(name)
        by_param.setdefault(key, []).append((name, pattern))
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))

    layers: dict[int, dict[str, Any]] = {}
    for path, module in experts:
        match = _LAYER.search(path + ".")
        if match is None:
            raise _NotDerivable(path)
        layers[int(match.group(1))] = _layer_names(path, module, by_param, params, converters, model)
    first = min(layers)
    names = layers[first]
    tables = {layer: _table(info, layer) for layer, info in layers.items()}
    table = tables[first]
    if any(t != table for t in tables.values()):
        raise _NotDerivable("layers are named differently")
    return DerivedLayout(table, tuple(sorted(layers)), names["num_experts"], names["top_k"],
                         names["intermediate"], int(model.config.get_text_config(decoder=True).num_hidden_layers))


def _checkpoint_name(by_param: dict[str, list[tuple[str, str | None]]], key: str) -> str | None:
    sources = by_param.get(key) or []
    return sources[0][0] if len(sources) == 1 and sources[0][1] is None else None


def _layer_names(path: str, module: Any, by_param: dict[str, list[tuple[str, str | None]]],
                 params: dict[str, Any], converters: list[Any], model: Any) -> dict[str, Any]:
    """Checkpoint names of one layer's experts, router, biases and shared experts."""
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        raise _NotDerivable("experts without a gate, or with a norm after each expert")
    gate_up = params.get(f"{path}.gate_up_proj")
    down = params.get(f"{path}.down_proj")
    if gate_up is None or down is None:
        raise _NotDerivable("no gate_up_proj/down_proj")
    num_experts = int(gate_up.shape[0])
    hidden = int(model.config.get_text_config(decoder=True).hidden_size)
    intermediate = int(down.shape[1] if module.is_transposed else down.shape[2])
    info: dict[str, Any] = {"num_experts": num_experts, "intermediate": intermediate, "module": module}
    stacked = _checkpoint_name(by_param, f"{path}.gate_up_proj")
    if stacked is not None:
        info["stacked"] = (stacked, _checkpoint_name(by_param, f"{path}.down_proj"),
                           _checkpoint_name(by_param, f"{path}.gate_up_proj_bias"),
                           _checkpoint_name(by_param, f"{path}.down_proj_bias"))
        if info["stacked"][1] is None:
            raise _NotDerivable("stacked gate_up without a stacked down")
    else:
        info["per_expert"] = {proj: _expert_template(by_param, f"{path}.{param}", index, converters)
                              for proj, param, index in (("gate", "gate_up_proj", 0), ("up", "gate_up_proj", 1),
                                                         ("down", "down_proj", 0))}
    block = path.rpartition(".")[0]
    block_module = model.get_submodule(block)
    router_bias = score = None
    candidates = []
    for name, value in params.items():
        if not name.startswith(block + ".") or name.startswith(path + "."):
            continue
        shape = tuple(value.shape)
        if name.endswith("e_score_correction_bias") and shape == (num_experts,):
            score = _checkpoint_name(by_param, name)
        elif name.endswith(".weight") and shape == (num_experts, hidden):
            candidates.append(name)
    # The router scores every expert: a [experts, hidden] matrix; by name first, should a shared
    # expert's matrix happen to have that shape too.
    candidates.sort(key=lambda n: not any(k in n[len(block):] for k in (".gate.", "router")))
    if not candidates:
        raise _NotDerivable("no router")
    router = candidates[0]
    bias_name = router[: -len("weight")] + "bias"
    if bias_name in params:
        router_bias = _checkpoint_name(by_param, bias_name)
    info["router"] = _checkpoint_name(by_param, router)
    info["router_bias"] = router_bias
    info["score_correction_bias"] = score
    info["shared"] = _shared(block, block_module, by_param, hidden)
    info["top_k"] = _top_k(block_module, model)
    if info["router"] is None:
        raise _NotDerivable("router not in the checkpoint")
    return info


def _expert_template(by_param: dict[str, list[tuple[str, str | None]]], key: str, index: int,
                     converters: list[Any]) -> str:
    """``model.layers.L.mlp.experts.{expert}.gate_proj.weight``: the checkpoint names that a
    converter stacks into ``key``, source pattern ``index`` (0: gate, 1: up of a gate_up)."""
    for name, pattern in by_param.get(key) or []:
        if pattern is None:
            continue
        converter = next((c for c in converters if pattern in c.source_patterns), None)
        if converter is None or converter.source_patterns.index(pattern) != index:
            continue
        regex = re.escape(pattern.lstrip("^").rstrip("$")).replace(r"\*", r"(\d+)")
        found = re.search(regex, name)
        if found is None:
            raise _NotDerivable(f"cannot find the expert number in {name}")
        start, end = found.span(1)
        return name[:start] + "{expert}" + name[end:]
    raise _NotDerivable(f"no per-expert checkpoint tensors for {key}")


def _shared(block: str, module: Any, by_param: dict[str, list[tuple[str, str | None]]],
            hidden: int) -> tuple[str, str, str, str | None] | None:
    """Checkpoint names of the block's shared expert (gate, up, down, sigmoid gate)."""
    for child_name, child in module.named_children():
        if "shared" not in child_name or not all(hasattr(child, p) for p in ("gate_proj", "up_proj", "down_proj")):
            continue
        names = [_checkpoint_name(by_param, f"{block}.{child_name}.{p}.weight")
                 for p in ("gate_proj", "up_proj", "down_proj")]
        if None in names:
            raise _NotDerivable("shared expert not in the checkpoint")
        sigmoid = None
        for other_name, other in module.named_children():
            weight = getattr(other, "weight", None)
            if "shared" in other_name and other_name != child_name and weight is not None \
                    and tuple(weight.shape) == (1, hidden):
                sigmoid = _checkpoint_name(by_param, f"{block}.{other_name}.weight")
        return names[0], names[1], names[2], sigmoid
    return None


def _top_k(block: Any, model: Any) -> int:
    """Experts per token, from the MoE block or its router (the modules hold it as an attribute
    whatever the config key was)."""
    for module in (block, *block.children()):
        for attr in _TOP_K_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    value = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None)
    if isinstance(value, int) and value > 0:
        return value
    raise _NotDerivable("no top-k")


def _table(info: dict[str, Any], layer: int) -> LayoutTable:
    """A layout table (names relative to the layer) from one layer's checkpoint names."""
    marker = f"layers.{layer}."
    router = info["router"]
    names = [router]
    if "stacked" in info:
        names += [n for n in info["stacked"] if n]
    else:
        names += list(info["per_expert"].values())
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]
    at = prefix.find(marker)
    if at < 0:
        raise _NotDerivable("names do not carry the layer number")
    layer_prefix = prefix[: at + len(marker)]
    moe_prefix = prefix[at + len(marker):]
    rel = lambda name: name[len(prefix):] if name else None  # noqa: E731
    if "stacked" in info:
        gate_up, down, gate_up_bias, down_bias = info["stacked"]
        module = info["module"]
        experts: PerExpertNames | StackedNames = StackedNames(
            down=rel(down), gate_up=rel(gate_up), gate_up_bias=rel(gate_up_bias), down_bias=rel(down_bias),
            layout=GateUpLayout.CONCATENATED if module.is_concatenated else GateUpLayout.INTERLEAVED,
            in_out=bool(module.is_transposed))
    else:
        gate, up, down = (rel(info["per_expert"][p]) for p in ("gate", "up", "down"))
        head = os.path.commonprefix([gate, up, down])
        tail = os.path.commonprefix([gate[::-1], up[::-1], down[::-1]])[::-1]
        if "{expert}" not in head or len(head) + len(tail) > min(map(len, (gate, up, down))):
            raise _NotDerivable("expert names do not share a template")
        middle = lambda name: name[len(head): len(name) - len(tail)]  # noqa: E731
        experts = PerExpertNames(gate=middle(gate), up=middle(up), down=middle(down),
                                 template=head + "{proj}" + tail)
    shared = ()
    if info["shared"] is not None:
        gate, up, down, sigmoid = info["shared"]
        if not all(n.startswith(prefix) for n in (gate, up, down)):
            raise _NotDerivable("the shared expert lies outside the MoE block")
        shared = (SharedNames(rel(gate), rel(up), rel(down), rel(sigmoid) if sigmoid else None),)
    for name in (info["router_bias"], info["score_correction_bias"]):
        if name and not name.startswith(prefix):
            raise _NotDerivable("router biases outside the MoE block")
    return LayoutTable(name="transformers", layer_prefix=layer_prefix.replace(marker, "layers.{layer}."),
                       moe_prefix=moe_prefix, router=rel(router), experts=experts,
                       router_bias=rel(info["router_bias"]), score_correction_bias=rel(info["score_correction_bias"]),
                       shared=shared, roles=_HF_ROLES)
