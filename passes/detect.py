"""Find the experts: turn a checkpoint's tensor names into ``MoELayer``s with an adapter table."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from ktc.errors import ConfigError, InternalError, UnsupportedModelError
from ktc.formats.checkpoint import Checkpoint
from ktc.ir import (
    Activation, DenseTensor, Expert, GateUpLayout, ModelConfig, ModelIR, MoELayer, Slice, Take,
    TensorRef, TensorRole, Transpose,
)

from .adapters import (
    KNOWN_FAMILIES, LAYOUTS, SUPPORTED_LAYOUTS_TEXT, LayoutTable, PerExpertNames,
    StackedNames,
)
from .base import Pass, PassContext
from .detect_hf import DerivedLayout, derive_layout

_EXPERT_LIKE = re.compile(r"expert|_exps|moe|router|ffn_gate_inp", re.IGNORECASE)


@dataclass(frozen=True)
class _Match:
    table: LayoutTable
    layers: tuple[int, ...]


def _layers_named(layer_prefix: str, names: set[str]) -> list[int]:
    """The layer numbers that tensor names hold under ``layer_prefix`` ("blk.{layer}.")."""
    pattern = re.compile(re.escape(layer_prefix).replace(re.escape("{layer}"), r"(\d+)"))
    return sorted({int(m.group(1)) for m in map(pattern.match, names) if m is not None})


def _find_layers(table: LayoutTable, names: set[str], num_layers: int) -> tuple[int, ...]:
    # The layers the names hold, not range(num_layers): a damaged config's count can be 2**31.
    found = []
    for layer in (n for n in _layers_named(table.layer_prefix, names) if n < num_layers):
        prefix = table.layer_prefix.format(layer=layer) + table.moe_prefix
        if prefix + table.router not in names:
            continue
        experts = table.experts
        if isinstance(experts, PerExpertNames):
            probe = prefix + experts.template.format(expert=0, proj=experts.gate)
        else:
            probe = prefix + (experts.gate_up or experts.gate or "")
        if probe in names:
            found.append(layer)
    return tuple(found)


def _choose_layout(ckpt: Checkpoint) -> _Match:
    names = set(ckpt.tensors)
    best: _Match | None = None
    for table in LAYOUTS:
        layers = _find_layers(table, names, ckpt.config.num_layers)
        if layers and (best is None or len(layers) > len(best.layers)):
            best = _Match(table, layers)
    if best is None:
        if ckpt.config.num_experts <= 0 and not any(_EXPERT_LIKE.search(n) for n in names):
            raise UnsupportedModelError(
                f"this model has no experts: architecture '{ckpt.config.architecture}' is a dense model "
                "(no expert count in its config, no expert tensors)", path=ckpt.path,
                hint="ktc plans and compiles Mixture-of-Experts models; run a dense model with "
                     "llama.cpp or transformers as it is")
        raise _unsupported(ckpt, "no tensor names match a known Mixture-of-Experts layout")
    named = _layers_named(best.table.layer_prefix, names)
    if ckpt.config.num_layers > named[-1] + 1:
        raise ConfigError(f"the config gives {ckpt.config.num_layers} layers; the tensors hold layers "
                          f"up to {named[-1]}", path=ckpt.path,
                          hint="the config (or GGUF block_count) is damaged, or shards are missing")
    if ckpt.config.num_experts <= 0 or ckpt.config.top_k <= 0:
        raise _unsupported(ckpt, f"the tensors follow the '{best.table.name}' layout but the config "
                                 "gives no expert count and top-k under a known key "
                                 "(num_local_experts / num_experts / n_routed_experts and "
                                 "num_experts_per_tok)")
    return best


def _unsupported(ckpt: Checkpoint, why: str) -> UnsupportedModelError:
    expert_like = sorted(n for n in ckpt.tensors if _EXPERT_LIKE.search(n))
    shown = ", ".join(expert_like[:8]) + (f" (+{len(expert_like) - 8} more)" if len(expert_like) > 8 else "")
    return UnsupportedModelError(
        f"architecture '{ckpt.config.architecture}' (model_type '{ckpt.config.model_type}'): {why}; "
        f"tensors that look like experts: {shown or 'none'}",
        path=ckpt.path, hint=f"supported layouts: {SUPPORTED_LAYOUTS_TEXT}")


def family_of(config: ModelConfig, table: LayoutTable, names: set[str], layer_prefix: str) -> str:
    """The model family: from the architecture name when known, else from the layout's features."""
    known = KNOWN_FAMILIES.get(config.model_type)
    if config.model_type == "deepseek2" or known == "deepseek_v2":
        has_bias = any(n.startswith(layer_prefix) and n.endswith(
            table.score_correction_bias or "\0") for n in names)
        return "deepseek_v3" if has_bias or config.gating.value == "sigmoid" else "deepseek_v2"
    if known:
        return known
    if config.model_type == "llama" and config.num_experts:
        return "mixtral"  # llama.cpp writes Mixtral as the llama architecture with experts
    if table.name == "mixtral":
        return "mixtral"
    if table.name == "gpt_oss":
        return "gpt_oss"
    has = lambda suffix: any(n.endswith(suffix) for n in names)  # noqa: E731
    if has("e_score_correction_bias") or has("exp_probs_b.bias") or has("shared_experts.gate_proj.weight"):
        return "deepseek_v3"
    if has("shared_expert_gate.weight") or has("ffn_gate_inp_shexp.weight"):
        return "qwen2_moe"
    return "qwen3_moe"


