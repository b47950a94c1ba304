"""``ktc profile`` (``runtime.profile``): its counts against the routing transformers' own model
makes on the same sequences (its routers hooked), and ``ktc plan --profile`` reading them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import model_factory as mf
from ktc.cli import main
from ktc.compile import compile_bundle
from ktc.formats.activation_profile import load_activation_profile
from ktc.runtime.profile import record, sequences

CTX = 24
TEXT = ("Mixture-of-Experts layers route each token to a few experts; a profile counts how often each "
        "expert of each layer is chosen, so that a plan keeps the busiest ones on the GPU. ") * 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    hf = mf.build_hf_model("qwen3_moe").eval()
    folder = str(root / "src")
    mf.write_safetensors(hf, folder)
    mf.write_char_tokenizer(folder, 96)
    bundle = str(root / "f32.ktb")
    compile_bundle(folder, bundle, cpu_scheme="f32", dense_scheme="f32", max_tokens=64)
    return hf, folder, bundle


def transformers_counts(hf, runs: list[list[int]]) -> np.ndarray:
    """Per MoE layer and expert, how often transformers' model routes to it over ``runs``,
    read from its routers' top-k indices."""
    layers = [layer.mlp.gate for layer in hf.model.layers]
    counts = np.zeros((len(layers), hf.config.num_experts), dtype=np.int64)

    def hook(i):
        def record_choice(module, args, output):
            counts[i] += np.bincount(output[2].reshape(-1).numpy(), minlength=counts.shape[1])
        return record_choice

    handles = [gate.register_forward_hook(hook(i)) for i, gate in enumerate(layers)]
    try:
        with torch.no_grad():
            for ids in runs:
                hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return counts


def test_counts_equal_transformers_routing(model):
    hf, folder, bundle = model
    profile, figures = record(bundle, text=TEXT, ctx=CTX)
    from transformers import AutoTokenizer

    runs = sequences(AutoTokenizer.from_pretrained(folder), text=TEXT, ctx=CTX)
    assert len(runs) == figures["sequences"] > 1 and max(map(len, runs)) == CTX
    want = transformers_counts(hf, runs)
    assert profile.layers == (0, 1, 2)
    np.testing.assert_array_equal(profile.counts, want)
    assert (profile.counts.sum(axis=1) == figures["tokens"] * figures["top_k"]).all()
    assert figures["tokens"] == len(TEXT)  # one token a character


def test_prompts_are_sequences_of_their_own(model):
    hf, folder, bundle = model
    prompts = ["route this line", "", "and this longer line of text, cut at the window"]
    profile, figures = record(bundle, prompts=prompts, ctx=CTX)
    from transformers import AutoTokenizer

    runs = sequences(AutoTokenizer.from_pretrained(folder), prompts=prompts, ctx=CTX)
    assert figures["sequences"] == len(runs) == 3  # the empty line skipped, the long one cut in two
    np.testing.assert_array_equal(profile.counts, transformers_counts(hf, runs))


def test_cli_profile_then_plan(model, tmp_path):
    _, folder, bundle = model
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = str(tmp_path / "profile.json")
    runner = CliRunner()
    result = runner.invoke(main, ["profile", bundle, "--text", str(text), "-o", out, "--ctx", str(CTX), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["format"] == "ktc-profile" and figures["tokens"] == len(TEXT)
    loaded = load_activation_profile(out, moe_layers=(0, 1, 2), num_layers=3, num_experts=8)
    assert (loaded.counts.sum(axis=1) == 2 * len(TEXT)).all()
    result = runner.invoke(main, ["plan", folder, "--vram", "1040MiB", "--profile", out])
    assert result.exit_code == 0, result.output
    assert f"routing statistics: the profile {out} ({len(TEXT):,} tokens a layer)" in result.output
    result = runner.invoke(main, ["profile", bundle, "-o", out])
    assert result.exit_code != 0 and "--text FILE or --prompts FILE" in result.output


def test_trace_is_the_routing_token_by_token(model, tmp_path):
    """``--trace`` writes each token's choices per MoE layer, in text order: per layer they add up
    to the profile's counts, and each token's choices are the k distinct experts transformers'
    router picks for it."""
    hf, folder, bundle = model
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    out, trace = str(tmp_path / "profile.json"), str(tmp_path / "routes.npy")
    result = CliRunner().invoke(main, ["profile", bundle, "--text", str(text), "-o", out, "--ctx", str(CTX),
                                       "--trace", trace])
    assert result.exit_code == 0, result.output
    assert f"the routing token by token: {trace}" in result.output
    routes = np.load(trace)
    profile = load_activation_profile(out, moe_layers=(0, 1, 2), num_layers=3, num_experts=8)
    assert routes.shape == (len(TEXT), 3, 2) and routes.dtype == np.int64
    for layer in range(3):
        np.testing.assert_array_equal(np.bincount(routes[:, layer].reshape(-1), minlength=8), profile.counts[layer])
    assert all(len(set(choice)) == 2 for choice in routes.reshape(-1, 2).tolist())
    from transformers import AutoTokenizer

    first = sequences(AutoTokenizer.from_pretrained(folder), text=TEXT, ctx=CTX)[0]
    gate = hf.model.layers[1].mlp.gate
    chosen = []
    handle = gate.register_forward_hook(lambda module, args, output: chosen.append(output[2].numpy()))
    try:
        with torch.no_grad():
            hf(torch.tensor([first]))
    finally:
        handle.remove()
    np.testing.assert_array_equal(np.sort(routes[:CTX, 1], axis=1), np.sort(chosen[0].reshape(CTX, 2), axis=1))
    result = CliRunner().invoke(main, ["profile", bundle, "--text", str(text), "-o", out,
                                       "--trace", str(tmp_path / "no" / "routes.npy")])
    assert result.exit_code != 0 and "does not exist" in result.output


def test_pregating_is_the_next_router_on_this_layers_input(model):
    """The pre-gating figure of each MoE layer pair: transformers' next router applied to this
    layer's MoE input, its top k against the experts the next layer then chose."""
    hf, folder, bundle = model
    prompts = ["the next layer's router, one layer early"]
    _, figures = record(bundle, prompts=prompts, ctx=CTX)
    from transformers import AutoTokenizer

    runs = sequences(AutoTokenizer.from_pretrained(folder), prompts=prompts, ctx=CTX)
    assert len(runs) == 2  # the prompt is cut at the window: both parts count
    named, total = np.zeros(2), np.zeros(2)
    for ids in runs:
        inputs, chosen = {}, {}
        handles = []
        for i, layer in enumerate(hf.model.layers):
            handles.append(layer.mlp.register_forward_pre_hook(
                lambda module, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]))))
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda module, args, output, i=i: chosen.__setitem__(i, output[2].reshape(len(ids), -1))))
        try:
            with torch.no_grad():
                hf(torch.tensor([ids]))
        finally:
            for h in handles:
                h.remove()
        for i in range(2):
            with torch.no_grad():
                guess = (inputs[i] @ hf.model.layers[i + 1].mlp.gate.weight.T).topk(2, dim=-1).indices
            named[i] += sum(len(set(g) & set(c)) for g, c in zip(guess.tolist(), chosen[i + 1].tolist()))
            total[i] += chosen[i + 1].numel()
    want = named / total
    assert len(figures["pregating"]) == 2
    np.testing.assert_allclose(figures["pregating"], want, atol=1e-9)
    assert not all(w == 1.0 for w in want)  # the guess is not the next layer's own choice

