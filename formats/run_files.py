"""What a bundle carries besides weights so that it runs without its source: the model's
Hugging Face ``config.json``, its ``generation_config.json``, and the tokenizer files.

A Hugging Face folder has them beside the weights. A GGUF file has them as metadata
(``{arch}.*`` and ``tokenizer.ggml.*``); transformers converts that metadata into a config and a
tokenizer (``from_pretrained(..., gguf_file=...)``), which is what we use when it is installed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ktc.errors import ConfigError, FormatError
from ktc.ir import Attention, ModelConfig

# Files of a Hugging Face model folder that a tokenizer or a chat template may need.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
MAX_FILE_BYTES = 256 * 1024 * 1024  # far above any tokenizer; guards against a wrong file
# Config fields that describe how the source stored its weights, not the model: the bundle
# stores its own schemes, so a runtime must not build (say) an FP8-quantized model from them.
_SOURCE_ONLY_KEYS = ("quantization_config", "_name_or_path", "transformers_version")


@dataclass(frozen=True)
class RunFiles:
    """The model's config and generation config (JSON objects, kept in the manifest) and the
    tokenizer files (name, bytes), sorted by name; ``origin`` says where they came from."""

    config: dict[str, Any] | None
    generation_config: dict[str, Any] | None
    files: tuple[tuple[str, bytes], ...] = field(repr=False, default=())
    origin: str = ""
    missing: str | None = None  # why the bundle will not run, when it will not

    def manifest_section(self) -> dict[str, Any]:
        return {"config": self.config, "generation_config": self.generation_config,
                "files": [name for name, _ in self.files], "origin": self.origin,
                "missing": self.missing}


def model_config_json(raw: dict[str, Any]) -> dict[str, Any]:
    """A source's config.json as the bundle keeps it (without the source's storage details)."""
    return {k: v for k, v in raw.items() if k not in _SOURCE_ONLY_KEYS}


def _read_file(path: str) -> bytes:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise FormatError(f"{size} bytes is too large for a tokenizer file", path=path)
    with open(path, "rb") as f:
        return f.read()


def folder_run_files(folder: str, raw_config: dict[str, Any]) -> RunFiles:
    """Config, generation config and tokenizer files of a Hugging Face model folder."""
    files = tuple((name, _read_file(os.path.join(folder, name))) for name in TOKENIZER_FILES
                  if os.path.isfile(os.path.join(folder, name)))
    generation = None
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            generation = json.loads(_read_file(gen_path))
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"generation_config.json is not valid JSON ({exc})", path=gen_path) from None
    missing = None if files else "the source folder has no tokenizer files (tokenizer.json, tokenizer.model, ...)"
    return RunFiles(model_config_json(dict(raw_config)), generation, tuple(sorted(files)),
                    "config.json", missing)


def _experts_as_weights(transformers: Any, config: Any, model_config: ModelConfig) -> str | None:
    """Make ``config`` (transformers' reading of GGUF metadata) build experts of the width the
    weights have: its GGUF mapping does not read ``expert_feed_forward_length`` for every
    architecture (Qwen3-MoE's experts come out at the class default, 768). Returns what still
    disagrees, or None."""
    from .transformers_model import is_experts_module, meta_model

    want = (model_config.num_experts, model_config.expert_intermediate_size)

    def built() -> tuple[int, int] | None:
        model = meta_model(transformers, config)
        for module in model.modules():
            if is_experts_module(module):
                down = module.down_proj
                return int(down.shape[0]), int(down.shape[1] if module.is_transposed else down.shape[2])
        return None

    have = built()
    if have is None and model_config.num_experts:
        return (f"transformers' config from this GGUF ({config.model_type}) has no experts; the weights have "
                f"{model_config.num_experts} per MoE layer")
    if have is None or have == want or not model_config.expert_intermediate_size:
        return None
    for attr in ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size"):
        if hasattr(config, attr):
            old = getattr(config, attr)
            setattr(config, attr, model_config.expert_intermediate_size)
            if built() == want:
                return None
            setattr(config, attr, old)
    return f"transformers' config from this GGUF builds experts {have}, the weights are {want}"


def _widths_as_metadata(config: Any, model_config: ModelConfig) -> None:
    """Set in ``config`` (transformers' reading of GGUF metadata) the widths the file states and
    transformers' mapping leaves at the config class's defaults for some architectures: the
    attention heads' (gpt-oss: ``attention.key_length``) and the shared expert's (Qwen2-MoE:
    ``expert_shared_feed_forward_length``), from ktc's reading of the same metadata
    (``model_config``). Where the defaults were another model's values, the bundle compiled and
    refused to load (a tensor's shape against the model's)."""
    heads = getattr(config, "num_attention_heads", 0) or 0
    if model_config.attention == Attention.GQA and model_config.head_dim and hasattr(config, "head_dim"):
        built = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        if built != model_config.head_dim:
            config.head_dim = model_config.head_dim
    shared = model_config.shared_expert_intermediate_size
    if shared and model_config.num_shared_experts and hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = shared


def _as_mixtral(transformers: Any, config: Any, model_config: ModelConfig) -> Any:
    """llama.cpp writes Mixtral as the llama architecture with experts, which transformers'
    GGUF mapping reads as a dense Llama: the same config as Mixtral's, with the experts."""
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    fields.update(num_local_experts=model_config.num_experts, num_experts_per_tok=model_config.top_k,
                  architectures=["MixtralForCausalLM"])
    if model_config.expert_intermediate_size:
        fields["intermediate_size"] = model_config.expert_intermediate_size
    return transformers.MixtralConfig.from_dict(fields)


# llama.cpp's names of the BPE pre-tokenizers that split text with GPT-2's own pattern
# (llama-vocab.cpp: the names it reads as LLAMA_VOCAB_PRE_TYPE_GPT2, and "mpt", "olmo" (OLMoE),
# "jais", "trillion" and "granite-docling", whose types split with the same pattern).
# transformers' GGUF conversion sets the split of the named pre-tokenizers it knows
# (GGUF_PRE_TOKENIZER_SPLITS) and of no others, which keep the split of the architecture's own
# tokenizer class: a Qwen3-MoE GGUF whose vocabulary names "gpt-2" was split as Qwen2's, unlike
# llama.cpp (the demo model's held-out text: 1316 tokens against 1286, perplexity 100.4 against
# llama-perplexity's 91.3 on the same file).
GPT2_SPLIT = frozenset({"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                        "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling"})


# llama.cpp's splits of the BPE pre-tokenizers of MoE models that transformers' table lacks
# (llama-vocab.cpp: each type's regex_exprs, every pattern splitting the pieces of the one before,
# the pieces isolated): the patterns themselves, which live in llama.cpp's C++ only. DeepSeek-V3's
# (also named by its Hunyuan and JoyAI relatives): digits by threes, runs of CJK and kana, then
# words, punctuation and spaces. DeepSeek-LLM's (the DeepSeek-V2 and V2-Lite files name it):
# newlines apart, runs of letters (Latin, Greek, Cyrillic and more, as one class) and of
# punctuation each after an optional space, trailing spaces, CJK and Hangul runs, digit runs.
# DeepSeek-Coder's: as DeepSeek-LLM's with Unicode's letter and punctuation classes, digits one by one.
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
LLAMACPP_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": _DEEPSEEK3, "hunyuan-dense": _DEEPSEEK3, "joyai-llm": _DEEPSEEK3, "hy_v4": _DEEPSEEK3,
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _CJK_HANGUL,
        "\\p{N}+"),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK_HANGUL, "\\p{N}"),
}


def _split_as_llamacpp(tokenizer: Any, path: str) -> bool:
    """The tokenizer transformers built from a GGUF split as llama.cpp splits it, where the file
    names a pre-tokenizer of a BPE vocabulary that transformers' conversion does not know and ktc
    does (``GPT2_SPLIT``, ``LLAMACPP_SPLITS``): whether it did."""
    from .gguf_reader import read_gguf_header

    meta, _ = read_gguf_header(path)
    pre = meta.get("tokenizer.ggml.pre")
    if meta.get("tokenizer.ggml.model") != "gpt2" or (pre not in GPT2_SPLIT and pre not in LLAMACPP_SPLITS):
        return False
    from tokenizers import Regex, pre_tokenizers

    if pre in LLAMACPP_SPLITS:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in LLAMACPP_SPLITS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return True


def _generic_class(config_path: str) -> None:
    """A saved tokenizer's config naming transformers' generic class, which reads tokenizer.json's
    pipeline as it is (an architecture's class, Qwen2Tokenizer, builds its own split)."""
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The config's special token ids (bos, eos, pad) that a GGUF's tokenizer metadata gives."""
    return {name.replace("padding", "pad"): int(meta[f"tokenizer.ggml.{name}"])
            for name in ("bos_token_id", "eos_token_id", "padding_token_id")
            if meta.get(f"tokenizer.ggml.{name}") is not None}


def _deepseek_config(transformers: Any, path: str, model_config: ModelConfig | None) -> Any:
    """DeepSeek-V3's config (sigmoid routing) or DeepSeek-V2's (softmax) for a GGUF of llama.cpp's
    ``deepseek2`` architecture, from ktc's reading of its metadata (``model_config``: the MLA
    widths, the experts, their groups and scaling), or None for any other file. transformers'
    GGUF mapping has no ``deepseek2``: without this such a bundle compiled and could not run.
    (The key/value up-projection that llama.cpp's converter stores split, ``attn_k_b`` and
    ``attn_v_b``, is joined again at load: ``runtime.hf``.)"""
    from ktc.ir import Gating

    if model_config is None or model_config.architecture != "deepseek2" or model_config.attention != Attention.MLA:
        return None
    from .gguf_reader import read_gguf_header

    meta, tensors = read_gguf_header(path)

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"deepseek2.{name}", default)

    mc = model_config
    v3 = mc.gating == Gating.SIGMOID
    fields: dict[str, Any] = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, num_hidden_layers=mc.num_layers,
        intermediate_size=mc.dense_intermediate_size or mc.expert_intermediate_size,
        moe_intermediate_size=mc.expert_intermediate_size, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_attention_heads, n_shared_experts=mc.num_shared_experts or None,
        n_routed_experts=mc.num_experts, num_experts_per_tok=mc.top_k,
        routed_scaling_factor=mc.routed_scaling_factor, kv_lora_rank=mc.kv_lora_rank,
        q_lora_rank=mc.q_lora_rank or None, qk_rope_head_dim=mc.qk_rope_head_dim,
        qk_nope_head_dim=mc.qk_nope_head_dim, v_head_dim=mc.v_head_dim, head_dim=mc.qk_rope_head_dim,
        first_k_dense_replace=mc.first_dense_layers, norm_topk_prob=mc.norm_topk_prob,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"])
    # always: without them transformers' classes take their own defaults (DeepseekV3Config's
    # 8 groups, 4 of them used), which a model with none (Kimi-K2's, Moonlight's) does not route by
    fields.update(n_group=mc.num_expert_groups, topk_group=mc.topk_groups)
    if mc.num_expert_groups > 1 and not v3:
        fields["topk_method"] = "group_limited_greedy"
    fields.update(_token_ids(meta))
    scaling = key("rope.scaling.type")
    if scaling == "yarn":  # the long context of DeepSeek's releases: the rope's yarn as their configs state it
        # llama.cpp stores 0.1 * mscale_all_dim (V3: 1.0, V2: 0.707, as each release's mscale too)
        mscale = float(key("rope.scaling.yarn_log_multiplier", 0.1)) / 0.1
        fields["rope_scaling"] = {"type": "yarn", "factor": float(key("rope.scaling.factor", 1.0)),
                                  "original_max_position_embeddings": int(key("rope.scaling.original_context_length", 4096)),
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}
    elif scaling not in (None, "none"):
        return None
    return (transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config)(**fields)


def _olmoe_config(transformers: Any, path: str, model_config: ModelConfig | None) -> Any:
    """OLMoE's config for a GGUF of llama.cpp's ``olmoe`` architecture, from ktc's reading of its
    metadata (``model_config``), or None for any other file. transformers' GGUF mapping has no
    ``olmoe``: without this such a bundle compiled and could not run. llama.cpp's converter writes
    no ``clip_qkv`` (the released models have none); a file that carries ``clamp_kqv`` gets it."""
    if model_config is None or model_config.architecture != "olmoe":
        return None
    from .gguf_reader import read_gguf_header

    meta, tensors = read_gguf_header(path)
    mc = model_config
    clip = meta.get("olmoe.attention.clamp_kqv")
    fields: dict[str, Any] = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, num_hidden_layers=mc.num_layers,
        # llama.cpp's converter writes the experts' width as the feed-forward length alone
        intermediate_size=mc.expert_intermediate_size or mc.dense_intermediate_size,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_kv_heads,
        num_experts=mc.num_experts, num_experts_per_tok=mc.top_k,
        norm_topk_prob=mc.norm_topk_prob, max_position_embeddings=int(meta.get("olmoe.context_length", 4096)),
        rms_norm_eps=float(meta.get("olmoe.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("olmoe.rope.freq_base", 10000.0)),
        clip_qkv=None if clip is None else float(clip), tie_word_embeddings="output.weight" not in tensors,
        architectures=["OlmoeForCausalLM"])
    fields.update(_token_ids(meta))
    return transformers.OlmoeConfig(**fields)


def _gpt_oss_config(transformers: Any, path: str, model_config: ModelConfig | None) -> Any:
    """gpt-oss's config for a GGUF of llama.cpp's ``gpt-oss`` architecture, from ktc's reading of
    its metadata, or None for any other file: transformers' own mapping fails on every file whose
    rope scaling is written (its yarn keys are read from the wrong part of the field), as llama.cpp's
    converter writes the released models'. The yarn parameters are the file's; the rest of gpt-oss's
    (SwiGLU limit, sliding window pattern) the config class's own, which llama.cpp also fixes."""
    if model_config is None or model_config.architecture != "gpt-oss":
        return None
    from .gguf_reader import read_gguf_header

    meta, tensors = read_gguf_header(path)
    mc = model_config

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gpt-oss.{name}", default)

    defaults = transformers.GptOssConfig()
    rope = dict(defaults.rope_parameters or {})
    rope["rope_theta"] = float(key("rope.freq_base", rope.get("rope_theta", 150000.0)))
    scaling = key("rope.scaling.type")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor", rope.get("factor", 1.0))),
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length",
                                                             rope.get("original_max_position_embeddings", 4096))),
                    beta_fast=float(key("rope.scaling.yarn_beta_fast", rope.get("beta_fast", 32.0))),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", rope.get("beta_slow", 1.0))))
    elif scaling == "none":
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    elif scaling is not None:
        return None
    fields: dict[str, Any] = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, num_hidden_layers=mc.num_layers,
        intermediate_size=mc.expert_intermediate_size or mc.dense_intermediate_size,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        num_local_experts=mc.num_experts, num_experts_per_tok=mc.top_k,
        max_position_embeddings=int(key("context_length", 131072)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        sliding_window=int(key("attention.sliding_window", defaults.sliding_window)), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors, architectures=["GptOssForCausalLM"])
    fields.update(_token_ids(meta))
    return transformers.GptOssConfig(**fields)


