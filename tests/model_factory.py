"""Tiny MoE checkpoints written by the real writers: transformers' ``save_pretrained``,
``torch.save`` and the ``gguf`` package's ``GGUFWriter`` (with llama.cpp's tensor names)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HIDDEN = 32
LAYERS = 3
EXPERTS = 8
TOP_K = 2


@dataclass(frozen=True)
class Family:
    name: str  # the family ktc should report
    config_class: str
    kwargs: dict
    gguf_arch: str
    moe_layers: tuple[int, ...]
    shared: int


FAMILIES = {
    "mixtral": Family("mixtral", "MixtralConfig", dict(num_local_experts=EXPERTS), "llama",
                      (0, 1, 2), 0),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeConfig",
                        dict(num_experts=EXPERTS, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48), "qwen2moe", (0, 1, 2), 1),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeConfig",
                        dict(num_experts=EXPERTS, moe_intermediate_size=32, norm_topk_prob=True),
                        "qwen3moe", (0, 1, 2), 0),
    "olmoe": Family("olmoe", "OlmoeConfig", dict(num_experts=EXPERTS, intermediate_size=32),
                    "olmoe", (0, 1, 2), 0),
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3Config",
                          dict(n_routed_experts=EXPERTS, moe_intermediate_size=32,
                               first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
                               kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4),
                          "deepseek2", (1, 2), 1),
    "deepseek_v2": Family("deepseek_v2", "DeepseekV2Config",
                          dict(n_routed_experts=EXPERTS, moe_intermediate_size=32,
                               first_k_dense_replace=1, n_shared_experts=2, kv_lora_rank=16,
                               q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                               v_head_dim=8, num_key_value_heads=4), "deepseek2", (1, 2), 2),
    "gpt_oss": Family("gpt_oss", "GptOssConfig", dict(num_local_experts=EXPERTS, intermediate_size=32,
                                                     head_dim=8), "gpt-oss", (0, 1, 2), 0),
}

# More families that transformers runs through its experts interface, for the whole-model tests;
# detection reads them with the tables above (their checkpoints reuse those names) or through
# transformers' own model structure.
EXTRA_FAMILIES = {
    "glm4_moe": Family("glm4_moe", "Glm4MoeConfig",
                       dict(n_routed_experts=EXPERTS, moe_intermediate_size=32, first_k_dense_replace=1,
                            n_group=1, topk_group=1, n_shared_experts=1, head_dim=8), "glm4moe", (1, 2), 1),
    "dots1": Family("dots1", "Dots1Config",
                    dict(n_routed_experts=EXPERTS, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_shared_experts=1, head_dim=8), "dots1", (1, 2), 1),
    "phimoe": Family("phimoe", "PhimoeConfig", dict(num_local_experts=EXPERTS), "phimoe", (0, 1, 2), 0),
    "ernie4_5_moe": Family("ernie4_5_moe", "Ernie4_5_MoeConfig",
                           dict(moe_num_experts=EXPERTS, moe_intermediate_size=32, moe_num_shared_experts=1),
                           "ernie4_5-moe", (1, 2), 1),
}


def build_hf_model(family: str, seed: int = 0, **overrides):
    import torch
    import transformers

    spec = FAMILIES.get(family) or EXTRA_FAMILIES[family]
    kwargs = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  num_experts_per_tok=TOP_K)
    kwargs.update(spec.kwargs)
    kwargs.update(overrides)
    config = getattr(transformers, spec.config_class)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # make every weight non-trivial so value comparisons mean something
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


def write_safetensors(model, folder: str) -> str:
    model.save_pretrained(folder)
    return folder


def write_pytorch_from_safetensors(st_folder: str, folder: str, *, shards: int = 1) -> str:
    """The same tensors as ``st_folder`` saved with ``torch.save`` as Hugging Face ``.bin``."""
    import torch
    from safetensors.torch import load_file

    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(st_folder, "config.json"), folder)
    state = load_file(os.path.join(st_folder, "model.safetensors"))
    if shards == 1:
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
        return folder
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in part}, os.path.join(folder, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder


def write_pytorch_fused(model, st_folder: str, folder: str) -> str:
    """transformers' in-memory state dict, whose experts are fused 3-D tensors."""
    import torch

    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(st_folder, "config.json"), folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    return folder


