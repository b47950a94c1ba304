"""Expert detection across families and formats: the same model gives the same IR."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import model_factory as mf
from ktc.api import load_model
from ktc.errors import ConfigError, UnsupportedModelError
from ktc.formats.dequant import to_float32
from ktc.summary import summarize

FORMATS = ("safetensors", "pytorch", "gguf")


@pytest.mark.parametrize("family", list(mf.FAMILIES))
@pytest.mark.parametrize("fmt", FORMATS + ("pytorch_fused",))
def test_detects_family_layers_experts(tiny_models, family, fmt):
    if fmt not in tiny_models[family]:
        pytest.skip("gpt-oss has no separate fused variant")
    spec = mf.FAMILIES[family]
    summary = summarize(load_model(tiny_models[family][fmt]))
    assert summary.family == spec.name
    assert summary.num_layers == mf.LAYERS
    assert summary.moe_layers == spec.moe_layers
    assert summary.num_experts == mf.EXPERTS
    assert summary.top_k == mf.TOP_K
    assert summary.num_shared_experts == spec.shared


def _expert_arrays(ir, layer, expert):
    e = ir.layer(layer).experts[expert]
    return {k: to_float32(getattr(e, k)) for k in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
            if getattr(e, k) is not None}


@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_same_ir_from_every_format(tiny_models, family):
    irs = {fmt: load_model(path) for fmt, path in tiny_models[family].items()}
    reference = irs["safetensors"]
    ref_summary = summarize(reference)
    for fmt, ir in irs.items():
        assert ir.moe_layer_indices == reference.moe_layer_indices, fmt
        assert summarize(ir).bytes == ref_summary.bytes, fmt
        for layer in reference.moe_layers:
            other = ir.layer(layer.layer)
            assert len(other.experts) == len(layer.experts)
            assert [e.gate.shape for e in other.experts] == [e.gate.shape for e in layer.experts]
            assert [e.down.shape for e in other.experts] == [e.down.shape for e in layer.experts]
            assert other.top_k == layer.top_k and other.gating == layer.gating, fmt
            assert other.norm_topk_prob == layer.norm_topk_prob, fmt
            assert other.activation == layer.activation, fmt
            assert len(other.shared_experts) == len(layer.shared_experts), fmt
            assert (other.score_correction_bias is None) == (layer.score_correction_bias is None), fmt
            assert (other.router_bias is None) == (layer.router_bias is None), fmt
            np.testing.assert_array_equal(to_float32(other.router), to_float32(layer.router))
        # Values: unquantized GGUF and every PyTorch variant hold the very same numbers.
        for layer in reference.moe_layer_indices:
            for expert in (0, mf.EXPERTS - 1):
                want = _expert_arrays(reference, layer, expert)
                got = _expert_arrays(ir, layer, expert)
                assert got.keys() == want.keys(), fmt
                for key in want:
                    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{fmt} {key}")


def test_gpt_oss_interleaving_matches_transformers(tiny_models):
    """gate = even columns, up = odd columns of gate_up_proj [E, H, 2I], viewed as [out, in]."""
    from safetensors.numpy import load_file

    folder = tiny_models["gpt_oss"]["safetensors"]
    raw = load_file(os.path.join(folder, "model.safetensors"))["model.layers.1.mlp.experts.gate_up_proj"]
    e = load_model(folder).layer(1).experts[3]
    np.testing.assert_array_equal(to_float32(e.gate), raw[3][:, 0::2].T)
    np.testing.assert_array_equal(to_float32(e.up), raw[3][:, 1::2].T)


def test_quantized_gguf_keeps_block_type(tiny_models, tmp_path):
    import gguf

    path = mf.write_gguf(tiny_models["qwen3_moe"]["safetensors"], str(tmp_path / "q8.gguf"),
                         family="qwen3_moe", expert_qtype="Q8_0")
    ir = load_model(path)
    expert = ir.layer(0).experts[5]
    assert expert.gate.dtype == "Q8_0"
    assert expert.gate.shape == (32, mf.HIDDEN)
    assert expert.nbytes == 3 * 32 * mf.HIDDEN // 32 * 34
    exact = load_model(tiny_models["qwen3_moe"]["safetensors"]).layer(0).experts[5]
    want = gguf.quants.dequantize(gguf.quants.quantize(to_float32(exact.gate), gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(to_float32(expert.gate), want)


def _copy_with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    json.dump(config, open(path, "w"))
    return dst


def test_new_architecture_name_with_known_layout(tiny_models, tmp_path):
    """Kimi-K2 ships DeepSeek-V3's layout under its own name; GLM-4.5 uses DeepSeek-style names."""
    folder = _copy_with_config(tiny_models["deepseek_v3"]["safetensors"], str(tmp_path / "kimi"),
                               model_type="kimi_k2", architectures=["KimiK2ForCausalLM"])
    summary = summarize(load_model(folder))
    assert summary.family == "deepseek_v3"
    assert summary.architecture == "KimiK2ForCausalLM"
    assert summary.num_experts == mf.EXPERTS and summary.num_shared_experts == 1