class _Builder:
    """Builds the MoE layers of one checkpoint under one layout table, checking every shape."""

    def __init__(self, ckpt: Checkpoint, table: LayoutTable, cfg: ModelConfig) -> None:
        self.ckpt = ckpt
        self.table = table
        self.cfg = cfg
        self.tensors = ckpt.tensors
        self.used: set[str] = set()

    def get(self, name: str, *, layer: int, required: bool = True) -> TensorRef | None:
        ref = self.tensors.get(name)
        if ref is None:
            if required:
                raise ConfigError(f"layer {layer}: expected tensor is missing", path=self.ckpt.path,
                                  tensor=name)
            return None
        self.used.add(name)
        return ref

    def check_shape(self, ref: TensorRef, expected: tuple[int, ...], what: str) -> None:
        if ref.shape != expected:
            raise ConfigError(f"{what} has shape {ref.shape}; the config implies {expected}",
                              path=self.ckpt.path, tensor=ref.name,
                              hint="the config.json does not belong to these weights")

    def layer(self, layer: int, family: str) -> MoELayer:
        prefix = self.table.layer_prefix.format(layer=layer) + self.table.moe_prefix
        cfg = self.cfg
        router = self.get(prefix + self.table.router, layer=layer)
        assert router is not None
        if router.shape[0] != cfg.num_experts:
            raise ConfigError(f"layer {layer}: the config declares {cfg.num_experts} experts but the "
                              f"router scores {router.shape[0]}", path=self.ckpt.path, tensor=router.name)
        self.check_shape(router, (cfg.num_experts, cfg.hidden_size), f"layer {layer} router")
        if isinstance(self.table.experts, PerExpertNames):
            experts = self.per_expert(layer, prefix, self.table.experts)
        else:
            experts = self.stacked(layer, prefix, self.table.experts)
        inter = experts[0].intermediate_size
        for expert in experts:
            self.check_shape(expert.gate, (inter, cfg.hidden_size), f"layer {layer} expert {expert.index} gate")
            self.check_shape(expert.up, (inter, cfg.hidden_size), f"layer {layer} expert {expert.index} up")
            self.check_shape(expert.down, (cfg.hidden_size, inter), f"layer {layer} expert {expert.index} down")
        opt = lambda name: self.get(prefix + name, layer=layer, required=False) if name else None  # noqa: E731
        shared, shared_gate = self.shared_experts(layer, prefix)
        return MoELayer(
            layer=layer,
            router=router,
            experts=tuple(experts),
            top_k=cfg.top_k,
            gating=cfg.gating,
            norm_topk_prob=cfg.norm_topk_prob,
            activation=Activation.SWIGLU_CLAMPED if family == "gpt_oss" else Activation.SILU,
            router_bias=opt(self.table.router_bias),
            score_correction_bias=opt(self.table.score_correction_bias),
            shared_experts=shared,
            shared_expert_gate=shared_gate,
            routed_scaling_factor=cfg.routed_scaling_factor,
            num_groups=cfg.num_expert_groups,
            topk_groups=cfg.topk_groups,
        )

    def per_expert(self, layer: int, prefix: str, names: PerExpertNames) -> list[Expert]:
        n = self.cfg.num_experts
        experts = []
        present = sum(1 for e in range(n + 1)
                      if prefix + names.template.format(expert=e, proj=names.gate) in self.tensors)
        extra = prefix + names.template.format(expert=n, proj=names.gate)
        if extra in self.tensors:
            raise ConfigError(f"layer {layer}: the config declares {n} experts but the checkpoint has "
                              f"more (found '{extra}')", path=self.ckpt.path, tensor=extra)
        for e in range(n):
            def ref(proj: str) -> TensorRef:
                name = prefix + names.template.format(expert=e, proj=proj)
                found = self.get(name, layer=layer, required=False)
                if found is None:
                    raise ConfigError(f"layer {layer}: the config declares {n} experts but {present} "
                                      f"are present (expert {e} missing)", path=self.ckpt.path, tensor=name)
                return found
            experts.append(Expert(layer, e, gate=ref(names.gate), up=ref(names.up), down=ref(names.down)))
        return experts

    def stacked(self, layer: int, prefix: str, names: StackedNames) -> list[Expert]:
        n, hidden = self.cfg.num_experts, self.cfg.hidden_size
        req = lambda name: self.get(prefix + name, layer=layer)  # noqa: E731
        opt = lambda name: self.get(prefix + name, layer=layer, required=False) if name else None  # noqa: E731
        down = req(names.down)
        assert down is not None
        stacked_refs = [down]
        if names.gate_up:
            gate_up = req(names.gate_up)
            assert gate_up is not None
            stacked_refs.append(gate_up)
        else:
            gate_s, up_s = req(names.gate or ""), req(names.up or "")
            assert gate_s is not None and up_s is not None
            stacked_refs += [gate_s, up_s]
        for ref in stacked_refs:
            if len(ref.shape) != 3 or ref.shape[0] != n:
                raise ConfigError(f"layer {layer}: the config declares {n} experts but the stacked "
                                  f"tensor has shape {ref.shape}", path=self.ckpt.path, tensor=ref.name)
        in_out = names.in_out and down.dtype != "MXFP4_BLOCKS"
        inter = down.shape[1] if in_out else down.shape[2]
        flip = (Transpose(),) if in_out else ()
        experts = []
        for e in range(n):
            take = Take(0, e)
            if names.gate_up:
                if names.layout is GateUpLayout.INTERLEAVED:
                    gate_sl, up_sl = Slice(0, 0, 2 * inter, 2), Slice(0, 1, 2 * inter, 2)
                else:
                    gate_sl, up_sl = Slice(0, 0, inter), Slice(0, inter, 2 * inter)
                if in_out:  # [E, in, out]: after Take the output axis is 1
                    gate_sl = Slice(1, gate_sl.start, gate_sl.stop, gate_sl.step)
                    up_sl = Slice(1, up_sl.start, up_sl.stop, up_sl.step)
                gate = gate_up.with_view(take, gate_sl, *flip)
                up = gate_up.with_view(take, up_sl, *flip)
                bias = opt(names.gate_up_bias)
                gate_bias = bias.with_view(take, Slice(0, gate_sl.start, gate_sl.stop, gate_sl.step)) if bias else None
                up_bias = bias.with_view(take, Slice(0, up_sl.start, up_sl.stop, up_sl.step)) if bias else None
                layout = names.layout
            else:
                gate, up = gate_s.with_view(take), up_s.with_view(take)
                gb, ub = opt(names.gate_bias), opt(names.up_bias)
                gate_bias = gb.with_view(take) if gb else None
                up_bias = ub.with_view(take) if ub else None
                layout = GateUpLayout.SEPARATE
            db = opt(names.down_bias)
            experts.append(Expert(layer, e, gate=gate, up=up, down=down.with_view(take, *flip),
                                  gate_bias=gate_bias, up_bias=up_bias,
                                  down_bias=db.with_view(take) if db else None, source_layout=layout))
        if experts and experts[0].down.shape != (hidden, inter):
            raise ConfigError(f"layer {layer}: stacked down projection {down.shape} does not fit "
                              f"hidden size {hidden}", path=self.ckpt.path, tensor=down.name)
        return experts

    def shared_experts(self, layer: int, prefix: str) -> tuple[tuple[Expert, ...], TensorRef | None]:
        for names in self.table.shared:
            gate = self.get(prefix + names.gate, layer=layer, required=False)
            if gate is None:
                continue
            up = self.get(prefix + names.up, layer=layer)
            down = self.get(prefix + names.down, layer=layer)
            assert up is not None and down is not None
            sigmoid_gate = (self.get(prefix + names.sigmoid_gate, layer=layer, required=False)
                            if names.sigmoid_gate else None)
            inter = gate.shape[0]
            self.check_shape(up, (inter, self.cfg.hidden_size), f"layer {layer} shared expert up")
            self.check_shape(down, (self.cfg.hidden_size, inter), f"layer {layer} shared expert down")
            return (Expert(layer, -1, gate=gate, up=up, down=down),), sigmoid_gate
        return (), None


