"""Whole models from bundles (``ktc.runtime.hf``) against transformers' own models on the same
checkpoints, family by family: logits, greedy tokens, and the quantized schemes' agreement."""

from __future__ import annotations

import os
import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.runtime import attention
from ktc.runtime.generate import Sampling, generate
from ktc.runtime.hf import from_bundle

RUN_FAMILIES = list(mf.FAMILIES) + list(mf.EXTRA_FAMILIES)
VOCAB = 96


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's tiny model (in eval mode: phimoe's router samples in training mode) and its
    folder with safetensors, config and a tokenizer."""
    root = tmp_path_factory.mktemp("run")
    out = {}
    for family in RUN_FAMILIES:
        model = mf.build_hf_model(family).eval()
        folder = str(root / family)
        mf.write_safetensors(model, folder)
        mf.write_char_tokenizer(folder, VOCAB)
        out[family] = (model, folder)
    return out


def prompt_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def reference_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    out = ids
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(out).logits[0, -1].argmax()
            out = torch.cat([out, nxt.view(1, 1)], dim=1)
    return out[0, ids.shape[1]:].tolist()


def logits_of(km, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return km.model(ids, **{km.cache_argument: km.new_cache()}).logits


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def relative_to_transformers(model, folder: str, path: str, check=None, **options) -> float:  # type: ignore[no-untyped-def]
    """Compile ``folder`` into ``path`` with ``options`` and return the bundle's logits' relative
    error against ``model`` on a 16-token prompt (``check`` looks at the loaded model first)."""
    compile_bundle(folder, path, **options)
    ids = prompt_ids(16)
    with torch.no_grad():
        want = model(ids).logits
    with from_bundle(path) as km:
        if check is not None:
            check(km)
        return relative(logits_of(km, ids), want)


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_f32_bundle_equals_transformers(family, checkpoints, tmp_path):
    model, folder = checkpoints[family]
    path = str(tmp_path / "f32.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    ids = prompt_ids(32)
    with torch.no_grad():
        want = model(ids).logits
    with from_bundle(path) as km:
        assert relative(logits_of(km, ids), want) < 1e-4
        run = generate(km, ids[0].tolist(), max_new_tokens=16, sampling=Sampling(temperature=0),
                       stop_at_eos=False)
    assert run.generated_tokens == reference_greedy(model, ids, 16)


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_f32_long_prompt_equals_transformers(family, checkpoints, tmp_path):
    """A prompt long enough for the CPU's prompt attention a block of queries at a time
    (``runtime.attention``, where the family's attention is SDPA; gpt-oss's is eager): the logits of
    transformers' own model."""
    model, folder = checkpoints[family]
    path = str(tmp_path / "f32.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    chunk = attention.MIN_QUERIES + 8
    ids = prompt_ids(2 * chunk, seed=2)
    with torch.no_grad():
        want = model(ids).logits
    with from_bundle(path) as km:
        assert km.model.config._attn_implementation == (attention.NAME if model.config._attn_implementation == "sdpa"
                                                         else model.config._attn_implementation)
        assert relative(logits_of(km, ids), want) < 1e-4
        # in two chunks: the second's queries after the first's keys (SDPA's masks)
        assert relative(torch.from_numpy(km.forward_window(ids[0].numpy(), 0, 2 * chunk, batch=chunk)), want[0]) < 1e-4


def rounded_to_bf16(model):
    """transformers' model with the weights a bf16 bundle stores in bf16 rounded to bf16 (every
    matrix but the routers, which bundles keep in float32), computed in float32."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() >= 2 and not name.endswith(("gate.weight", "router.weight")):
                p.copy_(p.to(torch.bfloat16).float())
    return rounded


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_bf16_bundle_within_1e_2(family, checkpoints, tmp_path):
    """Against transformers on the same bf16 weights: what the runtime adds (bf16 products
    in prefill) stays within 1e-2. (Against the float32 weights, bf16 rounding of attention can
    flip a tiny random model's routing of a token, which no runtime avoids: transformers' own
    bf16 model flips one of these 32 tokens for gpt-oss.)"""
    model, folder = checkpoints[family]
    path = str(tmp_path / "bf16.ktb")
    compile_bundle(folder, path, cpu_scheme="bf16", dense_scheme="bf16")
    ids = prompt_ids(32)
    with torch.no_grad():
        want = rounded_to_bf16(model)(ids).logits
    with from_bundle(path) as km:
        assert relative(logits_of(km, ids), want) < 1e-2


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_int8_experts_agree_on_the_next_token(family, checkpoints, tmp_path):
    """Greedy top-1 agreement over 256 positions of one sequence (teacher-forced)."""
    model, folder = checkpoints[family]
    path = str(tmp_path / "int8.ktb")
    compile_bundle(folder, path, cpu_scheme="int8", dense_scheme="bf16")
    ids = prompt_ids(256, seed=1)
    with torch.no_grad():
        want = model(ids).logits[0].argmax(-1)
    with from_bundle(path) as km:
        got = logits_of(km, ids)[0].argmax(-1)
    assert float((got == want).float().mean()) >= 0.95


def test_generate_of_transformers_works(checkpoints, tmp_path):
    """The returned model's generate() (transformers' own loop) gives the greedy tokens too."""
    model, folder = checkpoints["qwen3_moe"]
    path = str(tmp_path / "m.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    ids = prompt_ids(12)
    with from_bundle(path) as km:
        out = km.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out[0, 12:].tolist() == reference_greedy(model, ids, 8)


def test_prefill_runs_the_last_layers_experts_for_kept_positions_only(checkpoints, tmp_path):
    """A prefill chunk runs the last layer's experts only for the positions whose logits it keeps
    (past that layer only the final norm and the output matrix read a position, and llama.cpp
    skips the rest the same way); the kept logits are transformers' own."""
    model, folder = checkpoints["qwen3_moe"]
    path = str(tmp_path / "m.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    ids = prompt_ids(20)[0].numpy()
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0]
    with from_bundle(path) as km:
        final = km.last_layer_experts
        assert final is not None and final.layer == model.config.num_hidden_layers - 1 and len(km.experts) > 1
        rows = []
        real = final._forward_torch
        final._forward_torch = lambda h, i, w: rows.append(h.shape[0]) or real(h, i, w)
        last = km.forward_window(ids, 19, 20, batch=8)  # chunks of 8, 8 and 4 tokens
        assert rows == [1, 1, 1] and final.rows_wanted is None
        every = km.forward_window(ids, 6, 20, batch=8)
        assert rows[3:] == [2, 8, 4]  # positions 6 and 7 kept: the first chunk's last two rows, then all
    assert relative(torch.from_numpy(last), want[19:]) < 1e-4
    assert relative(torch.from_numpy(every), want[6:]) < 1e-4


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "int4_g32", "mxfp4", "int8"])
def test_quantized_dense_weights_run_through_ktc_kernels(scheme, checkpoints, tmp_path):
    """--dense-scheme stores attention and lm_head quantized; on the CPU they run through ktc's
    kernels and the logits stay near the float model's (4-bit: a rough bound)."""
    model, folder = checkpoints["qwen3_moe"]
    path = str(tmp_path / "q.ktb")
    compile_bundle(folder, path, cpu_scheme=scheme, dense_scheme=scheme)
    ids = prompt_ids(32)
    with torch.no_grad():
        want = model(ids).logits
    with from_bundle(path) as km:
        from ktc.runtime.linear import HostLinear

        linears = [m for m in km.model.modules() if isinstance(m, HostLinear)]
        assert linears and {m.scheme for m in linears} == {scheme}
        got = logits_of(km, ids)
        single = logits_of(km, ids[:, :1])  # one token: the matrix-vector kernels
    bound = 3e-2 if scheme in ("q8_0", "int8") else 0.3
    assert relative(got, want) < bound
    with torch.no_grad():
        assert relative(single, model(ids[:, :1]).logits) < bound


