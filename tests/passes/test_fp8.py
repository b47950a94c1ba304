"""DeepSeek-V3-style FP8 checkpoints (e4m3 weights with 128x128 block scales): the codes pass
through to ``fp8_e4m3`` for dense weights and experts, the runtime decodes them on the CPU and
in torch, and CPU experts convert exactly to another scheme when asked."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.errors import FormatError
from ktc.formats.bundle import open_bundle
from ktc.formats.dequant import to_float32

WIDE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_hidden_layers=2,
            kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=300)


def write_fp8(model, folder: str, block: int = 128) -> dict:
    """The model's projection matrices as e4m3 with one float32 scale per block x block (the last
    row block may be partial), the rest as stored; quantization_config as DeepSeek-V3's."""
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as plain:  # the checkpoint's names: per-expert matrices
        model.save_pretrained(plain)
        state = load_file(os.path.join(plain, "model.safetensors"))
    os.makedirs(folder, exist_ok=True)
    out = {}
    for name, value in state.items():
        value = value.detach().contiguous()
        if "proj" in name and name.endswith(".weight") and value.dim() == 2 and value.shape[1] % block == 0:
            rows, cols = value.shape
            padded = torch.zeros(-(-rows // block) * block, cols)
            padded[:rows] = value
            blocks = padded.reshape(-1, block, cols // block, block)
            scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
            codes = (blocks / scale[:, None, :, None]).reshape(-1, cols)[:rows]
            out[name] = codes.to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scale.float()
        else:
            out[name] = value
    save_file(out, os.path.join(folder, "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    mf.write_char_tokenizer(folder, 300)
    return out


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    model = mf.build_hf_model("deepseek_v3", **WIDE).eval()
    folder = str(tmp_path_factory.mktemp("fp8") / "ds")
    return model, folder, write_fp8(model, folder)


def test_fp8_passes_through_and_runs(fp8_model, tmp_path):
    from ktc.api import load_model
    from ktc.runtime.hf import from_bundle

    model, folder, stored = fp8_model
    out = str(tmp_path / "m.ktb")
    compile_bundle(folder, out)  # defaults: the source's own types
    ir = load_model(folder)
    with open_bundle(out) as bundle:
        fp8 = [(n, t) for n, t in bundle.tensors.items() if t.scheme == "fp8_e4m3"]
        assert any(".experts." in n for n, _ in fp8) and any("attn" in n for n, _ in fp8)
        name = "model.layers.1.self_attn.q_b_proj.weight"
        t = bundle.tensors[name]
        assert t.scheme == "fp8_e4m3"
        raw = bundle.tensor(name).reshape(t.shape[0], -1, 132)
        np.testing.assert_array_equal(raw[:, :, 4:].reshape(t.shape), stored[name].view(torch.uint8).numpy())
        from ktc.formats.quantize import dequantize

        ref = next(d.ref for d in ir.dense if d.ref.name == name)
        np.testing.assert_array_equal(dequantize(bundle.tensor(name), "fp8_e4m3", t.shape[1]), to_float32(ref))
    ids = torch.randint(3, 290, (1, 16), generator=torch.Generator().manual_seed(0))
    with from_bundle(out) as km:
        with torch.no_grad():
            got = km.model(ids, **{km.cache_argument: km.new_cache()}).logits
            want = model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 0.2  # e4m3 weights: a few percent each


def test_fp8_experts_convert_exactly_for_the_cpu(fp8_model, tmp_path):
    from ktc.api import load_model
    from ktc.formats.quantize import dequantize, quantize

    _, folder, _ = fp8_model
    out = str(tmp_path / "m.ktb")
    compile_bundle(folder, out, cpu_scheme="int8")
    expert = load_model(folder).layer(1).experts[3]
    with open_bundle(out) as bundle:
        down = bundle.tensor("layers.1.experts.3.down")
        np.testing.assert_array_equal(down, quantize(to_float32(expert.down), "int8"))


def test_fp8_plan_keeps_attention_at_fp8(fp8_model):
    from ktc.api import plan

    _, folder, _ = fp8_model
    auto = plan(folder, vram="1GiB", ram="8GiB", reserve="0", max_tokens=64, cpu_schemes=("int4",))
    bf16 = plan(folder, vram="1GiB", ram="8GiB", reserve="0", max_tokens=64, cpu_schemes=("int4",),
                dense_scheme="bf16")
    assert auto.options.gpu_schemes == ("fp8_e4m3",)
    attention = dict(auto.memory.vram)["attention"], dict(bf16.memory.vram)["attention"]
    assert attention[0] < 0.6 * attention[1]


def test_fp8_weight_without_its_scale_is_refused(fp8_model, tmp_path):
    from safetensors.torch import save_file

    model, _, stored = fp8_model
    folder = tmp_path / "broken"
    write_fp8(model, str(folder))
    broken = dict(stored)
    del broken["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(FormatError, match="q_b_proj.weight.*without its scale tensor|without its scale tensor"):
        compile_bundle(str(folder), str(tmp_path / "m.ktb"))
    broken = dict(stored)
    broken["model.layers.1.self_attn.q_b_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(FormatError, match="scales have shape"):
        compile_bundle(str(folder), str(tmp_path / "m.ktb"))


def write_deepseek_v3_header(folder) -> int:
    """A safetensors header with DeepSeek-V3's full shapes over a sparse file (671B parameters,
    about 690 GB described, no data written): FP8 e4m3 projections with float32 128x128 block
    scales, bf16 embeddings, routers and norms, as released."""
    import struct

    import public_configs

    cfg = public_configs.DEEPSEEK_V3
    h, inter, moe, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"], 128
    q_rank, kv_rank, nope, rope, v = 1536, 512, 128, 64, 128
    header, offset = {}, 0

    def add(name: str, shape: tuple, dtype: str) -> None:
        nonlocal offset
        n = int(np.prod(shape)) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n

    def fp8(name: str, rows: int, cols: int) -> None:
        add(name + ".weight", (rows, cols), "F8_E4M3")
        add(name + ".weight_scale_inv", (-(-rows // 128), -(-cols // 128)), "F32")

    add("model.embed_tokens.weight", (cfg["vocab_size"], h), "BF16")
    add("lm_head.weight", (cfg["vocab_size"], h), "BF16")
    add("model.norm.weight", (h,), "BF16")
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        add(p + "input_layernorm.weight", (h,), "BF16")
        add(p + "post_attention_layernorm.weight", (h,), "BF16")
        fp8(p + "self_attn.q_a_proj", q_rank, h)
        add(p + "self_attn.q_a_layernorm.weight", (q_rank,), "BF16")
        fp8(p + "self_attn.q_b_proj", heads * (nope + rope), q_rank)
        fp8(p + "self_attn.kv_a_proj_with_mqa", kv_rank + rope, h)
        add(p + "self_attn.kv_a_layernorm.weight", (kv_rank,), "BF16")
        fp8(p + "self_attn.kv_b_proj", heads * (nope + v), kv_rank)
        fp8(p + "self_attn.o_proj", h, heads * v)
        if layer < cfg["first_k_dense_replace"]:
            for proj, (rows, cols) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                fp8(p + "mlp." + proj, rows, cols)
            continue
        add(p + "mlp.gate.weight", (cfg["n_routed_experts"], h), "BF16")
        add(p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), "F32")
        for prefix in [f"mlp.experts.{e}." for e in range(cfg["n_routed_experts"])] + ["mlp.shared_experts."]:
            for proj, (rows, cols) in (("gate_proj", (moe, h)), ("up_proj", (moe, h)), ("down_proj", (h, moe))):
                fp8(p + prefix + proj, rows, cols)
    raw = json.dumps(header).encode()
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: no blocks allocated
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    return offset


def test_deepseek_v3_fp8_plans_in_24_gib(tmp_path):
    """DeepSeek-V3 at its released FP8 on a 24 GiB GPU and 512 GiB of RAM: feasible with the
    attention kept at FP8 (at bf16 it alone takes more than 21 GiB)."""
    from click.testing import CliRunner

    from ktc.cli import main

    assert write_deepseek_v3_header(str(tmp_path)) > 600e9
    runner = CliRunner()
    result = runner.invoke(main, ["plan", str(tmp_path), "--vram", "24GiB", "--ram", "512GiB",
                                  "--cpu-schemes", "int4", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    vram = dict(plan["memory"]["vram"]) if isinstance(plan["memory"]["vram"], list) else plan["memory"]["vram"]
    assert plan["options"]["dense_scheme"] == "auto" and plan["options"]["gpu_schemes"] == ["fp8_e4m3"]
    assert 10 * 2**30 < vram["attention"] < 12 * 2**30  # about 11 GiB at FP8 (21.3 GiB at bf16)
    text = runner.invoke(main, ["plan", str(tmp_path), "--vram", "24GiB", "--ram", "512GiB", "--cpu-schemes", "int4"])
    assert text.exit_code == 0 and "VRAM" in text.output and "attention" in text.output
    at_bf16 = runner.invoke(main, ["plan", str(tmp_path), "--vram", "24GiB", "--ram", "512GiB",
                                   "--cpu-schemes", "int4", "--dense-scheme", "bf16"])
    assert at_bf16.exit_code != 0 and "does not fit" in at_bf16.output