def role_of(name: str, table: LayoutTable) -> TensorRole:
    for marker, role in table.roles:
        if marker in name:
            return role
    return TensorRole.OTHER


_LAYER_NUMBER = re.compile(r"(?:layers|blk)\.(\d+)\.")


def _with_structure(cfg: ModelConfig, derived: DerivedLayout) -> ModelConfig:
    """The config with the expert facts transformers' model structure gave."""
    dense = tuple(layer for layer in range(derived.num_layers) if layer not in derived.moe_layers)
    return replace(cfg, num_experts=derived.num_experts, top_k=derived.top_k,
                   expert_intermediate_size=derived.intermediate_size, moe_layer_step=1, dense_layers=dense)


def build_ir(ckpt: Checkpoint, *, use_transformers: bool = True) -> ModelIR:
    """Detect the experts of an opened checkpoint and return its ``ModelIR``.

    With transformers installed (and ``use_transformers``), Hugging Face checkpoints are read
    through the model structure transformers builds for their config (``detect_hf``); the
    declarative tables read GGUF files, checkpoints transformers does not know, and everything
    when transformers is not installed."""
    cfg = ckpt.config
    names = set(ckpt.tensors)
    derived = derive_layout(ckpt) if use_transformers else None
    match = None
    if derived is not None:
        layers = _find_layers(derived.table, names, cfg.num_layers)
        if layers == derived.moe_layers:
            cfg = _with_structure(cfg, derived)
            match = _Match(derived.table, layers)
    if match is None:
        match = _choose_layout(ckpt)
    expected = tuple(layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer))
    if match.layers != expected:
        missing = sorted(set(expected) - set(match.layers))
        extra = sorted(set(match.layers) - set(expected))
        detail = []
        if missing:
            detail.append(f"layers {missing} have no experts although the config says they should")
        if extra:
            detail.append(f"layers {extra} have experts although the config says they are dense")
        raise ConfigError("; ".join(detail), path=ckpt.path,
                          hint="the config (first_k_dense_replace, decoder_sparse_step, "
                               "mlp_only_layers) does not match the weights")
    if match.table.name == "transformers" and cfg.model_type not in KNOWN_FAMILIES:
        family = cfg.model_type  # a family known by its transformers structure alone
    else:
        family = family_of(cfg, match.table, names, match.table.layer_prefix.format(layer=match.layers[0]))
    builder = _Builder(ckpt, match.table, cfg)
    layers = tuple(builder.layer(layer, family) for layer in match.layers)
    dense = []
    for name in sorted(ckpt.tensors):
        if name in builder.used:
            continue
        number = _LAYER_NUMBER.search(name)
        layer = int(number.group(1)) if number else None
        # Layers past num_layers are extras such as DeepSeek-V3's multi-token-prediction layer.
        role = (TensorRole.OTHER if layer is not None and layer >= cfg.num_layers
                else role_of(name, match.table))
        dense.append(DenseTensor(ckpt.tensors[name], role, layer))
    return ModelIR(family=family, config=cfg, source=ckpt.source, moe_layers=layers,
                   dense=tuple(dense))


class DetectExperts(Pass):
    """Build the IR's MoE layers and dense tensors from an opened checkpoint."""

    name: ClassVar[str] = "detect"
    requires: ClassVar[frozenset[str]] = frozenset({"checkpoint"})
    produces: ClassVar[frozenset[str]] = frozenset({"config", "experts", "dense"})

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        return build_ir(self.checkpoint)

    def verify(self, ir: ModelIR) -> None:
        for layer in ir.moe_layers:
            if len(layer.experts) != ir.config.num_experts:
                raise InternalError(f"layer {layer.layer}: {len(layer.experts)} experts built, "
                                    f"{ir.config.num_experts} declared")
            if not 1 <= layer.top_k <= len(layer.experts):
                raise InternalError(f"layer {layer.layer}: top_k {layer.top_k} out of range")