def test_layout_without_expert_count_is_unsupported(tiny_models, tmp_path):
    folder = _copy_with_config(tiny_models["qwen3_moe"]["safetensors"], str(tmp_path / "anon"),
                               model_type="mystery_moe", architectures=["MysteryForCausalLM"],
                               num_experts=None, num_local_experts=None, num_experts_per_tok=None)
    with pytest.raises(UnsupportedModelError, match="MysteryForCausalLM") as info:
        load_model(folder)
    assert "expert count" in str(info.value)


def test_unknown_layout_names_what_it_found(tmp_path):
    from safetensors.numpy import save_file

    tensors = {f"transformer.h.{i}.moe.expert_{e}.fc.weight": np.zeros((4, 4), np.float32)
               for i in range(2) for e in range(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    json.dump({"architectures": ["NovelMoE"], "model_type": "novel", "hidden_size": 4,
               "num_hidden_layers": 2, "num_attention_heads": 1, "vocab_size": 8, "num_experts": 4,
               "num_experts_per_tok": 1}, open(tmp_path / "config.json", "w"))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tmp_path))
    message = str(info.value)
    assert "NovelMoE" in message
    assert "transformer.h.0.moe.expert_0.fc.weight" in message
    assert "Mixtral" in message and "GGUF" in message  # the supported layouts