# Hugging Face name (after "model.layers.N.") -> llama.cpp name (after "blk.N.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def gguf_tensors(st_folder: str) -> dict[str, np.ndarray]:
    """The tensors of a transformers checkpoint renamed and stacked as llama.cpp converts them."""
    from safetensors.numpy import load_file

    state = load_file(os.path.join(st_folder, "model.safetensors"))
    cfg = json.load(open(os.path.join(st_folder, "config.json")))
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = value
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        q = f"blk.{layer}."
        for hf, gg in _LAYER_NAMES.items():
            if p + hf in state:
                out[q + gg] = state[p + hf]
        # Per-expert 2-D tensors -> [E, out, in] stacks.
        for moe, (g, u, d) in (("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
                               ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))):
            first = p + moe.format(e=0) + g + ".weight"
            if first in state:
                n = sum(1 for k in state if k.startswith(p + moe.split("{e}")[0]) and k.endswith(g + ".weight"))
                for proj, gg in ((g, "ffn_gate_exps"), (u, "ffn_up_exps"), (d, "ffn_down_exps")):
                    out[q + gg + ".weight"] = np.stack(
                        [state[p + moe.format(e=e) + proj + ".weight"] for e in range(n)])
        # gpt-oss: gate_up_proj [E, H, 2I] interleaved -> gate/up [E, I, H]; down [E, I, H] -> [E, H, I].
        if p + "mlp.experts.gate_up_proj" in state:
            gu = state[p + "mlp.experts.gate_up_proj"]
            out[q + "ffn_gate_exps.weight"] = np.ascontiguousarray(gu[:, :, 0::2].transpose(0, 2, 1))
            out[q + "ffn_up_exps.weight"] = np.ascontiguousarray(gu[:, :, 1::2].transpose(0, 2, 1))
            out[q + "ffn_down_exps.weight"] = np.ascontiguousarray(
                state[p + "mlp.experts.down_proj"].transpose(0, 2, 1))
            gub = state[p + "mlp.experts.gate_up_proj_bias"]
            out[q + "ffn_gate_exps.bias"] = np.ascontiguousarray(gub[:, 0::2])
            out[q + "ffn_up_exps.bias"] = np.ascontiguousarray(gub[:, 1::2])
            out[q + "ffn_down_exps.bias"] = state[p + "mlp.experts.down_proj_bias"]
    return out