@pytest.mark.parametrize("family, split_kv_b", [("qwen3_moe", False), ("mixtral", False), ("qwen2_moe", False),
                                                ("gpt_oss", False), ("deepseek_v3", False), ("deepseek_v2", False),
                                                ("deepseek_v3", True), ("olmoe", False)])
def test_gguf_with_llamacpp_names_runs_like_its_safetensors_twin(family, split_kv_b, tmp_path):
    """A GGUF with llama.cpp's tensor names and tokenizer metadata (written by the gguf package;
    Mixtral as llama.cpp writes it: the llama architecture with experts, Q and K rows permuted)
    compiles into a bundle that carries a config and tokenizer derived from the GGUF's metadata,
    and gives the same logits as the bundle of its safetensors twin. Qwen2-MoE's shared expert
    and gpt-oss's heads are as wide as the file says (transformers' mapping left them at its
    classes' defaults), gpt-oss's attention sinks found under llama.cpp's name; DeepSeek-V2/V3
    (llama.cpp's deepseek2, which transformers' mapping lacks), OLMoE and gpt-oss (whose yarn
    rope keys, written as llama.cpp's converter writes the released models', transformers' mapping
    fails to read) run from a config ktc builds from the metadata, V3's router bias found under llama.cpp's exp_probs_b, and the key/value
    up-projection joined again where the file stores it split (attn_k_b, attn_v_b: llama.cpp's
    converter since MLA's absorption)."""
    base = mf.build_hf_model(family)
    twin = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 300})).eval()
    folder = str(tmp_path / "st")
    twin.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    gguf_path = mf.write_gguf(folder, str(tmp_path / "twin.gguf"), family=family, split_kv_b=split_kv_b)
    compile_bundle(gguf_path, str(tmp_path / "g.ktb"), cpu_scheme="f32", dense_scheme="f32")
    compile_bundle(folder, str(tmp_path / "s.ktb"), cpu_scheme="f32", dense_scheme="f32")
    ids = torch.randint(3, 290, (1, 32), generator=torch.Generator().manual_seed(0))
    text = "A Mixture-of-Experts model replaces the feed-forward block"
    logits, encoded = [], []
    for name in ("g.ktb", "s.ktb"):
        with from_bundle(str(tmp_path / name)) as km:
            logits.append(logits_of(km, ids))
            encoded.append(km.tokenizer(text)["input_ids"])
    assert relative(logits[0], logits[1]) < 1e-6
    assert encoded[0] == encoded[1]
    with torch.no_grad():
        assert relative(logits[1], twin(ids).logits) < 1e-4


