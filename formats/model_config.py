"""One typed ``ModelConfig`` from a Hugging Face ``config.json`` or GGUF metadata."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ktc.errors import ConfigError, FormatError
from ktc.ir import Attention, Gating, ModelConfig, TensorRef

from .gguf_reader import LargeArray
from .tensor_file import read_json

# Each concept is spelled several ways across families; the first key present wins.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "num_selected_experts",
              "top_k")
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts")
# Families whose routers renormalise the chosen experts' weights without a config switch.
_ALWAYS_NORMALISED = {"mixtral", "gpt_oss", "llama", "gpt-oss"}


def read_hf_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Parse ``config.json`` at ``path``; returns the typed config and the raw JSON."""
    raw = read_json(path, "config.json", finite=False)
    if not isinstance(raw, dict):
        raise FormatError("config is not a JSON object", path=path)
    return config_from_hf(raw, path), raw


def _first(raw: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return None


def _as_int(value: Any, key: str, path: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"'{key}' is {value!r}; expected an integer >= {minimum}", path=path)
    return value


def config_from_hf(raw: Mapping[str, Any], path: str) -> ModelConfig:
    """A ``ModelConfig`` from the fields of a Hugging Face config (multimodal ones included)."""
    model_type = str(raw.get("model_type", ""))
    architectures = raw.get("architectures") or [model_type]
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if "hidden_size" not in text:
        raise ConfigError("no 'hidden_size'; is this a language model's config.json?", path=path)

    def need(key: str, *, minimum: int = 1) -> int:
        if text.get(key) is None:
            raise ConfigError(f"missing '{key}'", path=path)
        return _as_int(text[key], key, path, minimum=minimum)

    def opt(key: str | tuple[str, ...], default: int = 0) -> int:
        keys = (key,) if isinstance(key, str) else key
        value = _first(text, keys)
        return default if value is None else _as_int(value, keys[0], path)

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    num_experts = opt(EXPERT_COUNT_KEYS)
    top_k = opt(TOP_K_KEYS)
    if num_experts and top_k and not 1 <= top_k <= num_experts:
        raise ConfigError(f"experts per token is {top_k}, expected 1..{num_experts}", path=path)
    moe_inter = opt("moe_intermediate_size") or opt("intermediate_size")
    shared_inter = opt("shared_expert_intermediate_size")
    shared = opt(SHARED_COUNT_KEYS) or (1 if shared_inter else 0)
    mla = text.get("kv_lora_rank") is not None
    inner_type = str(text.get("model_type", model_type))
    norm_default = inner_type in _ALWAYS_NORMALISED
    norm = text.get("norm_topk_prob")
    return ModelConfig(
        architecture=str(architectures[0]),
        model_type=model_type,
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=opt("num_key_value_heads") or heads,
        head_dim=opt("head_dim") or hidden // heads,
        vocab_size=need("vocab_size"),
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=shared,
        expert_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter or moe_inter * shared,
        dense_intermediate_size=opt("intermediate_size"),
        first_dense_layers=opt("first_k_dense_replace"),
        moe_layer_step=opt(("decoder_sparse_step", "moe_layer_freq"), 1) or 1,
        dense_layers=tuple(text.get("mlp_only_layers") or ()),
        gating=_hf_gating(text, inner_type),
        norm_topk_prob=norm_default if norm is None else bool(norm),
        routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0),
        num_expert_groups=opt("n_group", 1) or 1,
        topk_groups=opt("topk_group", 1) or 1,
        attention=Attention.MLA if mla else Attention.GQA,
        kv_lora_rank=opt("kv_lora_rank"),
        q_lora_rank=opt("q_lora_rank"),
        qk_rope_head_dim=opt("qk_rope_head_dim"),
        qk_nope_head_dim=opt("qk_nope_head_dim"),
        v_head_dim=opt("v_head_dim"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        swiglu_limit=float(text["swiglu_limit"]) if text.get("swiglu_limit") is not None else None,
        swiglu_alpha=(float(text.get("swiglu_alpha", 1.702))
                      if inner_type == "gpt_oss" else None),
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or "") or None,
    )


# Families whose routers score with a sigmoid when the config does not say (transformers'
# DeepseekV3Config has no scoring_func field; DeepSeek-V3's noaux_tc routing is sigmoid).
_SIGMOID_FAMILIES = {"deepseek_v3", "kimi_k2", "glm4_moe", "dots1"}


