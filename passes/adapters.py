"""Declarative name tables: how each checkpoint layout names its experts, routers and the rest.

A table describes one naming convention; detection (``passes/detect.py``) tries every table
against the tensor names, so a model that reuses a known layout under a new architecture name
(Kimi-K2 ships DeepSeek-V3's names) is found by its structure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ktc.ir import GateUpLayout, TensorRole


@dataclass(frozen=True)
class PerExpertNames:
    """Each expert's weights as separate 2-D tensors: ``{moe}experts.{expert}.{proj}.weight``."""

    gate: str
    up: str
    down: str
    template: str = "experts.{expert}.{proj}.weight"


@dataclass(frozen=True)
class StackedNames:
    """A layer's experts stacked in 3-D tensors, expert index first.

    Either ``gate_up`` (fused, in ``layout`` order) or ``gate`` and ``up``. ``in_out`` says the
    float tensors are stored [E, in, out] (gpt-oss) rather than [E, out, in]; MXFP4 blocks are
    always [E, out, in].
    """

    down: str
    gate_up: str | None = None
    gate: str | None = None
    up: str | None = None
    layout: GateUpLayout = GateUpLayout.SEPARATE
    in_out: bool = False
    gate_up_bias: str | None = None
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None


@dataclass(frozen=True)
class SharedNames:
    """The always-active shared expert(s) of a MoE layer (stored as one wider expert)."""

    gate: str
    up: str
    down: str
    sigmoid_gate: str | None = None  # Qwen2-MoE scales the shared expert by sigmoid(g . x)


@dataclass(frozen=True)
class LayoutTable:
    """One naming convention for MoE checkpoints."""

    name: str
    layer_prefix: str  # "model.layers.{layer}."
    moe_prefix: str  # prefix of the MoE block inside a layer
    router: str
    experts: PerExpertNames | StackedNames
    router_bias: str | None = None
    score_correction_bias: str | None = None
    shared: tuple[SharedNames, ...] = ()
    # (substring, role) rules for the tensors outside routed experts, first match wins.
    roles: tuple[tuple[str, TensorRole], ...] = ()


_HF_ROLES: tuple[tuple[str, TensorRole], ...] = (
    ("embed_tokens", TensorRole.EMBEDDING),
    ("lm_head", TensorRole.EMBEDDING),
    ("wte", TensorRole.EMBEDDING),
    ("norm", TensorRole.NORM),
    ("self_attn.", TensorRole.ATTENTION),
    ("shared_expert", TensorRole.SHARED_EXPERT),
    (".gate.", TensorRole.ROUTER),
    (".router.", TensorRole.ROUTER),
    ("mlp.", TensorRole.DENSE_MLP),
)

_GGUF_ROLES: tuple[tuple[str, TensorRole], ...] = (
    ("_norm", TensorRole.NORM),
    ("attn_", TensorRole.ATTENTION),
    ("token_embd", TensorRole.EMBEDDING),
    ("output.", TensorRole.EMBEDDING),
    ("_shexp", TensorRole.SHARED_EXPERT),
    ("ffn_gate_inp", TensorRole.ROUTER),
    ("exp_probs_b", TensorRole.ROUTER),
    ("ffn_", TensorRole.DENSE_MLP),
)