def random_blocks(scheme_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Bytes [rows, row_bytes] of random blocks of a ggml block scheme with finite, moderate
    fp16/e8m0 scales (every code byte is valid): K-quants as a GGUF holds them, which the
    ``gguf`` package cannot quantize."""
    from ktc.formats.schemes import get_scheme

    scheme = get_scheme(scheme_name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // scheme.block_elems, scheme.block_bytes), dtype=np.uint8)
    # super-blocks scale their sub-blocks by 6-bit factors too: values of about 0.1 either way
    low, high = (2e-5, 2e-4) if scheme.block_elems == 256 else (1e-3, 1e-2)
    for at in scheme.half_scales:
        raw[:, at:at + 2] = rng.uniform(low, high, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    for at in scheme.e8m0_scales:
        raw[:, at] = rng.integers(120, 130, raw.shape[0], dtype=np.uint8)
    return raw.reshape(rows, -1)


def _quantized_tensor(value: np.ndarray, qtype: str, seed: int):
    """A tensor (2-D, or an expert stack [E, rows, cols]) in ggml type ``qtype``: quantized by the
    gguf package where it can, else by ktc's quantizer of that type (q4_k, q5_k, q6_k: llama.cpp's
    algorithm), else random blocks of that type."""
    import gguf

    from ktc.formats.quantize import quantize
    from ktc.formats.schemes import get_scheme

    kind = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(value, kind), kind
    except NotImplementedError:
        cols = value.shape[-1]
        flat = value.reshape(-1, cols)
        if get_scheme(qtype.lower()).quantize is not None:
            raw = quantize(flat, qtype.lower())
        else:
            raw = random_blocks(qtype.lower(), flat.shape[0], cols, seed)
        return raw.reshape(*value.shape[:-1], -1), kind


def write_gguf(st_folder: str, path: str, *, family: str, expert_qtype=None,
               dense_qtype: dict | None = None, fuse_gate_up: bool = False, tokenizer_pre: str = "gpt-2",
               split_kv_b: bool = False, metadata: dict | None = None, split_max_tensors: int = 0) -> str:
    """Convert a tiny transformers checkpoint to GGUF with llama.cpp's names and metadata keys
    (and its tokenizer as ``tokenizer.ggml.*`` metadata when the folder has a BPE tokenizer.json).
    ``expert_qtype``: the ggml type of the expert stacks, a type per projection
    (``{"gate": ..., "up": ..., "down": ...}``), or a function of (layer, projection).
    ``dense_qtype``: ggml types of other matrices (and of MLA's split halves) by name suffix
    (``{"attn_v.weight": "Q6_K"}``).
    ``tokenizer_pre``: llama.cpp's name of the tokenizer's pre-tokenizer (the factory's byte-level
    BPE splits text as GPT-2 does: "gpt-2"). ``split_kv_b``: DeepSeek's MLA as llama.cpp's converter
    writes it now, the key/value up-projection split into ``attn_k_b`` (transposed) and
    ``attn_v_b``, with the absorbed widths as key and value lengths. ``metadata``: more keys (after
    the architecture's name), each a string, an int or a float (written as float32).
    ``split_max_tensors``: a GGUF split into parts of that many tensors (the gguf package's writer,
    named as llama.cpp's gguf-split names them); the first part's path is returned."""
    import gguf

    spec = FAMILIES[family]
    cfg = json.load(open(os.path.join(st_folder, "config.json")))
    arch = spec.gguf_arch
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    if cfg.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    tokenizer_json = os.path.join(st_folder, "tokenizer.json")
    if os.path.exists(tokenizer_json):
        _add_gguf_tokenizer(writer, json.load(open(tokenizer_json)), tokenizer_pre)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    if family != "olmoe":  # llama.cpp's OLMoE converter writes the experts' width as feed_forward_length alone
        writer.add_expert_feed_forward_length(inter)
    writer.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", family in ("mixtral", "gpt_oss"))))
    if cfg.get("head_dim") and not family.startswith("deepseek"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if family.startswith("deepseek"):
        writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        writer.add_expert_shared_count(cfg["n_shared_experts"])
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
        writer.add_kv_lora_rank(cfg["kv_lora_rank"])
        if cfg.get("q_lora_rank"):
            writer.add_q_lora_rank(cfg["q_lora_rank"])
        writer.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if family.startswith("deepseek") and split_kv_b:  # llama.cpp's converter since MLA's absorption
        writer.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        writer.add_value_length(cfg["kv_lora_rank"])
        writer.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        writer.add_value_length_mla(cfg["v_head_dim"])
    elif family.startswith("deepseek"):  # as llama.cpp's converter wrote them before, for both
        writer.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        writer.add_value_length(cfg["v_head_dim"])
    if family == "gpt_oss":  # as llama.cpp's converter writes the released models' yarn and window
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_sliding_window(cfg["sliding_window"])
    if family == "deepseek_v3":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    for key, value in (metadata or {}).items():
        add = (writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int)
               else writer.add_float32)
        add(f"{arch}.{key}", value)
    tensors = gguf_tensors(st_folder)
    if split_kv_b:
        heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        for name in [n for n in tensors if n.endswith("attn_kv_b.weight")]:
            kv = tensors.pop(name).reshape(heads, nope + v, -1)
            tensors[name.replace("attn_kv_b", "attn_k_b")] = np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1))
            tensors[name.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(kv[:, nope:])
    if family == "gpt_oss":  # llama.cpp's gpt-oss: the norm before the experts is post_attention_norm
        tensors = {n.replace(".ffn_norm.", ".post_attention_norm."): v for n, v in tensors.items()}
    if arch == "llama":  # llama.cpp's converter permutes Q and K rows for its rope (LlamaModel.permute)
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name in [n for n in tensors if n.endswith(("attn_q.weight", "attn_k.weight"))]:
            n_head = heads if name.endswith("attn_q.weight") else kv_heads
            w = tensors[name]
            tensors[name] = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if fuse_gate_up:  # llama.cpp's ffn_gate_up_exps: [E, 2I, H], gate rows then up rows
        for gate_name in [n for n in tensors if n.endswith("ffn_gate_exps.weight")]:
            up_name = gate_name.replace("ffn_gate_exps", "ffn_up_exps")
            fused = np.concatenate([tensors.pop(gate_name), tensors.pop(up_name)], axis=1)
            tensors[gate_name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = fused
    for index, (name, value) in enumerate(tensors.items()):
        value = np.ascontiguousarray(value.astype(np.float32))
        dense = next((q for suffix, q in (dense_qtype or {}).items() if name.endswith(suffix)), None)
        if expert_qtype and "_exps.weight" in name:
            proj = name.split(".")[-2].split("_")[1]  # blk.N.ffn_gate_exps.weight -> gate
            qtype = (expert_qtype if isinstance(expert_qtype, str) else expert_qtype[proj]
                     if isinstance(expert_qtype, dict) else expert_qtype(int(name.split(".")[1]), proj))
            data, kind = _quantized_tensor(value, qtype, index)
            writer.add_tensor(name, data, raw_dtype=kind)
        elif dense and value.ndim in (2, 3):  # 3-D: a head's rows a slice (attn_k_b, attn_v_b)
            data, kind = _quantized_tensor(value, dense, index)
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(writer.format_shard_names(Path(path))[0])


def _add_gguf_tokenizer(writer, tokenizer: dict, pre: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's converter writes it (model "gpt2"; ``pre``:
    the name of its pre-tokenizer)."""
    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    tokens = [None] * (max(list(vocab.values()) + list(added.values())) + 1)
    for text, i in {**vocab, **added}.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    if added:
        first = min(added.values())
        writer.add_eos_token_id(first)
        writer.add_bos_token_id(first)


def write_bpe_tokenizer(folder: str, vocab_size: int) -> str:
    """The demo's byte-level BPE tokenizer (``vocab_size`` tokens) saved into ``folder``."""
    from ktc.demo import demo_tokenizer_files

    os.makedirs(folder, exist_ok=True)
    for name, data in demo_tokenizer_files(vocab_size).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return folder


def mxfp4_encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss MXFP4: per 32 values one e8m0 exponent and 16 bytes of e2m1 nibbles (low first)."""
    from ktc.formats.dequant import FP4_E2M1_VALUES

    rows = values.reshape(*values.shape[:-1], -1, 32)
    amax = np.abs(rows).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0).astype(np.int32)
    scaled = rows / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_E2M1_VALUES).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).astype(np.uint8)


def write_gpt_oss_mxfp4(st_folder: str, folder: str) -> dict[str, np.ndarray]:
    """The gpt-oss checkpoint in ``st_folder`` with its experts as released: MXFP4 ``_blocks`` and
    ``_scales`` tensors of [E, out, in]. Returns the tensors written."""
    from safetensors.numpy import load_file, save_file

    state = load_file(os.path.join(st_folder, "model.safetensors"))
    out = {}
    for name, value in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_encode(np.ascontiguousarray(value.transpose(0, 2, 1)))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = value
    os.makedirs(folder, exist_ok=True)
    save_file(out, os.path.join(folder, "model.safetensors"))
    shutil.copy(os.path.join(st_folder, "config.json"), folder)
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_char_tokenizer(folder: str, vocab_size: int) -> str:
    """A character-level tokenizer of exactly ``vocab_size`` tokens (special tokens, then
    printable characters), saved the way transformers saves one (tokenizer.json and
    tokenizer_config.json with a chat template) into ``folder``."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate((specials + chars)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def compile_with_placement(src: str, tmp_path, where) -> str:  # type: ignore[no-untyped-def]
    """A bundle whose expert ``e`` of every layer is placed at ``where(e)`` ("gpu:int8",
    "cpu:q4_0", ...): a plan's placement rewritten."""
    from ktc.api import plan
    from ktc.compile import compile_bundle

    data = plan(src, vram="1GiB", reserve=0).to_json()
    for layer, row in data["placement"].items():
        data["placement"][layer] = [where(e) for e in range(len(row))]
    data["options"]["dense_scheme"] = "f32"  # exact non-expert weights: only the experts differ
    (tmp_path / "plan.json").write_text(json.dumps(data))
    path = str(tmp_path / "m.ktb")
    compile_bundle(src, path, plan_path=str(tmp_path / "plan.json"))
    return path


def warm_cuda() -> None:
    """Take cuBLAS's workspace before a test counts the device's bytes: torch's allocator gives
    it (32 MiB on Hopper) at a stream's first product and keeps it, so a count that spans the
    first product would see it as the runtime's."""
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones((2, 8, 8), device="cuda", dtype=dtype)
        torch.bmm(a, a)
        a[0] @ a[0]
    torch.cuda.synchronize()