def test_a_deepseek_v3_gguf_without_expert_groups_routes_without_them(tmp_path):
    """A DeepSeek-V3 GGUF whose router has one group (Kimi-K2's, Moonlight's) runs with one group
    (transformers' class alone would take its defaults, 8 groups of which 4 are used): the logits
    of its safetensors twin."""
    base = mf.build_hf_model("deepseek_v3", n_group=1, topk_group=1)
    twin = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 300})).eval()
    folder = str(tmp_path / "st")
    twin.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    gguf_path = mf.write_gguf(folder, str(tmp_path / "twin.gguf"), family="deepseek_v3", split_kv_b=True)
    compile_bundle(gguf_path, str(tmp_path / "g.ktb"), cpu_scheme="f32", dense_scheme="f32")
    ids = torch.randint(3, 290, (1, 32), generator=torch.Generator().manual_seed(0))
    with from_bundle(str(tmp_path / "g.ktb")) as km:
        assert (km.model.config.n_group, km.model.config.topk_group) == (1, 1)
        got = logits_of(km, ids)
    with torch.no_grad():
        assert relative(got, twin(ids).logits) < 1e-4


def test_a_gguf_split_into_parts_compiles_as_the_whole_file_does(tmp_path):
    """A GGUF split into parts (as llama.cpp's gguf-split writes them: the metadata in the first,
    a few tensors each) compiles from its folder, or from any part, into a bundle whose logits and
    tokenizer are the unsplit file's, its experts passed through from the parts' own bytes."""
    from ktc.formats.bundle import open_bundle

    base = mf.build_hf_model("qwen3_moe")
    twin = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 300})).eval()
    folder = str(tmp_path / "st")
    twin.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    (tmp_path / "whole").mkdir()
    (tmp_path / "parts").mkdir()
    whole = mf.write_gguf(folder, str(tmp_path / "whole" / "m.gguf"), family="qwen3_moe", expert_qtype="Q8_0")
    first = mf.write_gguf(folder, str(tmp_path / "parts" / "m.gguf"), family="qwen3_moe", expert_qtype="Q8_0",
                          split_max_tensors=7)
    parts = sorted(os.listdir(tmp_path / "parts"))
    assert len(parts) > 3 and first.endswith("m-00001-of-%05d.gguf" % len(parts))
    compile_bundle(whole, str(tmp_path / "whole.ktb"), dense_scheme="f32")
    compile_bundle(str(tmp_path / "parts"), str(tmp_path / "folder.ktb"), dense_scheme="f32")
    compile_bundle(str(tmp_path / "parts" / parts[-1]), str(tmp_path / "last.ktb"), dense_scheme="f32")
    ids = torch.randint(3, 290, (1, 16), generator=torch.Generator().manual_seed(0))
    text = "A Mixture-of-Experts model replaces the feed-forward block"
    results = []
    for name in ("whole.ktb", "folder.ktb", "last.ktb"):
        with open_bundle(str(tmp_path / name)) as bundle:
            assert {t.scheme for t in bundle.tensors.values() if t.expert is not None} == {"q8_0"}
        with from_bundle(str(tmp_path / name)) as km:
            results.append((logits_of(km, ids), km.tokenizer(text)["input_ids"]))
    for logits, encoded in results[1:]:
        assert torch.equal(logits, results[0][0]) and encoded == results[0][1]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_gguf_bpe_vocabulary_splits_text_as_its_pre_tokenizer_names(family, tmp_path):
    """A GGUF whose byte-level BPE vocabulary names GPT-2's pre-tokenizer ("gpt-2", as llama.cpp
    reads it) tokenizes as the tokenizer it came from, whatever the architecture (transformers'
    conversion alone split a Qwen3-MoE file's text as Qwen2's tokenizer does: digits one by one,
    newlines apart; a Mixtral file, read through Llama's class, kept GPT-2's); a file that names
    Qwen2's keeps that split; one that names DeepSeek-V3's or DeepSeek-LLM's (DeepSeek-V2's files)
    gets llama.cpp's (transformers' table lacks them; on the demo model converted with that name,
    ktc's perplexity and llama-perplexity's agree: 90.1542 and 90.1541 for DeepSeek-V3's)."""
    from ktc.runtime.hf import tokenizer_from_bundle

    base = mf.build_hf_model(family)
    twin = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 512})).eval()
    folder = str(tmp_path / "st")
    twin.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 512)
    text = "float32 weights, a 1-D tensor of 16 or 32 values in f32"  # "32", " 1": one token each
    source = _tokenizer_from_folder(folder)
    for pre in ("gpt-2", "qwen2", "deepseek-v3", "deepseek-llm"):
        gguf_path = mf.write_gguf(folder, str(tmp_path / f"{pre}.gguf"), family=family, tokenizer_pre=pre)
        compile_bundle(gguf_path, str(tmp_path / f"{pre}.ktb"), cpu_scheme="f32", dense_scheme="f32")
        tokenizer = tokenizer_from_bundle(str(tmp_path / f"{pre}.ktb"))
        if pre == "gpt-2":
            assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
        elif pre == "qwen2":  # the named split, as transformers' conversion sets it
            assert "Split" in str(tokenizer.backend_tokenizer.pre_tokenizer)
        else:
            pieces = [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("in 12345 steps")]
            if pre == "deepseek-v3":  # llama.cpp's DeepSeek-V3 split: digits by threes before anything else
                assert "123" in pieces and "45" in pieces, pieces
            else:  # DeepSeek-LLM's: letters after an optional space, then digit runs whole
                assert pieces == ["in", "Ġ", "12345", "Ġsteps"], pieces


