"""The bundle's MoE layer against transformers' own MoE blocks, family by family."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.errors import KtcError
from ktc.formats.bundle import open_bundle
from ktc.formats.schemes import get_scheme
from ktc.runtime.experts import ExpertSet
from ktc.runtime.moe import MoELayer

# Relative error of the block's output (Frobenius norm). 4-bit codes have a relative RMS error
# near 0.07 per matrix (int4_g32 on Gaussian weights), and gate, up and down each add theirs.
TOLERANCE = {"f32": 1e-5, "bf16": 1e-2, "int8": 3e-2, "q8_0": 3e-2, "int4_g32": 1.5e-1, "q4_0": 2.5e-1,
             "mxfp4": 3.5e-1}  # q4_0, mxfp4: symmetric 4-bit codes, three matrices compound


@pytest.fixture(scope="module")
def hf_models():
    return {family: mf.build_hf_model(family) for family in mf.FAMILIES}


def block_output(model, layer: int, hidden: np.ndarray) -> np.ndarray:
    block = model.model.layers[layer].mlp
    with torch.no_grad():
        out = block(torch.from_numpy(hidden)[None])
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(hidden.shape).numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("family", list(mf.FAMILIES))
@pytest.mark.parametrize("scheme", ["f32", "bf16", "int8", "int4_g32"])
def test_matches_transformers(family, scheme, hf_models, tiny_models, tmp_path):
    spec = mf.FAMILIES[family]
    model = hf_models[family]
    inter = model.config.moe_intermediate_size if hasattr(model.config, "moe_intermediate_size") and family not in ("mixtral", "olmoe", "gpt_oss") else model.config.intermediate_size
    if scheme == "int4_g32" and inter % 32:
        pytest.skip(f"{family}'s tiny experts are {inter} wide, not a multiple of 32")
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models[family]["safetensors"], str(path), cpu_scheme=scheme,
                   dense_scheme="f32" if scheme == "f32" else "bf16")
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((7, mf.HIDDEN)).astype(np.float32)
    with open_bundle(str(path)) as bundle:
        for layer in spec.moe_layers:
            moe = MoELayer(bundle, layer)
            got = moe.forward(hidden)
            moe.close()
            want = block_output(model, layer, hidden)
            tolerance = TOLERANCE[scheme]
            if scheme != "f32" and spec.shared:
                tolerance = max(tolerance, 1e-2)  # shared experts are stored in bf16 here
            assert relative_error(got, want) < tolerance, (family, layer, relative_error(got, want))
            assert moe.counts.sum() == 7 * mf.TOP_K


def test_device_path_allocates_only_device_experts(tiny_models, tmp_path):
    """On torch's CPU device: a plan with no device experts creates no expert storage there;
    with some, exactly their bytes, and the output does not change."""
    src = tiny_models["qwen3_moe"]["safetensors"]
    cpu_only = tmp_path / "cpu.ktb"
    compile_bundle(src, str(cpu_only), cpu_scheme="f32", dense_scheme="f32")
    mixed = tmp_path / "mixed.ktb"
    compile_bundle(src, str(mixed), cpu_scheme="f32", gpu_scheme="f32", dense_scheme="f32",
                   plan_kwargs=dict(vram="520KiB", reserve=0, max_tokens=16))
    hidden = np.random.default_rng(1).standard_normal((5, mf.HIDDEN)).astype(np.float32)
    with open_bundle(str(cpu_only)) as a, open_bundle(str(mixed)) as b:
        layer_a = MoELayer(a, 1, device="cpu")
        layer_b = MoELayer(b, 1, device="cpu")
        assert layer_a.gpu_experts == () and layer_a.device_bytes == 0
        assert 0 < len(layer_b.gpu_experts) < mf.EXPERTS
        per_expert = 3 * 32 * mf.HIDDEN * 4
        assert layer_b.device_bytes == len(layer_b.gpu_experts) * per_expert
        np.testing.assert_allclose(layer_b.forward(hidden), layer_a.forward(hidden), rtol=1e-5, atol=1e-6)
        layer_a.close()
        layer_b.close()


def test_bad_hidden_states(tiny_models, tmp_path):
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models["mixtral"]["safetensors"], str(path))
    with open_bundle(str(path)) as bundle:
        moe = MoELayer(bundle, 0)
        with pytest.raises(KtcError, match="shape"):
            moe.forward(np.zeros((2, mf.HIDDEN + 1), np.float32))
        bad = np.zeros((2, mf.HIDDEN), np.float32)
        bad[1, 3] = np.nan
        with pytest.raises(KtcError, match="NaN"):
            moe.forward(bad)
        with pytest.raises(KtcError, match="NaN"):  # one token: the one-call decode path
            moe.forward(bad[1:])
        bad[1, 3] = np.inf
        with pytest.raises(KtcError, match="Inf"):
            moe.forward(bad[1:])
        moe.close()


FUSED = [("mixtral", "int8"), ("deepseek_v3", "int8"), ("qwen3_moe", "int8"), ("gpt_oss", "int8"),
         ("qwen3_moe", "int4_g32"), ("gpt_oss", "int4_g32"), ("olmoe", "int4_g32"),
         ("qwen3_moe", "q8_0"), ("gpt_oss", "q8_0"), ("qwen3_moe", "q4_0"), ("mixtral", "q4_0"),
         ("qwen3_moe", "mxfp4"), ("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("family, scheme", FUSED)
def test_one_token_fused_path(family, scheme, hf_models, tiny_models, tmp_path):
    """One token through all the selected experts of a layer at once gives what running them one
    by one gives (and what transformers gives)."""
    from ktc.runtime import vnni

    if scheme != "int8" and not vnni.HAVE_VNNI:
        pytest.skip("the fused path of this scheme needs AVX-512 VNNI")
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models[family]["safetensors"], str(path), cpu_scheme=scheme)
    rng = np.random.default_rng(5)
    with open_bundle(str(path)) as bundle:
        layer = mf.FAMILIES[family].moe_layers[-1]
        moe = MoELayer(bundle, layer)
        for h, fused in fused_against_plain(moe, rng):
            assert relative_error(fused, block_output(hf_models[family], layer, h)) < TOLERANCE[scheme]
        moe.close()


@contextlib.contextmanager
def one_call_layer(tiny_models, tmp_path, scheme: str):  # type: ignore[no-untyped-def]
    """The tiny Qwen3-MoE's last MoE layer with its experts compiled at ``scheme``, for the
    one-token compiled call (the test skipped on a CPU without AVX-512 VNNI)."""
    from ktc.runtime import vnni

    if not vnni.HAVE_VNNI:
        pytest.skip("the one-token call needs AVX-512 VNNI")
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models["qwen3_moe"]["safetensors"], str(path), cpu_scheme=scheme)
    with open_bundle(str(path)) as bundle:
        moe = MoELayer(bundle, mf.FAMILIES["qwen3_moe"].moe_layers[-1])
        try:
            yield moe
        finally:
            moe.close()


def test_one_token_reads_a_bf16_router_as_bf16(tiny_models, tmp_path):
    """A router whose values are all bf16 (as models publish them) goes to the one-token call as
    bf16 bit patterns, half the bytes, with the routing and output of the f32 router's batched
    path; one with a value bf16 cannot hold stays f32."""
    with one_call_layer(tiny_models, tmp_path, "q8_0") as moe:
        assert moe._one_call()[0].dtype == np.float32  # the tiny model's f32 initialisation
        bits = moe.router.view(np.uint32) & np.uint32(0xFFFF0000)
        moe.router = bits.view(np.float32)
        router = moe._one_call()[0]
        assert router.dtype == np.uint16 and router.nbytes * 2 == moe.router.nbytes
        np.testing.assert_array_equal((router.astype(np.uint32) << np.uint32(16)).view(np.float32), moe.router)
        for _ in fused_against_plain(moe, np.random.default_rng(2)):
            pass


def test_one_token_call_stamps_its_parts_in_order(tiny_models, tmp_path):
    """With ``vnni.STAMPS`` set, a decode step's one compiled MoE call stamps its parts in the
    order they run (routing's start, the router's product, routing's end, the activations'
    quantization, the kernels, the sum): the parts the benchmarks print are each >= 0, the
    router's product within the routing, and the parts together no longer than the block (the
    counting and the tables' copies between the routing and the experts' call are in no part)."""
    from ktc.runtime import vnni

    with one_call_layer(tiny_models, tmp_path, "q4_0") as moe:
        vnni.STAMPS = np.zeros(vnni.STAMP_COUNT, dtype=np.int64)
        try:
            moe.forward(np.random.default_rng(4).standard_normal((1, mf.HIDDEN)).astype(np.float32))
            stamps = vnni.STAMPS.copy()
        finally:
            vnni.STAMPS = None
    order = stamps[[7, 9, 8, 0, 1, 2, 3, 4, 5, 6]]
    assert (order > 0).all() and (np.diff(order) >= 0).all()
    parts = vnni.stamp_parts(stamps, 1.0)
    assert 0 <= parts["router"] <= parts["routing"] <= parts["block"]
    beside = parts["routing"] + parts["quantize"] + parts["activation"] + parts["combine"]
    assert parts["kernels"] + beside <= parts["block"]


def fused_against_plain(moe: MoELayer, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """Three tokens through the layer's fused one-token path, each checked against the experts
    run one by one (per 32 values the fused kernels quantize activations as the one-token
    kernels do: equal to 1e-5); yields (token, fused output)."""
    assert moe.experts._fused is not None
    for _ in range(3):
        h = rng.standard_normal((1, mf.HIDDEN)).astype(np.float32)
        fused = moe.forward(h)
        saved, moe.experts._fused = moe.experts._fused, None
        plain = moe.forward(h)
        moe.experts._fused = saved
        np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())
        yield h, fused


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_one_token_fused_path_mixed_schemes(family, tiny_models, tmp_path):
    """A layer whose CPU experts a plan put in different schemes (hot ones in int8, the rest in
    4 bits) takes the fused path too, with what running them one by one gives."""
    from ktc.runtime import vnni

    if not vnni.HAVE_VNNI:
        pytest.skip("mixed schemes in the fused path need AVX-512 VNNI")
    schemes = ["int8", "q4_0", "mxfp4", "q8_0", "int4_g32"]
    path = mf.compile_with_placement(tiny_models[family]["safetensors"], tmp_path,
                                     lambda e: f"cpu:{schemes[e % len(schemes)]}")
    rng = np.random.default_rng(6)
    with open_bundle(path) as bundle:
        moe = MoELayer(bundle, mf.FAMILIES[family].moe_layers[-1])
        assert len({ex.scheme for ex in moe.experts.cpu.values()}) == len(schemes)
        assert len(list(fused_against_plain(moe, rng))) == 3
        moe.close()


@pytest.mark.parametrize("family, scheme, width", [("qwen3_moe", "q4_0", 128), ("mixtral", "q8_0", 128),
                                                   ("gpt_oss", "mxfp4", 128), ("qwen3_moe", "q4_k", 256),
                                                   ("olmoe", "q6_k", 256), ("qwen3_moe", "int4_g128", 256),
                                                   ("mixtral", "int4_g32", 128), ("qwen3_moe", "fp8_e4m3", 256),
                                                   ("qwen3_moe", "q4_0", 256), ("gpt_oss", "mxfp4", 256)])
@pytest.mark.parametrize("tokens", [24, 160])
def test_batched_tokens_equal_each_token_alone(family, scheme, width, tokens, tmp_path):
    """Many tokens through a layer at once (each expert's tokens multiplied in place: row tiles
    for a few, the experts of a few tokens in one call, ``rows.experts_groups``, 16 tokens a
    vector from LANES_MIN_TOKENS on; hidden and expert widths of whole
    steps of the kernels) give what each token alone gives through the one-token path: to float
    rounding for the block kinds in rows of 128 values, whose activations are quantized per 32
    values either way; within the activations' rounding where the rows are whole 256s, which the
    lanes quantize per 256 and the block kinds' one-token kernels per 32, and for the K-quants,
    whose one-token kernels quantize them per 256 (about 1% a product, two products; the lanes
    against their definition: the kernel tests), and for int4, per group (int4 has no row tiles
    and no call for experts of a few tokens: below LANES_MIN_TOKENS its one-token kernels token
    by token); fp8_e4m3 within bf16's
    rounding from AMX_MIN_TOKENS on a CPU with AMX (else from 16, torch's bf16 GEMM); on a CPU
    with AMX, experts of ``AMX_MIN_TOKENS`` tokens or more multiply bf16 values
    (``runtime/amx.py``), within the activations' rounding too."""
    from ktc.runtime import amx, vnni
    from ktc.runtime.kernels import AMX_MIN_TOKENS, LANES_MIN_TOKENS

    if not vnni.HAVE_VNNI:
        pytest.skip("the in-place batched path needs AVX-512 VNNI")
    folder = mf.write_safetensors(mf.build_hf_model(family, hidden_size=width, intermediate_size=width,
                                                    moe_intermediate_size=width, head_dim=32),
                                  str(tmp_path / "src"))
    path = tmp_path / "m.ktb"
    compile_bundle(folder, str(path), cpu_scheme=scheme)
    rng = np.random.default_rng(8)
    with open_bundle(str(path)) as bundle:
        layer = mf.FAMILIES[family].moe_layers[-1]
        # the stored layout's paths (the interleaved copy: test_interleaved_experts_...)
        moe = MoELayer(bundle, layer, experts=ExpertSet(bundle, layer, interleave=False))
        few_tokens, grouped = moe.experts._few_tokens, []

        def spied(hidden, work, results):  # type: ignore[no-untyped-def]
            rest = few_tokens(hidden, work, results)
            grouped.append(len(work) - len(rest))
            return rest

        moe.experts._few_tokens = spied
        h = rng.standard_normal((tokens, width)).astype(np.float32)
        batched = moe.forward(h)
        most = int(moe.experts.counts.max())  # the most tokens an expert took in the batch
        if tokens == 24 and not scheme.startswith(("int4", "fp8")):  # experts of a few tokens each: in one call
            assert sum(grouped) >= 2
        alone = np.concatenate([moe.forward(h[t:t + 1]) for t in range(tokens)])
        moe.close()
    assert tokens == 24 or most >= LANES_MIN_TOKENS.get(scheme, 16)  # the larger batch reaches the lanes
    per_256 = scheme in ("q4_0", "mxfp4") and width % 256 == 0 and most >= LANES_MIN_TOKENS[scheme]
    if (per_256 or (scheme in ("q4_k", "q6_k") and tokens > 24)
            or (scheme.startswith("int4") and most >= LANES_MIN_TOKENS[scheme])
            or (scheme == "fp8_e4m3" and most >= (AMX_MIN_TOKENS[scheme] if amx.HAVE_AMX else 16))
            or (amx.HAVE_AMX and most >= AMX_MIN_TOKENS[scheme])):
        assert np.linalg.norm(batched - alone) / np.linalg.norm(alone) < 3e-2
        if per_256:  # the lanes' per-256 activations do show (the path is taken)
            assert np.linalg.norm(batched - alone) / np.linalg.norm(alone) > 1e-6
    else:
        _equal_but_for_ties(batched, alone, 1e-4)


def _equal_but_for_ties(got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    """got [tokens, hidden] equals want to ``tolerance`` of want's largest value in every token
    but a few, and those within 1%: two compiled paths may compute an activation a float rounding
    apart, and where it lands within that of a tie of its int8 quantization (x.5; seen: -12.500005
    in a q8_0 expert's 128 intermediate values) they round it apart, one step of one value (a
    thousandth of the token's results). A path that computes wrongly differs in most tokens."""
    scale = np.abs(want).max()
    off = ~np.isclose(got, want, rtol=0, atol=tolerance * scale).all(axis=1)
    assert off.sum() <= max(1, len(want) // 50), f"{off.sum()} of {len(want)} tokens differ"
    np.testing.assert_allclose(got[off], want[off], rtol=0, atol=1e-2 * scale)


def test_a_token_choosing_an_expert_twice(tiny_models, tmp_path):
    """Routing that picks one expert twice for a token (a router ktc does not compute could)
    adds its weights: the batched sum sees each token once per expert."""
    path = tmp_path / "m.ktb"
    compile_bundle(tiny_models["qwen3_moe"]["safetensors"], str(path), cpu_scheme="f32")
    rng = np.random.default_rng(9)
    with open_bundle(str(path)) as bundle:
        experts = MoELayer(bundle, mf.FAMILIES["qwen3_moe"].moe_layers[-1]).experts
        h = rng.standard_normal((3, mf.HIDDEN)).astype(np.float32)
        idx = np.array([[1, 1], [2, 3], [1, 0]])
        weights = np.array([[0.25, 0.5], [0.5, 0.5], [1.0, 0.0]], dtype=np.float32)
        got = experts.forward(h, idx, weights)
        one = experts.forward(h[:1], np.array([[1]]), np.array([[1.0]], dtype=np.float32))
        np.testing.assert_allclose(got[0], 0.75 * one[0], rtol=1e-5, atol=1e-6)
        for t in (1, 2):
            alone = experts.forward(h[t:t + 1], idx[t:t + 1], weights[t:t + 1])
            np.testing.assert_allclose(got[t], alone[0], rtol=1e-5, atol=1e-6)
        experts.close()


def test_one_token_routing_equals_the_batched_routing():
    """A decode step's softmax top-k (compiled) picks what the batched numpy routing picks,
    ties to the lower index as a stable sort does, with the same weights."""
    from ktc.runtime.moe import _softmax_top_k

    rng = np.random.default_rng(8)
    for logits in (rng.standard_normal(128).astype(np.float32),
                   np.repeat(rng.standard_normal(16).astype(np.float32), 8)):  # ties
        for k, normalize in ((8, True), (2, False), (1, True)):
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            want_idx = np.argsort(-probs, kind="stable")[:k]
            want = probs[want_idx] / (probs[want_idx].sum() if normalize else 1)
            idx, weights = _softmax_top_k(logits, k, normalize)
            np.testing.assert_array_equal(idx, want_idx)
            np.testing.assert_allclose(weights, want, rtol=1e-6)


def test_one_token_sigmoid_routing_equals_the_batched_routing():
    """A decode step's sigmoid routing (compiled, ``_sigmoid_top_k``: DeepSeek-V3's, GLM-4.5's)
    picks what ``MoELayer.route``'s numpy steps pick, with and without the score correction and
    groups, ties to the lower index (experts and groups), with the same weights."""
    from types import SimpleNamespace

    from ktc.runtime.moe import _sigmoid_top_k

    rng = np.random.default_rng(9)
    n = 64
    for groups, topk_groups in ((1, 1), (8, 3), (4, 2)):
        for logits in (rng.standard_normal(n).astype(np.float32),
                       np.repeat(rng.standard_normal(n // 4).astype(np.float32), 4)):  # ties
            for bias in (None, (0.1 * rng.standard_normal(n)).astype(np.float32)):
                for k, normalize in ((8, True), (2, False), (1, True)):
                    info = {"gating": "sigmoid", "num_groups": groups, "topk_groups": topk_groups,
                            "norm_topk_prob": normalize, "routed_scaling_factor": 1.0}
                    layer = SimpleNamespace(info=info, router=np.eye(n, dtype=np.float32), router_bias=None,
                                            score_bias=bias, num_experts=n, top_k=k)
                    want_idx, want = MoELayer.route(layer, logits[None, :])  # type: ignore[arg-type]
                    idx, weights = _sigmoid_top_k(logits, np.zeros(1, np.float32) if bias is None else bias,
                                                  bias is not None, k, groups, topk_groups, normalize)
                    np.testing.assert_array_equal(idx, want_idx[0])
                    np.testing.assert_allclose(weights, want[0], rtol=1e-6)


@pytest.mark.parametrize("family", list(mf.FAMILIES) + list(mf.EXTRA_FAMILIES))
def test_routing_is_transformers_routing_or_refused(family, tmp_path):
    """ktc's router against the one in transformers' MoE block (the indices and weights its
    experts module receives): equal for every family ktc routes, and a family whose router ktc
    does not compute is refused by MoELayer, naming the path that runs it."""
    from ktc.errors import UnsupportedModelError
    from ktc.formats.model_config import OTHER_ROUTERS

    model = mf.build_hf_model(family).eval()
    folder = mf.write_safetensors(model, str(tmp_path / family))
    path = str(tmp_path / "m.ktb")
    compile_bundle(folder, path, cpu_scheme="f32", dense_scheme="f32")
    with open_bundle(path) as bundle:
        layer = bundle.manifest["model"]["moe_layers"][0]["layer"]
        if family in OTHER_ROUTERS:
            with pytest.raises(UnsupportedModelError, match="router is not one ktc's MoE layer computes"):
                MoELayer(bundle, layer)
            return
        block = model.model.layers[layer].mlp
        seen = {}
        hook = block.experts.register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(index=args[1], weights=args[2]), with_kwargs=True)
        hidden = torch.randn(9, mf.HIDDEN, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            block(hidden[None])
        hook.remove()
        moe = MoELayer(bundle, layer)
        try:
            index, weights = moe.route(hidden.numpy())
        finally:
            moe.close()
    want_index = seen["index"].reshape(9, -1).numpy()
    want_weights = seen["weights"].reshape(9, -1).float().numpy()
    for t in range(9):
        want = dict(zip(want_index[t].tolist(), want_weights[t].tolist()))
        got = dict(zip(index[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), (family, t)
        assert max(abs(got[e] - want[e]) for e in want) < 1e-5, (family, t)


def test_a_token_alone_splits_as_among_others(tiny_models, tmp_path):
    """A decode step's split of its experts between the CPU and the device (``_split``'s one-token
    way, without array operations for each expert) gives what the tokens' way gives that token:
    the same experts in the same order on the same side with the same weights, each counted
    once; an expert outside the layer is refused, and a token naming one expert twice takes the
    tokens' way (its weights added)."""
    path = mf.compile_with_placement(tiny_models["qwen3_moe"]["safetensors"], tmp_path,
                                     lambda e: "gpu:f32" if e % 3 == 0 else "cpu:f32")
    with open_bundle(path) as bundle:
        experts = MoELayer(bundle, 1, device="cpu").experts
        idx = np.array([[6, 1, 3, 4]])
        weights = np.array([[0.4, 0.3, 0.2, 0.1]], dtype=np.float32)
        alone = experts._split(idx, weights, frozenset({4}))
        assert experts.counts[[1, 3, 4, 6]].tolist() == [1, 1, 1, 1] and experts.counts.sum() == 4
        among = experts._split(np.repeat(idx, 2, axis=0), np.repeat(weights, 2, axis=0), frozenset({4}))
        for side_alone, side_among in zip(alone, among):
            assert [e for e, _, _ in side_alone] == [e for e, _, _ in side_among]
            for (_, tokens, chosen), (_, both, chosen_both) in zip(side_alone, side_among):
                assert tokens.tolist() == [0] and both.tolist() == [0, 1]
                assert chosen.dtype == chosen_both.dtype == np.float32 and chosen[0] == chosen_both[0]
        assert [e for e, _, _ in alone[1]] == [3, 4, 6]  # residents 3 and 6, and 4 from its cache slot
        with pytest.raises(KtcError, match="routing chose expert 9"):
            experts._split(np.array([[1, 9]]), weights[:, :2])
        twice = experts._split(np.array([[1, 1]]), np.array([[0.25, 0.5]], dtype=np.float32))
        assert [(e, t.tolist(), c.tolist()) for e, t, c in twice[0]] == [(1, [0], [0.75])]
        experts.close()


@pytest.mark.parametrize("scheme,width", [("q4_0", 128), ("q8_0", 128), ("mxfp4", 128), ("q4_k", 256),
                                          ("q4_k+q6_k", 256), ("int8", 128),
                                          # rows whose last unit of blocks is not full (gpt-oss's
                                          # 2880 values are 22.5 units of mxfp4's 128): the tail
                                          ("mxfp4", 96), ("q4_0", 160), ("int8", 96)])
@pytest.mark.parametrize("tokens", [1, 5, 24, 160])
def test_interleaved_experts_equal_the_stored_layout(tokens, scheme, width, tmp_path, monkeypatch):
    """A layer whose experts are all q4_0 (or all q8_0, mxfp4, q4_k, int8; or q4_k gate/up beside
    q6_k down, as Q4_K_M's), on a VNNI CPU, reads them from one copy with their rows interleaved
    (``runtime.interleave``; q6_k's copied as they are; int8's as q8_0 blocks, each with its row's
    scale in fp16): one token through every path that takes one (``rows.chosen_experts_token``,
    ``rows.pairs_token``), a few each through ``rows.experts_groups`` (24 tokens: 48 over 8
    experts), more through ``interleave.matmul`` (q6_k's through the stored layout's products);
    each gives what the stored layout's paths give, within the activations' rounding (those
    quantize per 256 from LANES_MIN_TOKENS tokens an expert, the copy's block schemes' products
    per 32; int8's within its scales' fp16 rounding too, 2^-11 of each row's product), and each
    token alone what it gives in the batch. Rows of 96 or 160 values take the copy's tail: their
    last unit of blocks filled out (``interleave.repack``)."""
    from ktc.runtime import interleave, rows, vnni

    grouped: list[int] = []  # the gate/up kinds experts_groups was called with
    groups_call = rows.experts_groups

    def counted(*args):  # type: ignore[no-untyped-def]
        grouped.append(int(args[3]))
        return groups_call(*args)

    monkeypatch.setattr(rows, "experts_groups", counted)
    if not vnni.HAVE_VNNI:
        pytest.skip("the interleaved copy needs AVX-512 VNNI")
    folder = mf.write_safetensors(mf.build_hf_model("qwen3_moe", hidden_size=width, intermediate_size=width,
                                                    moe_intermediate_size=width, head_dim=32), str(tmp_path / "src"))
    path = tmp_path / "m.ktb"
    compile_bundle(folder, str(path), cpu_scheme=scheme)
    h = np.random.default_rng(tokens).standard_normal((tokens, width)).astype(np.float32)
    with open_bundle(str(path)) as bundle:
        layer = mf.FAMILIES["qwen3_moe"].moe_layers[-1]
        copy = MoELayer(bundle, layer)
        stored = MoELayer(bundle, layer, experts=ExpertSet(bundle, layer, interleave=False))
        assert copy.experts._interleaved is not None and stored.experts._interleaved is None
        assert copy.experts._interleaved[3] == (True, scheme != "q4_k+q6_k")
        got, want = copy.forward(h), stored.forward(h)
        alone = np.concatenate([copy.forward(h[t:t + 1]) for t in range(tokens)])
        one_call = copy.experts.one_call_tables()
        copy.close()
        stored.close()
    assert one_call is not None and one_call[0] is copy.experts._interleaved[0]
    copy_scheme = interleave.copy_scheme(scheme.split("+")[0])
    if copy_scheme in interleave.LAYOUTS and width % (32 * interleave.LAYOUTS[copy_scheme].unit):
        # the tail: the copy's rows (the one call's bytes a row) filled out to whole units
        stored_row = get_scheme(copy_scheme).matrix_bytes(1, width)
        assert (one_call[6] == interleave.copy_row_bytes(copy_scheme, stored_row)).all() and one_call[6][0] > stored_row
    first = scheme.split("+")[0]
    if tokens == 24:  # the copy's few-token experts and the stored layout's each in one call (not int8's)
        assert rows.INTERLEAVED[interleave.copy_scheme(first)] in grouped
        # (the stored layout's row tiles take rows of whole units of blocks too)
        assert first == "int8" or rows.kind(first) in grouped or not rows.groups_fit(first, width)
    # int8's stored experts of 4 tokens or more quantize their activations per 256 (its lanes),
    # the copy's per 32 up to interleave.FEW_TOKENS: at 24 tokens as the others' from 160
    if tokens > 24 or (first == "int8" and tokens == 24):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    else:
        _equal_but_for_ties(got, want, 2e-3 if first == "int8" else 1e-5)
    _equal_but_for_ties(got, alone, 1e-5)
