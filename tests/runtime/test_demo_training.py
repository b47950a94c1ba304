"""The demo model trained on its corpus (``ktc.demo.trained_demo_tensors``, here with few steps):
its checkpoint, read back by transformers and by ktc, scores held-out text far better than the
random one (the experts' conversion from transformers' fused tensors is right), the training is
cached and repeatable, and quantized bundles of it diverge from the f32 bundle in order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ktc.compile import compile_bundle
from ktc.demo import DEMO_CONFIG, demo_corpus, trained_demo_tensors, write_demo_model
from ktc.runtime import perplexity as ppl

STEPS = 30


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KTC_CACHE_DIR", str(cache))
        import ktc.demo as demo_module

        mp.setitem(demo_module.TRAIN, "steps", STEPS)
        trained = write_demo_model(str(tmp_path_factory.mktemp("trained")), trained=True)
        again = trained_demo_tensors()  # from the cache
    random = write_demo_model(str(tmp_path_factory.mktemp("random")))
    return trained, random, again, cache


def test_trained_checkpoint_scores_held_out_text_better(demo, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    trained, random, _, _ = demo
    held_out = demo_corpus()[1]
    scores = {}
    for name, folder in (("trained", trained), ("random", random)):
        bundle = str(tmp_path / f"{name}.ktb")
        compile_bundle(folder, bundle, cpu_scheme="f32", dense_scheme="f32", max_tokens=256)
        scores[name] = ppl.measure(bundle, held_out, ctx=64, max_windows=6)["perplexity"]
    vocab = DEMO_CONFIG["vocab_size"]
    assert scores["random"] > 0.8 * vocab and scores["trained"] < 0.5 * scores["random"]
    # transformers reads the same checkpoint (its per-expert tensors back into its fused ones)
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    with ppl.checkpoint_scorer(trained, 64) as run:
        windows = ppl.make_windows(ppl.tokenize(_tokenizer(trained), held_out)[0], 64, max_windows=6)
        nll = np.concatenate([-run(w)[np.arange(windows.scored), windows.targets(i)] for i, w in
                              enumerate(windows.tokens)])
    assert model.config.num_experts == DEMO_CONFIG["num_experts"]
    assert abs(np.exp(nll.mean()) - scores["trained"]) / scores["trained"] < 1e-4


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_training_is_cached_and_repeatable(demo):
    from safetensors.numpy import load_file

    from ktc.demo import TRAIN, _train

    trained, _, again, cache = demo
    written = load_file(f"{trained}/model.safetensors")
    assert written.keys() == again.keys() and all(np.array_equal(written[k], again[k]) for k in written)
    assert len([p for p in cache.iterdir() if p.name.startswith("demo-trained-")]) == 1
    runs = [_train(DEMO_CONFIG, TRAIN | {"steps": 3}, demo_corpus()[0], False) for _ in range(2)]
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])  # the same bits, run after run


def test_quantized_bundles_diverge_in_order(demo, tmp_path):
    trained = demo[0]
    held_out = demo_corpus()[1]
    bundles = {}
    for scheme in ("f32", "q8_0", "q4_0"):
        bundles[scheme] = str(tmp_path / f"{scheme}.ktb")
        compile_bundle(trained, bundles[scheme], cpu_scheme=scheme, dense_scheme="f32" if scheme == "f32" else scheme,
                       max_tokens=256)
    kld = {scheme: ppl.measure(bundles[scheme], held_out, ctx=64, max_windows=6,
                               reference=bundles["f32"])["reference"]["kld_mean"] for scheme in ("q8_0", "q4_0")}
    assert 0 < kld["q8_0"] < kld["q4_0"]


def test_demo_runs_the_loop(demo, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    import ktc.demo as demo_module
    from ktc.cli import main

    monkeypatch.setenv("KTC_CACHE_DIR", str(demo[3]))  # the fixture's trained weights: no training here
    monkeypatch.setitem(demo_module.TRAIN, "steps", STEPS)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])  # after transformers' loading bars
    assert out["format"] == "ktc-demo" and out["trained"]
    assert out["family"] == "qwen3_moe" and out["num_experts"] == 16 and out["top_k"] == 4
    assert not [n for n in os.listdir(tmp_path / "demo") if n.startswith(".tmp")]
    assert len(out["run"]["generated_tokens"]) == 48 and out["profile"]["tokens"] > 500
    assert max(out["profile"]["top_expert_share"]) > 1.5 / DEMO_CONFIG["num_experts"]  # skewed routing
    assert out["profiled_plan"]["predicted_ms_per_token"] <= out["uniform_placement_ms_per_token_measured_routing"]
    assert 0 < out["perplexity"]["reference"]["kld_mean"] and out["perplexity"]["windows"] > 1
    streaming = out["streaming_plan"]  # the recorded trace replayed: the split chosen is the fastest
    assert os.path.exists(out["profile"]["trace"]) and streaming["splits"]
    assert min(s["ms_per_token"] for s in streaming["splits"]) == next(
        s["ms_per_token"] for s in streaming["splits"]
        if (s["layer_slots"] == streaming["layer_slots"] if streaming["cache_slots"] else not s["slots"]))