def _tokenizer_from_folder(folder: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_a_deepseek_gguf_with_yarn_gets_its_rope_scaling(tmp_path):
    """A DeepSeek GGUF's yarn metadata (as llama.cpp's converter writes DeepSeek-V2's: factor 40,
    mscale_all_dim 0.707 stored times 0.1) becomes the config's rope parameters, as the release's
    config.json states them."""
    from ktc.formats.bundle import open_bundle

    folder = str(tmp_path / "st")
    mf.build_hf_model("deepseek_v2").save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_log_multiplier": 0.0707}
    gguf_path = mf.write_gguf(folder, str(tmp_path / "y.gguf"), family="deepseek_v2", metadata=yarn)
    compile_bundle(gguf_path, str(tmp_path / "y.ktb"), cpu_scheme="f32", dense_scheme="f32")
    with open_bundle(str(tmp_path / "y.ktb")) as bundle:
        config = bundle.manifest["run"]["config"]
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert rope["rope_type"] == "yarn" and rope["factor"] == 40.0 and rope["original_max_position_embeddings"] == 4096
    assert rope["mscale_all_dim"] == pytest.approx(0.707, rel=1e-5) and rope["mscale"] == pytest.approx(0.707, rel=1e-5)


def test_gguf_mixtral_rows_reordered_take_the_compiled_attention_step(tmp_path):
    """A Mixtral GGUF's query and key rows, put back from llama.cpp's rotary order into arrays of
    their own beside the bundle's read-only map, still go through the attention half's one
    compiled call with the value rows (a set of matrices whose flags differ was refused, and
    every layer's step ran matrix by matrix), and it gives what the step-by-step attention gives."""
    from ktc.runtime import vnni

    if not vnni.HAVE_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI (or the JIT is off)")
    base = mf.build_hf_model("mixtral")
    twin = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 300})).eval()
    folder = str(tmp_path / "st")
    twin.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    gguf_path = mf.write_gguf(folder, str(tmp_path / "twin.gguf"), family="mixtral")
    path = str(tmp_path / "g.ktb")
    compile_bundle(gguf_path, path, cpu_scheme="q8_0", dense_scheme="q8_0")
    prompt = torch.randint(3, 290, (1, 8), generator=torch.Generator().manual_seed(1))
    runs = []
    with from_bundle(path) as km:
        assert km.fast is not None
        layer = km.fast.layers[0]
        assert layer.q.raw.flags.writeable != layer.v.raw.flags.writeable  # what the case is about
        compiled = [one.compiled for one in km.fast.layers]
        assert all(args is not None for args in compiled)
        for use in (True, False):
            for one, args in zip(km.fast.layers, compiled):
                one.compiled = args if use else None
            with torch.no_grad():
                km.model(prompt, **{km.cache_argument: km.new_cache()})
            runs.append([km.fast.step(t).copy() for t in (5, 17, 42)])
    for got, want in zip(*runs):
        assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-5