def test_config_declares_more_experts_than_present(tiny_models, tmp_path):
    """config.json says 8 experts; the tensors hold 6 in every layer."""
    from safetensors.numpy import load_file, save_file

    src = tiny_models["mixtral"]["safetensors"]
    state = load_file(os.path.join(src, "model.safetensors"))
    kept = {k: v for k, v in state.items() if ".experts.6." not in k and ".experts.7." not in k}
    kept.update({k: v[:6] for k, v in state.items() if k.endswith("block_sparse_moe.gate.weight")})
    os.makedirs(tmp_path / "m")
    save_file(kept, str(tmp_path / "m" / "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "m")
    with pytest.raises(ConfigError) as info:
        load_model(str(tmp_path / "m"))
    message = str(info.value)
    assert "8 experts" in message and "6" in message and "layer 0" in message


def test_config_with_wrong_hidden_size(tiny_models, tmp_path):
    folder = _copy_with_config(tiny_models["olmoe"]["safetensors"], str(tmp_path / "h"), hidden_size=64)
    with pytest.raises(ConfigError, match="shape"):
        load_model(folder)


def test_config_with_wrong_dense_layers(tiny_models, tmp_path):
    folder = _copy_with_config(tiny_models["deepseek_v3"]["safetensors"], str(tmp_path / "d"),
                               first_k_dense_replace=2)
    with pytest.raises(ConfigError, match="dense"):
        load_model(folder)


def test_fp8_block_scales_dequantize(tiny_models, tmp_path):
    """DeepSeek-V3 style FP8 e4m3 weights with weight_scale_inv per 16 x 16 block."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_models["deepseek_v3"]["safetensors"]
    state = load_file(os.path.join(src, "model.safetensors"))
    block = 16
    out = {}
    for name, value in state.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            rows, cols = value.shape
            blocks = value.reshape(rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            out[name] = q
            out[name + "_scale_inv"] = scale.float()
        else:
            out[name] = value
    os.makedirs(tmp_path / "fp8")
    save_file(out, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    json.dump(config, open(tmp_path / "fp8" / "config.json", "w"))

    ir = load_model(str(tmp_path / "fp8"))
    expert = ir.layer(1).experts[2]
    assert expert.gate.dtype == "F8_E4M3" and expert.gate.scale_block == (block, block)
    exact = state["model.layers.1.mlp.experts.2.gate_proj.weight"].numpy()
    got = to_float32(expert.gate)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    rows, cols = exact.shape
    want = (out[name].float().reshape(rows // block, block, cols // block, block)
            * out[name + "_scale_inv"][:, None, :, None]).reshape(exact.shape).numpy()
    np.testing.assert_array_equal(got, want)  # exact decode of what is stored
    assert np.abs(got - exact).max() <= np.abs(exact).max() / 8  # and close to the original
    # Scales are part of the expert's bytes: 1 byte per weight + 4 per block.
    assert expert.gate.nbytes == rows * cols + 4 * (rows // block) * (cols // block)


def test_gpt_oss_mxfp4_blocks(tiny_models, tmp_path):
    from safetensors.numpy import load_file

    from ktc.formats.dequant import FP4_E2M1_VALUES

    src = tiny_models["gpt_oss"]["safetensors"]
    state = load_file(os.path.join(src, "model.safetensors"))
    out = mf.write_gpt_oss_mxfp4(src, str(tmp_path / "mx"))

    ir = load_model(str(tmp_path / "mx"))
    expert = ir.layer(2).experts[1]
    assert expert.gate.dtype == "MXFP4_BLOCKS" and expert.gate.shape == (32, mf.HIDDEN)
    blocks = out["model.layers.2.mlp.experts.gate_up_proj_blocks"][1]  # [2I, H/32, 16]
    scales = out["model.layers.2.mlp.experts.gate_up_proj_scales"][1]  # [2I, H/32]
    nibbles = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(64, -1)
    decoded = FP4_E2M1_VALUES[nibbles] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1)
    np.testing.assert_array_equal(to_float32(expert.gate), decoded[0::2].astype(np.float32))
    np.testing.assert_array_equal(to_float32(expert.up), decoded[1::2].astype(np.float32))
    exact = state["model.layers.2.mlp.experts.gate_up_proj"][1][:, 0::2].T
    assert np.abs(to_float32(expert.gate) - exact).max() <= np.abs(exact).max() / 2


def test_gguf_fused_gate_up_experts(tiny_models, tmp_path):
    path = mf.write_gguf(tiny_models["qwen3_moe"]["safetensors"], str(tmp_path / "fused.gguf"),
                         family="qwen3_moe", fuse_gate_up=True)
    fused = load_model(path)
    reference = load_model(tiny_models["qwen3_moe"]["safetensors"])
    assert summarize(fused).family == "qwen3_moe"
    for layer in reference.moe_layer_indices:
        for e in (0, 5):
            want = _expert_arrays(reference, layer, e)
            got = _expert_arrays(fused, layer, e)
            for key in ("gate", "up", "down"):
                np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("family", list(mf.FAMILIES))
@pytest.mark.parametrize("fmt", ("safetensors", "pytorch", "pytorch_fused"))
def test_transformers_structure_and_tables_agree(tiny_models, family, fmt):
    """Detection through transformers' model structure and through the declarative tables find
    the same layers, experts (the same tensors, viewed the same way), routers and shared experts."""
    from ktc.formats.checkpoint import open_checkpoint
    from ktc.passes.detect import build_ir
    from ktc.passes.detect_hf import derive_layout

    if fmt not in tiny_models[family]:
        pytest.skip("gpt-oss has no separate fused variant")
    with open_checkpoint(tiny_models[family][fmt]) as ckpt:
        assert derive_layout(ckpt) is not None, "transformers' structure was not read"
        by_structure = build_ir(ckpt)
        by_table = build_ir(ckpt, use_transformers=False)
    assert by_structure.family == by_table.family
    assert by_structure.moe_layer_indices == by_table.moe_layer_indices
    assert by_structure.config.top_k == by_table.config.top_k
    assert by_structure.config.num_experts == by_table.config.num_experts
    for a, b in zip(by_structure.moe_layers, by_table.moe_layers):
        assert a.experts == b.experts  # the same TensorRefs: names, views, byte ranges
        assert (a.router, a.router_bias, a.score_correction_bias) == (b.router, b.router_bias, b.score_correction_bias)
        assert a.shared_experts == b.shared_experts and a.shared_expert_gate == b.shared_expert_gate
        assert (a.top_k, a.gating, a.activation) == (b.top_k, b.gating, b.activation)
    assert {d.ref.name for d in by_structure.dense} == {d.ref.name for d in by_table.dense}


def test_family_without_a_table_is_read_through_transformers(tmp_path):
    """ERNIE-4.5-MoE calls its top-k ``moe_k`` and keeps its score bias in ``moe_statics``: no table
    reads it, transformers' model structure does."""
    from ktc.formats.checkpoint import open_checkpoint
    from ktc.passes.detect import build_ir

    folder = mf.write_safetensors(mf.build_hf_model("ernie4_5_moe"), str(tmp_path / "ernie"))
    with open_checkpoint(folder) as ckpt:
        with pytest.raises(UnsupportedModelError, match="expert count and top-k"):
            build_ir(ckpt, use_transformers=False)
        ir = build_ir(ckpt)
    assert ir.family == "ernie4_5_moe"
    assert ir.moe_layer_indices == (1, 2) and ir.config.top_k == mf.TOP_K
    assert ir.config.num_experts == mf.EXPERTS and len(ir.layer(1).shared_experts) == 1


@pytest.mark.parametrize("count", [5, 2**31 - 1])
def test_layer_count_beyond_the_tensors_is_refused_at_once(tiny_models, tmp_path, count):
    """A damaged GGUF block_count (found by the fuzzer: 2**24 and more) was walked layer by layer."""
    import struct
    import time

    raw = bytearray(open(tiny_models["mixtral"]["gguf"], "rb").read())
    key = b"llama.block_count"  # llama.cpp files Mixtral under the llama architecture
    at = raw.index(key) + len(key)
    assert struct.unpack_from("<I", raw, at)[0] == 4  # GGUF_TYPE_UINT32
    raw[at + 4: at + 8] = struct.pack("<I", count)
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(raw))
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=f"the config gives {count} layers; the tensors hold layers up to"):
        load_model(str(path))
    assert time.perf_counter() - started < 10