_HF_PROJ = PerExpertNames(gate="gate_proj", up="up_proj", down="down_proj")
_HF_SHARED = (
    SharedNames("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight", sigmoid_gate="shared_expert_gate.weight"),
    SharedNames("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                "shared_experts.down_proj.weight"),
)

LAYOUTS: tuple[LayoutTable, ...] = (
    # Mixtral: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down).
    LayoutTable(
        name="mixtral",
        layer_prefix="model.layers.{layer}.",
        moe_prefix="block_sparse_moe.",
        router="gate.weight",
        experts=PerExpertNames(gate="w1", up="w3", down="w2"),
        roles=_HF_ROLES,
    ),
    # Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3 (and Kimi-K2, GLM-4.5): mlp.experts.{e}.*_proj,
    # with the optional shared expert(s) and DeepSeek-V3's score-correction bias.
    LayoutTable(
        name="hf_mlp_experts",
        layer_prefix="model.layers.{layer}.",
        moe_prefix="mlp.",
        router="gate.weight",
        experts=_HF_PROJ,
        score_correction_bias="gate.e_score_correction_bias",
        shared=_HF_SHARED,
        roles=_HF_ROLES,
    ),
    # transformers' in-memory fused experts: experts.gate_up_proj [E, 2I, H] = [gate; up].
    LayoutTable(
        name="hf_fused_experts",
        layer_prefix="model.layers.{layer}.",
        moe_prefix="mlp.",
        router="gate.weight",
        experts=StackedNames(gate_up="experts.gate_up_proj", down="experts.down_proj",
                             layout=GateUpLayout.CONCATENATED),
        score_correction_bias="gate.e_score_correction_bias",
        shared=_HF_SHARED,
        roles=_HF_ROLES,
    ),
    # gpt-oss: router with bias; gate_up_proj [E, H, 2I] with gate and up interleaved, biases.
    LayoutTable(
        name="gpt_oss",
        layer_prefix="model.layers.{layer}.",
        moe_prefix="mlp.",
        router="router.weight",
        router_bias="router.bias",
        experts=StackedNames(gate_up="experts.gate_up_proj", down="experts.down_proj",
                             layout=GateUpLayout.INTERLEAVED, in_out=True,
                             gate_up_bias="experts.gate_up_proj_bias",
                             down_bias="experts.down_proj_bias"),
        roles=_HF_ROLES,
    ),
    # llama.cpp's GGUF names: blk.N.ffn_{gate,up,down}_exps.weight [E, out, in] (numpy order).
    LayoutTable(
        name="gguf",
        layer_prefix="blk.{layer}.",
        moe_prefix="",
        router="ffn_gate_inp.weight",
        router_bias="ffn_gate_inp.bias",
        score_correction_bias="exp_probs_b.bias",
        experts=StackedNames(gate="ffn_gate_exps.weight", up="ffn_up_exps.weight",
                             down="ffn_down_exps.weight", gate_bias="ffn_gate_exps.bias",
                             up_bias="ffn_up_exps.bias", down_bias="ffn_down_exps.bias"),
        shared=(SharedNames("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                            sigmoid_gate="ffn_gate_inp_shexp.weight"),),
        roles=_GGUF_ROLES,
    ),
    # GGUF with gate and up fused: blk.N.ffn_gate_up_exps.weight [E, 2I, H] = [gate; up].
    LayoutTable(
        name="gguf_fused",
        layer_prefix="blk.{layer}.",
        moe_prefix="",
        router="ffn_gate_inp.weight",
        router_bias="ffn_gate_inp.bias",
        score_correction_bias="exp_probs_b.bias",
        experts=StackedNames(gate_up="ffn_gate_up_exps.weight", down="ffn_down_exps.weight",
                             layout=GateUpLayout.CONCATENATED, down_bias="ffn_down_exps.bias"),
        shared=(SharedNames("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                            sigmoid_gate="ffn_gate_inp_shexp.weight"),),
        roles=_GGUF_ROLES,
    ),
)

# model_type (Hugging Face) or general.architecture (GGUF) -> family.
KNOWN_FAMILIES: dict[str, str] = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
}

SUPPORTED_LAYOUTS_TEXT = (
    "Mixtral (block_sparse_moe.experts.N.w1/w2/w3), Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V2/V3 "
    "(mlp.experts.N.gate_proj/up_proj/down_proj), fused experts (mlp.experts.gate_up_proj), "
    "gpt-oss (mlp.router + experts.gate_up_proj), GGUF (blk.N.ffn_{gate,up,down}_exps, "
    "ffn_gate_up_exps)"
)