def test_tied_embeddings_run_on_the_host_and_on_a_device(tmp_path):
    """lm_head tied to the input embedding: the bundle stores the table once, lm_head reads it."""
    import transformers

    base = mf.build_hf_model("qwen3_moe")
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**base.config.to_dict(), "tie_word_embeddings": True})).eval()
    folder = str(tmp_path / "tied")
    model.save_pretrained(folder)
    mf.write_char_tokenizer(folder, VOCAB)
    path = str(tmp_path / "t.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    ids = prompt_ids(16)
    with torch.no_grad():
        want = model(ids).logits
    for device, bound in ((None, 1e-4), ("cpu", 1e-2)):  # on a device the KV cache is the plan's bf16
        with from_bundle(path, device=device) as km:
            assert relative(logits_of(km, ids), want) < bound, device


def test_fp8_checkpoint_runs_from_its_dequantized_bundle(tmp_path):
    """DeepSeek-V3's FP8 weights with block scales: the bundle stores them in its own schemes and
    drops the source's quantization_config, so transformers builds a plain model to fill."""
    from safetensors.torch import load_file, save_file

    model = mf.build_hf_model("deepseek_v3").eval()
    src = mf.write_safetensors(model, str(tmp_path / "src"))
    state = load_file(f"{src}/model.safetensors")
    block, out = 16, {}
    for name, value in state.items():
        if (name.endswith("proj.weight") and value.dim() == 2 and value.shape[0] % block == 0
                and value.shape[1] % block == 0):
            rows, cols = value.shape
            blocks = value.reshape(rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            out[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scale.float()
        else:
            out[name] = value
    import json
    import os
    import shutil

    os.makedirs(tmp_path / "fp8")
    save_file(out, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.load(open(f"{src}/config.json"))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    json.dump(config, open(tmp_path / "fp8" / "config.json", "w"))
    mf.write_char_tokenizer(str(tmp_path / "fp8"), VOCAB)
    shutil.rmtree(src)

    def no_quantization_config(km):  # type: ignore[no-untyped-def]
        assert "quantization_config" not in km.bundle.run_info["config"]

    error = relative_to_transformers(model, str(tmp_path / "fp8"), str(tmp_path / "fp8.ktb"),
                                     no_quantization_config, cpu_scheme="f32", dense_scheme="f32")
    assert error < 0.2  # FP8 e4m3 weights: a few percent per matrix


def test_gpt_oss_released_mxfp4_checkpoint_runs(tmp_path):
    """gpt-oss as released (experts in MXFP4 _blocks/_scales) passes through to mxfp4 experts."""
    model = mf.build_hf_model("gpt_oss").eval()
    src = mf.write_safetensors(model, str(tmp_path / "src"))
    mf.write_gpt_oss_mxfp4(src, str(tmp_path / "mx"))
    mf.write_char_tokenizer(str(tmp_path / "mx"), VOCAB)

    def mxfp4_experts(km):  # type: ignore[no-untyped-def]
        assert {e.cpu[0].scheme for e in km.experts} == {"mxfp4"}

    error = relative_to_transformers(model, str(tmp_path / "mx"), str(tmp_path / "mx.ktb"), mxfp4_experts,
                                     cpu_scheme="mxfp4", dense_scheme="f32")
    assert error < 0.3  # 4-bit experts against float32 ones