def test_a_dense_model_is_named_dense(tmp_path):
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(UnsupportedModelError, match="this model has no experts") as info:
        load_model(str(tmp_path / "llama"))
    assert "dense model" in str(info.value) and "supported layouts" not in str(info.value)


@pytest.mark.parametrize("family, gating", [("dots1", "sigmoid"), ("phimoe", "other"), ("ernie4_5_moe", "other")])
def test_look_alike_families_keep_their_own_routing(tmp_path, family, gating):
    """dots1 scores with a sigmoid (as DeepSeek-V3); PhiMoE's sparsemixer and ERNIE-4.5's
    biased softmax are marked as routers ktc's MoE layer does not compute, and a plan says so."""
    from ktc.api import plan
    from ktc.plan_report import render_plan_text

    folder = mf.write_safetensors(mf.build_hf_model(family), str(tmp_path / family))
    ir = load_model(folder)
    assert all(layer.gating.value == gating for layer in ir.moe_layers)
    text = render_plan_text(plan(folder, vram="1GiB", reserve="0"))
    assert ("which ktc's MoE layer does not compute" in text) == (gating == "other")


def test_a_new_transformers_whose_experts_module_fails_to_import_is_named_as_such(monkeypatch):
    """A release new enough whose experts module raises ImportError (a module of the same name as
    one transformers imports, earlier on sys.path) is reported with that error, not as too old."""
    import builtins

    from ktc.errors import KtcError
    from ktc.formats.transformers_model import import_transformers

    pytest.importorskip("transformers")
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "transformers.integrations.moe":
            raise ImportError("cannot import name 'CUDAProperties' from 'kernels'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    with pytest.raises(KtcError) as raised:
        import_transformers()
    assert "does not import" in str(raised.value) and "CUDAProperties" in str(raised.value)
    assert "is older than" not in str(raised.value)