# Families whose routers ktc's MoE layer does not compute: a test routes each family through
# transformers' block and ktc's layer and finds these differ (the rest agree to 1e-6).
OTHER_ROUTERS = {"phimoe": "sparsemixer", "ernie4_5_moe": "softmax with a selection bias (moe_statics)"}


def _hf_gating(text: Mapping[str, Any], model_type: str) -> Gating:
    if model_type in OTHER_ROUTERS:
        return Gating.OTHER
    scoring = text.get("scoring_func")
    if scoring is not None:
        return Gating.SIGMOID if scoring == "sigmoid" else Gating.SOFTMAX
    if text.get("topk_method") == "noaux_tc" or model_type in _SIGMOID_FAMILIES:
        return Gating.SIGMOID
    return Gating.SOFTMAX


# GGUF architectures whose llama.cpp graph renormalises top-k weights when the file is silent.
_GGUF_NORM_DEFAULT = {"llama": True, "qwen3moe": True, "gpt-oss": True, "qwen2moe": False,
                      "olmoe": False, "deepseek2": False}


def config_from_gguf(metadata: Mapping[str, Any], tensors: Mapping[str, TensorRef],
                     path: str) -> ModelConfig:
    """A ``ModelConfig`` from GGUF metadata, as llama.cpp reads it."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ConfigError("no 'general.architecture' in the metadata", path=path)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values (head counts): the largest governs memory
            value = max(value) if value else default
        return value

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ConfigError(f"missing '{arch}.{key}'", path=path)
        return _as_int(value, f"{arch}.{key}", path, minimum=1)

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, LargeArray):
        vocab = tokens.count
    elif isinstance(tokens, list):
        vocab = len(tokens)
    elif "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].stored_shape[0]
    else:
        vocab = int(get("vocab_size", 0))
    num_experts = int(get("expert_count", 0))
    top_k = int(get("expert_used_count", 0))
    if num_experts and not 1 <= top_k <= num_experts:
        raise ConfigError(f"{arch}.expert_used_count is {top_k}, expected 1..{num_experts}", path=path)
    shared = int(get("expert_shared_count", 0))
    expert_ff = int(get("expert_feed_forward_length", 0))
    shared_ff = int(get("expert_shared_feed_forward_length", 0))
    if shared_ff and not shared:
        shared = 1  # qwen2moe writes the shared width but not a count
    kv_lora = get("attention.kv_lora_rank")
    rope_dims = int(get("rope.dimension_count", 0))
    key_length = int(get("attention.key_length", 0))
    key_length_mla = int(get("attention.key_length_mla", 0))
    value_length = int(get("attention.value_length_mla", 0) or get("attention.value_length", 0))
    mla = kv_lora is not None
    qk_head = key_length_mla or key_length
    gating_code = int(get("expert_gating_func", 1))
    norm = get("expert_weights_norm")
    if arch == "gpt-oss":
        swiglu_limit, swiglu_alpha = 7.0, 1.702  # fixed in llama.cpp's gpt-oss graph
    else:
        swiglu_limit = swiglu_alpha = None
    return ModelConfig(
        architecture=arch,
        model_type=arch,
        hidden_size=hidden,
        num_layers=need("block_count"),
        num_attention_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=qk_head or hidden // heads,
        vocab_size=vocab,
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=shared,
        expert_intermediate_size=expert_ff,
        shared_expert_intermediate_size=shared_ff or expert_ff * shared,
        dense_intermediate_size=int(get("feed_forward_length", 0)),
        first_dense_layers=int(get("leading_dense_block_count", 0)),
        gating=Gating.SIGMOID if gating_code == 2 else Gating.SOFTMAX,
        norm_topk_prob=_GGUF_NORM_DEFAULT.get(arch, True) if norm is None else bool(norm),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
        num_expert_groups=int(get("expert_group_count", 1) or 1),
        topk_groups=int(get("expert_group_used_count", 1) or 1),
        attention=Attention.MLA if mla else Attention.GQA,
        kv_lora_rank=int(kv_lora or 0),
        q_lora_rank=int(get("attention.q_lora_rank", 0) or 0),
        qk_rope_head_dim=rope_dims if mla else 0,
        qk_nope_head_dim=(qk_head - rope_dims) if mla and qk_head else 0,
        v_head_dim=value_length if mla else 0,
        tie_word_embeddings="output.weight" not in tensors,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
    )


def find_config_json(path: str) -> str | None:
    """The ``config.json`` beside a checkpoint file or inside its folder, if any."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    candidate = os.path.join(folder, "config.json")
    return candidate if os.path.exists(candidate) else None