def gguf_run_files(path: str, model_config: ModelConfig | None = None) -> RunFiles:
    """Config and tokenizer derived from a GGUF file's metadata by transformers (the same
    conversion ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` does), the experts' width
    checked against ``model_config`` (ktc's own reading of the metadata). Without transformers,
    or for an architecture it cannot convert, the result says why in ``missing``."""
    try:
        import transformers
    except ImportError:
        return RunFiles(None, None, (), "gguf metadata",
                        "transformers is not installed, so the GGUF metadata could not be turned into "
                        "a config and tokenizer (pip install 'ktc[hf]', then compile again)")
    folder, name = os.path.split(os.path.abspath(path))
    own = False  # a config ktc built from its own reading of the metadata
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises ValueError/KeyError/... for what it cannot map
        config = (_deepseek_config(transformers, path, model_config)
                  or _olmoe_config(transformers, path, model_config)
                  or _gpt_oss_config(transformers, path, model_config))
        if config is None:
            return RunFiles(None, None, (), "gguf metadata",
                            f"transformers cannot derive a config from this GGUF ({type(exc).__name__}: {exc})")
        own = True
    if model_config is not None and model_config.num_experts and config.model_type in ("llama", "mistral"):
        config = _as_mixtral(transformers, config, model_config)
    if model_config is not None:
        _widths_as_metadata(config, model_config)
        disagreement = _experts_as_weights(transformers, config, model_config)
        if disagreement:
            return RunFiles(None, None, (), "gguf metadata", disagreement)
    config_dict = model_config_json(config.to_dict())
    try:
        # without a config transformers derives, AutoTokenizer has no class to pick: the generic one
        tokenizer = (transformers.PreTrainedTokenizerFast if own else transformers.AutoTokenizer).from_pretrained(
            folder, gguf_file=name)
    except Exception as exc:
        return RunFiles(config_dict, None, (), "gguf metadata",
                        f"transformers cannot build a tokenizer from this GGUF's metadata "
                        f"({type(exc).__name__}: {exc})")
    resplit = _split_as_llamacpp(tokenizer, path)
    with tempfile.TemporaryDirectory(prefix="ktc-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        if resplit or own:  # the architecture's class would impose its own split again on loading
            _generic_class(os.path.join(tmp, "tokenizer_config.json"))
        files = tuple(sorted((n, _read_file(os.path.join(tmp, n))) for n in os.listdir(tmp)
                             if n in TOKENIZER_FILES))
    try:
        generation = transformers.GenerationConfig.from_model_config(config).to_diff_dict()
        generation.pop("transformers_version", None)
    except Exception:  # a model config without generation defaults
        generation = None
    return RunFiles(config_dict, generation, files, "gguf metadata")


def collect_run_files(source_format: str, path: str, raw_config: dict[str, Any],
                      model_config: ModelConfig | None = None) -> RunFiles:
    """The run files of an opened checkpoint at ``path`` (a folder or a file in it)."""
    if source_format == "gguf":
        return gguf_run_files(path, model_config)
    if not raw_config:
        raise ConfigError("no config.json to store in the bundle", path=path)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return folder_run_files(folder, raw_config)
