"""GGUF K-quant and IQ4 experts compile byte for byte, and the runtime's experts compute with the
values the ``gguf`` package decodes from them."""

from __future__ import annotations

import numpy as np
import pytest

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.formats.bundle import open_bundle
from ktc.runtime.experts import ExpertSet

WIDE = dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=1, head_dim=64)


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    """A one-layer Qwen3-MoE whose expert rows are whole K-quant super-blocks (256 values)."""
    folder = str(tmp_path_factory.mktemp("wide") / "st")
    return mf.write_safetensors(mf.build_hf_model("qwen3_moe", **WIDE), folder)


def gguf_experts(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """proj -> (stored bytes [E, rows, row_bytes], ggml type name) of layer 0's expert stacks."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.0.ffn_") and "_exps.weight" in t.name:
            proj = t.name.split(".")[2].split("_")[1]
            out[proj] = (np.asarray(t.data).reshape(mf.EXPERTS, -1, np.asarray(t.data).shape[-1]), t.tensor_type.name)
    return out


def decoded(raw: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL"])
def test_kquant_experts_pass_through_and_run(tmp_path, wide_qwen3, qtype):
    path = mf.write_gguf(wide_qwen3, str(tmp_path / "m.gguf"), family="qwen3_moe", expert_qtype=qtype)
    out = str(tmp_path / "m.ktb")
    compile_bundle(path, out, cpu_scheme=qtype.lower())
    source = gguf_experts(path)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 256)).astype(np.float32)
    idx = np.array([[0, 5], [3, 5], [7, 1]], dtype=np.int64)
    weights = rng.uniform(0.2, 1.0, idx.shape).astype(np.float32)
    with open_bundle(out) as bundle:
        for e in range(mf.EXPERTS):
            gate_up = np.concatenate([source["gate"][0][e], source["up"][0][e]])
            np.testing.assert_array_equal(bundle.tensor_bytes(f"layers.0.experts.{e}.gate_up"), gate_up.reshape(-1))
            np.testing.assert_array_equal(bundle.tensor_bytes(f"layers.0.experts.{e}.down"),
                                          source["down"][0][e].reshape(-1))
            assert bundle.tensors[f"layers.0.experts.{e}.down"].scheme == qtype.lower()
        experts = ExpertSet(bundle, 0)
        from ktc.runtime import vnni

        # one token through every selected expert in two parallel regions on a VNNI CPU (iq4_nl
        # among the block kinds, the others among the K-quants)
        assert (experts._fused is not None) == vnni.HAVE_VNNI
        assert (experts.one_call_tables() is not None) == vnni.HAVE_VNNI
        for tokens in (slice(0, 1), slice(0, 3)):  # the one-token path and the batched one
            got = experts.forward(hidden[tokens], idx[tokens], weights[tokens])
            want = np.zeros_like(got)
            for t in range(got.shape[0]):
                for e, w in zip(idx[tokens][t], weights[tokens][t]):
                    g = decoded(source["gate"][0][e], qtype) @ hidden[tokens][t]
                    u = decoded(source["up"][0][e], qtype) @ hidden[tokens][t]
                    want[t] += w * (decoded(source["down"][0][e], qtype) @ (g / (1 + np.exp(-g)) * u))
            error = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert error < 2e-2, (qtype, tokens, error)


@pytest.fixture(scope="module")
def q4_k_gguf(wide_qwen3, tmp_path_factory):
    return mf.write_gguf(wide_qwen3, str(tmp_path_factory.mktemp("q4k") / "m.gguf"), family="qwen3_moe",
                         expert_qtype="Q4_K")


def test_plan_and_compile_default_to_the_source_type(q4_k_gguf, tmp_path):
    from ktc.api import plan
    from ktc.plan_report import render_plan_text

    made = plan(q4_k_gguf, vram="1GiB", ram="8GiB", reserve="0", max_tokens=256)
    assert made.options.gpu_schemes == ("q4_k",) and made.options.cpu_schemes == ("q4_k",)
    assert made.options.from_source == "q4_k"
    assert "(q4_k: the source's own, passed through as stored)" in render_plan_text(made)
    given = plan(q4_k_gguf, vram="1GiB", ram="8GiB", reserve="0", max_tokens=256, cpu_schemes=("int8",))
    assert given.options.cpu_schemes == ("int8",) and given.options.gpu_schemes == ("q4_k",)
    out = str(tmp_path / "m.ktb")
    compile_bundle(q4_k_gguf, out)  # no scheme given: the source's own, byte for byte
    with open_bundle(out) as bundle:
        assert {t.scheme for n, t in bundle.tensors.items() if ".experts." in n and not n.endswith("bias")} == {"q4_k"}


def test_pass_through_scheme_from_a_float_source_is_refused(wide_qwen3, tmp_path):
    from ktc.api import plan
    from ktc.errors import ConfigError

    with pytest.raises(ConfigError, match="q3_k cannot be made from this model's experts"):
        compile_bundle(wide_qwen3, str(tmp_path / "m.ktb"), cpu_scheme="q3_k")
    with pytest.raises(ConfigError, match="iq4_xs cannot be made"):
        plan(wide_qwen3, vram="1GiB", ram="8GiB", reserve="0", gpu_schemes=("iq4_xs",))
    assert not (tmp_path / "m.ktb").exists()


def test_float_source_quantized_to_k_quants(wide_qwen3, tmp_path):
    """q4_k, q5_k and q6_k quantize float experts (ktc's port of llama.cpp's quantizers)."""
    from ktc.formats.quantize import dequantize

    for scheme in ("q4_k", "q6_k"):
        out = str(tmp_path / f"{scheme}.ktb")
        compile_bundle(wide_qwen3, out, cpu_scheme=scheme)
        with open_bundle(out) as bundle:
            assert bundle.tensors["layers.0.experts.3.down"].scheme == scheme
            assert dequantize(bundle.tensor("layers.0.experts.3.down"), scheme, 256).shape == (256, 256)


# llama.cpp's Q4_K_M mix, at a small scale: gate and up Q4_K, ffn_down Q6_K in some layers and
# Q4_K in others, attention Q4_K with attn_v Q6_K, output Q6_K, the token embedding Q4_K.
Q4_K_M_DENSE = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K",
                "attn_output.weight": "Q4_K", "output.weight": "Q6_K", "token_embd.weight": "Q4_K"}


def q4_k_m_experts(layer: int, proj: str) -> str:
    return "Q6_K" if proj == "down" and layer == 0 else "Q4_K"


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A two-layer Qwen3-MoE at K-quant widths with a tokenizer, its float twin, and its GGUF
    quantized as llama.cpp's Q4_K_M mixes types."""
    root = tmp_path_factory.mktemp("q4km")
    model = mf.build_hf_model("qwen3_moe", **{**WIDE, "num_hidden_layers": 2, "vocab_size": 300}).eval()
    folder = str(root / "st")
    model.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    path = mf.write_gguf(folder, str(root / "m-Q4_K_M.gguf"), family="qwen3_moe",
                         expert_qtype=q4_k_m_experts, dense_qtype=Q4_K_M_DENSE)
    return model, path


def test_q4_k_m_compiles_byte_for_byte_and_runs(q4_k_m, tmp_path):
    import torch
    from gguf import GGUFReader

    from ktc.runtime.hf import from_bundle
    from ktc.runtime.linear import HostLinear

    model, path = q4_k_m
    out = str(tmp_path / "m.ktb")
    compile_bundle(path, out)  # defaults: every tensor at the file's own type
    stored = {t.name: (np.asarray(t.data), t.tensor_type.name) for t in GGUFReader(path).tensors}
    with open_bundle(out) as bundle:
        sources = {t.name: t.source for t in bundle.tensors.values() if getattr(t, "source", None)}
        kept = 0
        for name, t in bundle.tensors.items():
            source = sources.get(name)
            if source in stored and stored[source][1] in ("Q4_K", "Q6_K"):
                assert t.scheme == stored[source][1].lower(), name
                np.testing.assert_array_equal(bundle.tensor_bytes(name), stored[source][0].reshape(-1))
                kept += 1
        assert kept == 2 * 4 + 1 + 1  # four attention matrices a layer, output, token_embd
        for layer, down in ((0, "q6_k"), (1, "q4_k")):
            e = 5
            assert bundle.tensors[f"layers.{layer}.experts.{e}.gate_up"].scheme == "q4_k"
            assert bundle.tensors[f"layers.{layer}.experts.{e}.down"].scheme == down
            gate, up = stored[f"blk.{layer}.ffn_gate_exps.weight"][0], stored[f"blk.{layer}.ffn_up_exps.weight"][0]
            np.testing.assert_array_equal(bundle.tensor_bytes(f"layers.{layer}.experts.{e}.gate_up"),
                                          np.concatenate([gate[e], up[e]]).reshape(-1))
            np.testing.assert_array_equal(bundle.tensor_bytes(f"layers.{layer}.experts.{e}.down"),
                                          stored[f"blk.{layer}.ffn_down_exps.weight"][0][e].reshape(-1))
    ids = torch.randint(3, 290, (1, 16), generator=torch.Generator().manual_seed(0))
    with from_bundle(out) as km:
        assert {m.scheme for m in km.model.modules() if isinstance(m, HostLinear)} == {"q4_k", "q6_k"}
        with torch.no_grad():
            got = km.model(ids, **{km.cache_argument: km.new_cache()}).logits
            want = model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 0.3  # 4-bit weights, a rough bound


def test_q4_k_m_plans_at_its_own_types(q4_k_m):
    from ktc.api import plan
    from ktc.formats.schemes import expert_footprint
    from ktc.passes.planner import expert_shape
    from ktc.plan_report import llamacpp_plan, render_plan_text

    _, path = q4_k_m
    made = plan(path, vram="1GiB", ram="8GiB", reserve="0", max_tokens=256)
    assert made.options.gpu_schemes == ("q4_k+q6_k", "q4_k") and made.options.layer_schemes == ("q4_k+q6_k", "q4_k")
    for layer, row in zip(made.placement.layers, made.placement.experts):
        assert {p.scheme for p in row} == {"q4_k+q6_k" if layer == 0 else "q4_k"}
    assert "the source's own, passed through as stored layer by layer" in render_plan_text(made)
    # the attention in its own types: Q4_K and Q6_K bytes, not bf16
    attention = dict(made.memory.vram)["attention"]
    assert attention < 0.45 * 2 * (256 * 256 * 3 + 128 * 256 * 2) * 2  # well under bf16's 2 bytes a weight
    cpp = llamacpp_plan(made)
    assert cpp.predicted_ms_per_step > 0
    from ktc.api import load_model

    shape = expert_shape(load_model(path))
    assert expert_footprint(shape, "q4_k+q6_k").data_bytes == 2 * 256 * 256 // 256 * 144 + 256 * 256 // 256 * 210


def test_export_llamacpp_plans_at_the_gguf_types(q4_k_m):
    from click.testing import CliRunner

    from ktc.cli import main

    _, path = q4_k_m
    runner = CliRunner()
    result = runner.invoke(main, ["plan", path, "--vram", "3500KiB", "--ram", "8GiB", "--reserve", "0",
                                  "--max-tokens", "16", "--export-llamacpp"])
    assert result.exit_code == 0, result.output
    assert "q4_k+q6_k, q4_k: the source's own" in result.output and "llama.cpp: -ngl 999" in result.output
    refused = runner.invoke(main, ["plan", path, "--vram", "3500KiB", "--export-llamacpp", "--gpu-schemes", "bf16"])
    assert refused.exit_code != 0 and "plans at the GGUF's own types" in refused.output


def test_kquant_rows_that_are_not_whole_super_blocks_are_refused(q4_k_gguf, tmp_path):
    """A Q4_K tensor whose row length is not a multiple of 256 (its header patched), and a file
    cut inside a block: each a FormatError naming the tensor, never a requantization."""
    import struct

    from ktc.errors import FormatError

    raw = bytearray(open(q4_k_gguf, "rb").read())
    name = b"blk.0.ffn_down_exps.weight"
    at = raw.index(name) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    dims = list(struct.unpack_from(f"<{n_dims}Q", raw, at + 4))
    dims[0], dims[1] = dims[0] // 2, dims[1] * 2  # same bytes, rows of 128 values
    struct.pack_into(f"<{n_dims}Q", raw, at + 4, *dims)
    bad = tmp_path / "rows.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="ffn_down_exps.*|row length 128 is not a multiple of Q4_K"):
        compile_bundle(str(bad), str(tmp_path / "a.ktb"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(q4_k_gguf, "rb").read()[:-100])
    with pytest.raises(FormatError):
        compile_bundle(str(cut), str(tmp_path / "b.ktb"))
    assert not (tmp_path / "a.ktb").exists() and not (tmp_path / "b.ktb").exists()


def test_q4_k_m_fused_layer_equals_expert_by_expert(q4_k_m, tmp_path):
    """The fused one-token path through a layer whose experts keep gate/up in q4_k and down in
    q6_k gives what the experts give one by one."""
    from ktc.runtime.kernels import expert_forward

    _, path = q4_k_m
    out = str(tmp_path / "m.ktb")
    compile_bundle(path, out)
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    idx, weights = np.array([[2, 6]]), np.array([[0.7, 0.3]], dtype=np.float32)
    with open_bundle(out) as bundle:
        experts = ExpertSet(bundle, 0)
        got = experts.forward(x[None, :], idx, weights)[0]
        want = sum(w * expert_forward(experts.cpu[e].gate_up, experts.cpu[e].down, experts.cpu[e].scheme, x)
                   for e, w in zip(idx[0], weights[0]))
        assert experts.cpu[2].scheme == "q4_k+q6_k"
        experts.close()
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_q4_k_m_fast_steps_compiled_equal_step_by_step(q4_k_m, tmp_path):
    """A Q4_K_M model's fast decode steps through the compiled attention half (q4_k and q6_k
    projections in one call against activations quantized per 256) give what the same steps
    give one matrix at a time."""
    import torch

    from ktc.runtime import vnni
    from ktc.runtime.hf import from_bundle

    if not vnni.HAVE_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI (or the JIT is off)")
    _, path = q4_k_m
    out = str(tmp_path / "m.ktb")
    compile_bundle(path, out)
    prompt = torch.randint(3, 290, (1, 8), generator=torch.Generator().manual_seed(1))
    tokens = [5, 17, 42, 99]
    runs = []
    with from_bundle(out) as km:
        assert km.fast is not None and all(layer.compiled is not None for layer in km.fast.layers)
        compiled = [layer.compiled for layer in km.fast.layers]
        for use in (True, False):
            for layer, args in zip(km.fast.layers, compiled):
                layer.compiled = args if use else None
            with torch.no_grad():
                km.model(prompt, **{km.cache_argument: km.new_cache()})
            runs.append([km.fast.step(t).copy() for t in tokens])
    for got, want in zip(*runs):
        assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-5
