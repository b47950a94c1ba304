"""ktc's own decode steps (``runtime.fast_decode``) against transformers' steps on the same
bundle: logits step by step, greedy tokens, the KV cache both share, and the models it leaves to
transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.errors import KtcError
from ktc.runtime import fast_decode, vnni
from ktc.runtime.generate import Sampling, generate
from ktc.runtime.hf import from_bundle

VOCAB = 96


def _bundle(tmp_path, family: str, scheme: str = "f32", dense: str | None = None, **overrides) -> str:
    model = mf.build_hf_model(family, **overrides).eval()
    folder = str(tmp_path / family)
    mf.write_safetensors(model, folder)
    mf.write_char_tokenizer(folder, VOCAB)
    path = str(tmp_path / f"{family}-{scheme}.ktb")
    compile_bundle(folder, path, cpu_scheme=scheme, dense_scheme=dense or scheme)
    return path


def _prompt(length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def _steps(km, prompt: list[int], tokens: list[int], fast: bool) -> list[np.ndarray]:
    """Logits of decode steps after a transformers prefill of ``prompt``: ktc's steps or
    transformers' own."""
    cache = km.new_cache()
    with torch.inference_mode():
        km.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        if fast:
            return [km.fast.step(t).copy() for t in tokens]
        return [km.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].numpy().copy()
                for t in tokens]


def _relative(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want))


CASES = [("mixtral", "f32", {}), ("mixtral", "q4_0", {}), ("qwen3_moe", "f32", {}), ("qwen3_moe", "q8_0", {}),
         ("mixtral", "f32", {"sliding_window": 5}),  # the window from the config
         ("qwen3_moe", "f32", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
         ("qwen3_moe", "int8", {"mlp_only_layers": [1]}),  # a dense MLP layer between MoE layers
         ("olmoe", "f32", {}), ("olmoe", "q4_0", {"clip_qkv": 0.05}),  # norms over all heads; clipped
         ("qwen3_moe", "fp8_e4m3", {"hidden_size": 128, "moe_intermediate_size": 128}),  # rows of 128-value blocks
         ("qwen3_moe", "int4_g128", {"hidden_size": 128, "moe_intermediate_size": 128}), ("mixtral", "int4_g32", {}),
         # attention sinks, biased projections, half-width yarn rotary tables, sliding and full
         # layers in turn, the router's bias, clamped SwiGLU experts with biases
         ("gpt_oss", "f32", {"sliding_window": 5}), ("gpt_oss", "mxfp4", {"sliding_window": 5}),
         # a shared expert beside the routed ones, times its gate's sigmoid; biased q/k/v
         ("qwen2_moe", "f32", {}), ("qwen2_moe", "q4_0", {}), ("qwen2_moe", "int8", {"mlp_only_layers": [1]}),
         # rotary on half of each head, sigmoid routing with a score correction, shared experts
         # without a gate, a dense first layer, biased q/k/v; and with query/key norms
         ("glm4_moe", "f32", {}), ("glm4_moe", "q8_0", {}), ("glm4_moe", "q4_0", {"use_qk_norm": True}),
         ("dots1", "f32", {}), ("dots1", "q8_0", {})]  # Qwen3's attention, grouped sigmoid routing, shared experts


@pytest.mark.parametrize("family,scheme,overrides", CASES)
def test_fast_steps_equal_transformers_steps(family, scheme, overrides, tmp_path):
    path = _bundle(tmp_path, family, scheme, **overrides)
    prompt, tokens = _prompt(12), _prompt(20)[12:]
    with from_bundle(path) as km:
        assert km.fast is not None
        # quantized projections take the compiled attention step where the CPU has VNNI
        assert all(layer.compiled is not None for layer in km.fast.layers) == (scheme != "f32" and vnni.HAVE_VNNI)
        fast = _steps(km, prompt, tokens, fast=True)
        # every layer in one compiled call where each takes the one-call layer step (not where a
        # layer has a shared expert: its attention, routed experts and shared expert a call each)
        one_call = (scheme != "f32" and vnni.HAVE_VNNI and not overrides.get("mlp_only_layers")
                    and family not in ("qwen2_moe", "glm4_moe", "dots1"))
        assert (km.fast._every is not None) == one_call
        assert (km.fast.seconds[:-1] > 0).all()  # each layer's time, in either way
        length = km.cache.get_seq_length()
        slow = _steps(km, prompt, tokens, fast=False)
        assert length == km.cache.get_seq_length() == 20  # both fill the same cache
    assert _relative(fast, slow) < 1e-5


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("family,scheme,overrides", [("qwen3_moe", "int8", {}),
                                                     ("gpt_oss", "mxfp4", {"sliding_window": 5})])
def test_bf16_attention_takes_the_one_call_stack(family, scheme, overrides, tmp_path):
    """bf16 projections (``ktc compile``'s default for a checkpoint's non-expert weights; with
    gpt-oss's biases, as its released checkpoints compile) take the compiled layer step and the
    stack's one call, with transformers' logits."""
    path = _bundle(tmp_path, family, scheme, dense="bf16", **overrides)
    prompt, tokens = _prompt(12), _prompt(20)[12:]
    with from_bundle(path) as km:
        assert km.fast.layers[0].q.scheme == "bf16"
        assert all(layer.compiled is not None for layer in km.fast.layers)
        fast = _steps(km, prompt, tokens, fast=True)
        assert km.fast._every is not None
        slow = _steps(km, prompt, tokens, fast=False)
    assert _relative(fast, slow) < 1e-5


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("family,overrides", [("qwen3_moe", {}), ("olmoe", {"clip_qkv": 0.05}),
                                              ("gpt_oss", {"sliding_window": 5}),
                                              ("qwen2_moe", {"mlp_only_layers": [1], "intermediate_size": 64,
                                                             "shared_expert_intermediate_size": 64}),
                                              ("glm4_moe", {}),
                                              ("deepseek_v3", {"qk_nope_head_dim": 16, "kv_lora_rank": 32,
                                                               "q_lora_rank": 32})])
def test_compiled_attention_equals_the_step_by_step_one(family, overrides, tmp_path):
    """The attention half in one compiled call (with a shared expert or a dense MLP, the whole
    layer; a latent attention's too) gives what the same steps give one by one."""
    path = _bundle(tmp_path, family, "q8_0", **overrides)
    prompt, tokens = _prompt(12), _prompt(20)[12:]
    with from_bundle(path) as km:
        assert all(layer.compiled is not None for layer in km.fast.layers)
        assert all(layer.ffn is not None for layer in km.fast.layers if layer.shared or layer.mlp)
        compiled = _steps(km, prompt, tokens, fast=True)
        for layer in km.fast.layers:
            layer.compiled = None
        stepwise = _steps(km, prompt, tokens, fast=True)
    assert _relative(compiled, stepwise) < 1e-6


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_every_layer_in_one_call_equals_a_call_a_layer(tmp_path):
    """The stack of layers in one compiled call (``_layers_token``) gives the logits and fills
    the cache as one call a layer does."""
    path = _bundle(tmp_path, "mixtral", "q8_0", sliding_window=5)  # each layer's window start too
    prompt, tokens = _prompt(12), _prompt(20)[12:]
    with from_bundle(path) as km:
        together = _steps(km, prompt, tokens, fast=True)
        assert km.fast._every is not None
        keys = [layer.keys[:, :20].copy() for layer in km.fast.layers]
        km.fast._every_layer = lambda: None
        apart = _steps(km, prompt, tokens, fast=True)
        assert all(np.array_equal(k, layer.keys[:, :20]) for k, layer in zip(keys, km.fast.layers))
    assert _relative(together, apart) == 0.0


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
def test_layers_of_different_argument_types_take_a_call_each(tmp_path):
    """Where the layers' arguments are not all of one type (here one layer's router all bf16
    values, read as bf16, the other's f32), the stack's one call (a typed list built by
    ``_new_list``, ``_append``) is refused and each layer takes its own call, with the same logits."""
    path = _bundle(tmp_path, "qwen3_moe", "q8_0")
    prompt, tokens = _prompt(12), _prompt(16)[12:]
    with from_bundle(path) as km:
        moe = km.fast.layers[0].moe
        moe.router = (moe.router.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        mixed = _steps(km, prompt, tokens, fast=True)
        assert km.fast._mixed_types and km.fast._every is None
        km.fast._mixed_types = False
        km.fast._every_layer = lambda: None
        apart = _steps(km, prompt, tokens, fast=True)
    assert _relative(mixed, apart) == 0.0


def test_generate_takes_the_fast_steps_and_gives_transformers_tokens(tmp_path):
    path = _bundle(tmp_path, "qwen3_moe", "q4_0")
    with from_bundle(path) as km:
        km.fast.warm(km.experts)  # the first generation's step on token 0, undone: none of its own
        calls = []
        step = km.fast.step
        km.fast.step = lambda token: calls.append(token) or step(token)
        fast = generate(km, _prompt(10), max_new_tokens=12, sampling=Sampling(temperature=0), stop_at_eos=False)
        assert calls == fast.generated_tokens[:-1]  # every decode step, none of the prefill
        km.fast = None
        slow = generate(km, _prompt(10), max_new_tokens=12, sampling=Sampling(temperature=0), stop_at_eos=False)
    assert fast.generated_tokens == slow.generated_tokens


def test_a_full_cache_is_refused(tmp_path):
    path = _bundle(tmp_path, "mixtral")
    with from_bundle(path) as km:
        capacity = km.cache.layers[0].capacity
        _steps(km, _prompt(capacity - 1), [], fast=True)
        km.fast.step(5)  # the last position
        with pytest.raises(KtcError, match="KV cache holds"):
            km.fast.step(5)


def test_the_cache_shows_what_the_steps_filled(tmp_path):
    """The layers' keys and values are the filled part of their buffers after ktc's steps too,
    and are not replaced from outside (the buffers are what the plan counted)."""
    with from_bundle(_bundle(tmp_path, "mixtral")) as km:
        _steps(km, _prompt(5), [7, 8], fast=True)
        layer = km.cache.layers[0]
        assert layer.keys.shape[-2] == layer.values.shape[-2] == layer.length == 7
        assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()
        assert torch.count_nonzero(layer.keys[:, :, -1]) > 0
        with pytest.raises(KtcError, match="allocated up front"):
            layer.keys = torch.zeros_like(layer.keys)


def test_models_it_does_not_compute_run_transformers_steps(tmp_path, monkeypatch):
    with from_bundle(_bundle(tmp_path, "phimoe")) as km:  # a family it does not compute (its norms)
        assert km.fast is None
    path = _bundle(tmp_path, "mixtral")
    monkeypatch.setenv("KTC_FAST_DECODE", "0")
    with from_bundle(path) as km:
        assert km.fast is None
    monkeypatch.delenv("KTC_FAST_DECODE")
    with from_bundle(path, device="cpu") as km:  # a device model: torch's step
        assert km.fast is None
    with from_bundle(path) as km:
        assert km.fast is not None


# rows of the latent's and the query's non-rotary part in whole steps of 16 (bf16 lanes), and
# the compressed query's in whole blocks (the compiled attention half)
_WIDE_LATENT = {"qk_nope_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32}


@pytest.mark.parametrize("family,scheme,overrides", [
    ("deepseek_v3", "f32", {}), ("deepseek_v3", "bf16", _WIDE_LATENT), ("deepseek_v3", "q8_0", _WIDE_LATENT),
    ("deepseek_v3", "q4_0", _WIDE_LATENT), ("deepseek_v3", "int8", _WIDE_LATENT),
    ("deepseek_v3", "q8_0", {**_WIDE_LATENT, "q_lora_rank": None}),  # a query projection without compression
    ("deepseek_v3", "f32", {"rope_interleave": False}),  # rotary pairs half a head apart
    # complex rotary factors, each pair of neighbours kept in its place; softmax routing
    ("deepseek_v2", "f32", {}), ("deepseek_v2", "q8_0", _WIDE_LATENT),
])
def test_latent_attention_steps_equal_transformers_steps(family, scheme, overrides, tmp_path):
    """DeepSeek-V3's (and V2's) multi-head latent attention in its absorbed form (``_Latent``: kv_b
    moved to the query and the output) against transformers' steps, which multiply every cached
    latent by kv_b: the same logits step by step, the same latents and rotary keys in the cache.
    transformers' kv_b here is a float32 matrix of the bundle's kv_b values (its ``HostLinear``
    would quantize the latents it multiplies to int8 where the scheme's kernels do; the absorbed
    form multiplies kv_b's decoded values by float32 queries and latents), in the prompt's forward
    too. A bf16 bundle's kv_b stays bf16 (half the bytes), exactly."""
    from ktc.runtime.kernels import decode

    path = _bundle(tmp_path, family, scheme, **overrides)
    prompt, tokens = _prompt(12), _prompt(20)[12:]
    with from_bundle(path) as km:
        assert km.fast is not None and all(layer.latent is not None for layer in km.fast.layers)
        wide = vnni.HAVE_VNNI and overrides.get("kv_lora_rank") == 32
        bf16 = fast_decode._BF16 if wide and scheme == "bf16" else fast_decode._F32
        assert all(layer.latent.v_up[0] == bf16 for layer in km.fast.layers)
        # quantized or bf16 projections: each layer in one compiled call (its attention half,
        # routed experts and shared expert, or its dense MLP)
        one_call = wide and scheme != "f32"
        assert all((layer.compiled is not None and layer.ffn is not None) == one_call for layer in km.fast.layers)
        for layer in km.model.model.layers:
            b = layer.self_attn.kv_b_proj
            exact = torch.nn.Linear(b.in_features, b.out_features, bias=False)
            exact.weight.data = torch.from_numpy(decode(b.raw, b.scheme, b.in_features).copy())
            layer.self_attn.kv_b_proj = exact
        fast = _steps(km, prompt, tokens, fast=True)
        cached = [(layer.keys[:, :20].copy(), layer.values[:, :20].copy()) for layer in km.fast.layers]
        slow = _steps(km, prompt, tokens, fast=False)
        for (k, v), layer in zip(cached, km.fast.layers):
            np.testing.assert_allclose(k, layer.keys[:, :20], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(v, layer.values[:, :20], rtol=1e-5, atol=1e-6)
    assert _relative(fast, slow) < 1e-5


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_latent_attention_reads_a_gguf_s_split_halves_as_stored(qtype, tmp_path):
    """A GGUF's attn_k_b and attn_v_b (llama.cpp's MLA) in a block scheme are multiplied from
    their own rows, each head's activations quantized as the scheme's kernels quantize one
    vector (``_per_head``), not from float32 copies: each head's products equal the scheme's
    matrix-vector kernel on that head's rows, and the steps' logits stay near transformers'
    (whose joined kv_b multiplies float32 latents: the activations' quantization apart)."""
    from ktc.runtime import kernels

    overrides = {"qk_nope_head_dim": 32, "kv_lora_rank": 64, "q_lora_rank": None}
    base = mf.build_hf_model("deepseek_v3", **overrides, vocab_size=300)  # a byte-level BPE tokenizer's
    folder = str(tmp_path / "st")
    base.save_pretrained(folder)
    mf.write_bpe_tokenizer(folder, 300)
    types = {"attn_k_b.weight": qtype, "attn_v_b.weight": qtype}
    path = mf.write_gguf(folder, str(tmp_path / "m.gguf"), family="deepseek_v3", split_kv_b=True,
                         dense_qtype=types)
    scheme = qtype.lower()  # the halves passed through
    compile_bundle(path, str(tmp_path / "m.ktb"), cpu_scheme="f32", dense_scheme=scheme)
    rng = np.random.default_rng(0)
    with from_bundle(str(tmp_path / "m.ktb")) as km:
        latent = km.fast.layers[1].latent
        for spec in (latent.k_up, latent.v_up):
            code, raw, _, _, _, _, per_head, cols, _ = spec
            assert code == vnni.BLOCK_KINDS[scheme]
            x = rng.standard_normal((4, cols)).astype(np.float32)
            got = fast_decode._per_head(*spec, *vnni._tables(), x)
            for h in range(4):
                want = kernels.matvec(raw[h * per_head:(h + 1) * per_head], scheme, x[h])
                np.testing.assert_allclose(got[h], want, rtol=1e-5, atol=1e-6)
        prompt, tokens = _prompt(12), _prompt(20)[12:]
        fast = _steps(km, prompt, tokens, fast=True)
        slow = _steps(km, prompt, tokens, fast=False)
    assert _relative(fast, slow) < 3e-2
    assert [int(a.argmax()) for a in fast] == [int(b.argmax()) for b in slow]


def test_unsupported_parts_leave_transformers_in_charge(tmp_path, monkeypatch):
    """A part of the model the fast step does not compute (here a norm of another kind) makes it
    step aside rather than compute something else."""
    path = _bundle(tmp_path, "qwen3_moe")
    with from_bundle(path) as km:
        km.model.model.layers[0].input_layernorm = torch.nn.LayerNorm(km.model.config.hidden_size)
        assert fast_decode.fast_decoder(km) is None
    # a router ktc's MoE layer does not compute (ERNIE-4.5's), were its family taken
    monkeypatch.setitem(fast_decode.FAMILIES, "ernie4_5_moe", "attention")
    with from_bundle(_bundle(tmp_path, "ernie4_5_moe")) as km:
        assert km.fast is None


def test_the_step_is_loaded_before_the_first_generation_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """The first generation runs one step and undoes it before its timers (the compiled step's
    first call loads or compiles it, which the first decode step would otherwise pay), and only
    the first; loading runs none (a program that runs forwards only does not pay for it): the
    caches empty, no time, no routing counted; the first generation gives what a second one
    does."""
    path = _bundle(tmp_path, "qwen3_moe", "q4_0")
    warmed = []
    real = fast_decode.FastDecode.warm
    monkeypatch.setattr(fast_decode.FastDecode, "warm", lambda self, experts: warmed.append(1) or real(self, experts))
    with from_bundle(path) as km:
        assert km.fast is not None and not warmed and not km.fast.warmed
        with torch.inference_mode():
            km.model(torch.tensor([_prompt(5)]), **{km.cache_argument: km.new_cache()})
        assert not warmed  # a forward loads no decode step
        counted = [e.counts.copy() for e in km.experts]
        first = generate(km, _prompt(10), max_new_tokens=6, sampling=Sampling(temperature=0), stop_at_eos=False)
        assert warmed == [1] and first.load_seconds > 0
        routed = [e.counts.copy() for e in km.experts]
        again = generate(km, _prompt(10), max_new_tokens=6, sampling=Sampling(temperature=0), stop_at_eos=False)
        assert warmed == [1] and again.load_seconds == 0
        # the second generation routed what the first did: the warm step counted nothing
        assert all(np.array_equal(e.counts - r, r - before) and (r - before).any()
                   for e, r, before in zip(km.experts, routed, counted))
    assert first.generated_tokens == again.generated_tokens


def test_a_bundle_read_into_memory_runs_as_the_mapped_one(tmp_path):
    """open_bundle(mapped=False) (ktc run --no-mmap): the same bytes, read-only as the map's, in
    the process's own memory; the same greedy tokens."""
    from ktc.formats.bundle import open_bundle

    path = _bundle(tmp_path, "qwen3_moe", "q4_0")
    with open_bundle(path) as mapped, open_bundle(path, mapped=False) as loaded:
        assert loaded.in_memory and not mapped.in_memory
        assert np.array_equal(loaded.file_view(), mapped.file_view()) and not loaded.file_view().flags.writeable
        name = next(t.name for t in loaded.tensors.values() if t.role == "expert")
        assert np.array_equal(loaded.tensor(name), mapped.tensor(name)) and not loaded.tensor(name).flags.writeable
    want = [], []
    for mapped_, out in ((True, want[0]), (False, want[1])):
        with from_bundle(path, mapped=mapped_) as km:
            assert km.bundle.in_memory is not mapped_
            out += generate(km, _prompt(10), max_new_tokens=8, sampling=Sampling(temperature=0),
                            stop_at_eos=False).generated_tokens
    assert want[0] == want[1]


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("sinks,more", [(False, 0), (True, 0), (False, 8)])
@pytest.mark.parametrize("heads,kv_heads,start,end", [(8, 2, 0, 1), (8, 2, 0, 37), (4, 4, 3, 300), (6, 1, 10, 700),
                                                     (5, 1, 0, 38)])
def test_attention_step_equals_softmax_attention(heads, kv_heads, start, end, sinks, more, dim):
    """A decode step's attention (``_attend``: a key head's spans of positions for the query
    heads that share it, their softmaxes combined after) equals softmax(q K^T * scaling) V over
    the cache positions start..end-1, query head h reading key head h // (heads / kv heads):
    one span and several, a window that starts past 0, grouped, multi-head and one key head
    (its five query heads parted among two work items, the second one short of a tile of heads;
    37 and 38 positions: an odd one left of the pairs of positions, and of the eights).
    With sinks, head h's softmax also takes sinks[h] (gpt-oss), some larger than every score.
    With ``more`` values of each query and key kept apart (the latent attention's rotary part),
    the scores take them too. 16 values a head go through the weighted values' loop, 64 through
    its tiles of four heads by 32 values (``_pv_tile``; a head count not a multiple of four reads
    its last head again)."""
    rng = np.random.default_rng(end)
    q = rng.standard_normal((heads, dim)).astype(np.float32)
    keys = rng.standard_normal((kv_heads, 1024, dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, 1024, dim)).astype(np.float32)
    q_more = rng.standard_normal((heads, more)).astype(np.float32)
    keys_more = rng.standard_normal((kv_heads, 1024, more)).astype(np.float32)
    scaling = np.float32(dim ** -0.5)
    sink = (3 * rng.standard_normal(heads)).astype(np.float32) if sinks else np.zeros(0, np.float32)
    got = fast_decode._attend(q, keys, values, start, end, scaling, sink, q_more, keys_more).reshape(heads, dim)
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = (keys[g, start:end].astype(np.float64) @ q[h] + keys_more[g, start:end] @ q_more[h]) * scaling
        top = max(scores.max(), sink[h]) if sinks else scores.max()
        weights = np.exp(scores - top)
        weights /= weights.sum() + (np.exp(sink[h] - top) if sinks else 0.0)
        np.testing.assert_allclose(got[h], weights @ values[g, start:end], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group,spans,want", [(8, 12, 8), (8, 8, 4), (8, 20, 8), (16, 5, 8), (128, 1, 8), (5, 1, 4),
                                               (1, 4, 4)])
def test_attention_items_take_whole_tiles_of_query_heads(group, spans, want):
    """``_attend``'s work items take whole tiles of four query heads (``_TILE_HEADS``), as many as
    make 16 items where the spans are fewer, rounded up: Qwen3-30B-A3B's 8 query heads a key head
    at 513-768 positions (12 spans) one item a span, not 6 and 2 heads whose last tiles compute
    two heads again; a group of 5 in two items, the second short of a tile."""
    assert fast_decode._heads_an_item(group, spans) == want


def test_attention_step_is_the_same_on_any_number_of_threads():
    """``_attend``'s work items are fixed by the positions and the heads, not the threads: the
    same bits on one thread as on two, for spans of several key heads parted by query heads."""
    import numba

    rng = np.random.default_rng(1)
    q = rng.standard_normal((16, 32)).astype(np.float32)
    keys, values = (rng.standard_normal((2, 700, 32)).astype(np.float32) for _ in range(2))
    none, more = np.zeros(0, np.float32), np.zeros((16, 0), np.float32)
    threads = numba.get_num_threads()
    got = []
    try:
        for n in (1, threads):
            numba.set_num_threads(n)
            got.append([fast_decode._attend(q, keys, values, 0, end, np.float32(0.2), none, more,
                                            np.zeros((2, 700, 0), np.float32)) for end in (9, 600)])
    finally:
        numba.set_num_threads(threads)
    for one, many in zip(*got):
        assert np.array_equal(one, many)


def test_fast_steps_past_one_span_of_positions_equal_transformers_steps(tmp_path):
    """Past two spans of the attention's positions (``_ATTEND_SPAN``), and with a sliding window
    longer than a span (the spans then start at the window's first position): the spans'
    softmaxes combined equal transformers' attention."""
    span = fast_decode._ATTEND_SPAN
    for overrides in ({}, {"use_sliding_window": True, "sliding_window": span + 37, "max_window_layers": 0}):
        path = _bundle(tmp_path, "qwen3_moe", "f32", max_position_embeddings=4096, **overrides)
        prompt, tokens = _prompt(2 * span + 20), _prompt(2 * span + 24)[2 * span + 20:]
        with from_bundle(path) as km:
            fast = _steps(km, prompt, tokens, fast=True)
            slow = _steps(km, prompt, tokens, fast=False)
        assert _relative(fast, slow) < 1e-5


@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI (or the JIT is off)")
@pytest.mark.parametrize("scheme, width", [("q4_0", 64), ("q8_0", 64), ("mxfp4", 128), ("q4_k", 256)])
def test_interleaved_matrices_give_the_stored_layout_s_results(scheme, width, tmp_path):
    """On a VNNI CPU a q4_0 (or q8_0; mxfp4: rows of whole 128s; q4_k: of 256s) model's attention, output
    matrix and experts are multiplied from copies with their rows interleaved
    (``runtime.interleave``), in the prompt's forward (its experts of one token, of a few, of
    many) and in the compiled decode step; ``interleave=False`` reads the bundle's rows. The same activations' quantization either way: the same logits but
    for the order of float sums, the same greedy tokens."""
    from ktc.runtime.linear import HostLinear

    # rows of whole units of blocks
    path = _bundle(tmp_path, "qwen3_moe", scheme, hidden_size=width, moe_intermediate_size=width)
    prompt, tokens = _prompt(40), [5, 17, 40, 3]
    runs = {}
    for interleave in (True, False):
        with from_bundle(path, interleave=interleave) as km:
            linears = [m for m in km.model.modules() if isinstance(m, HostLinear)]
            assert linears and all((m.interleaved is not None) == interleave for m in linears)
            assert km.experts and all((e._interleaved is not None) == interleave for e in km.experts)
            cache = km.new_cache()
            with torch.inference_mode():
                prefill = km.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0].numpy()
            steps = [km.fast.step(t).copy() for t in tokens]
            greedy = generate(km, prompt, max_new_tokens=8, sampling=Sampling(temperature=0),
                              stop_at_eos=False).generated_tokens
            runs[interleave] = (prefill.copy(), steps, greedy)
    (prefill, steps, greedy), (prefill0, steps0, greedy0) = runs[True], runs[False]
    assert _relative([prefill], [prefill0]) < 1e-5
    assert _relative(steps, steps0) < 1e-5
    assert greedy == greedy0
