"""``ktc perplexity`` (``runtime.perplexity``): the perplexity of an f32 bundle against transformers'
own model on the same windows, computed here independently; KL divergence figures against a
reference bundle, a checkpoint and saved log-probabilities; the command line."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import model_factory as mf
from ktc.cli import main
from ktc.compile import compile_bundle
from ktc.errors import KtcError
from ktc.runtime import perplexity as ppl

CTX = 32
WINDOWS = 6
WORDS = "the quick brown fox jumps over a lazy dog while seven tall trees sway in the cold wind".split()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint with a character tokenizer, its bundles in f32, q8_0 and q4_0,
    and a text of a little more than WINDOWS windows."""
    root = tmp_path_factory.mktemp("ppl")
    model = mf.build_hf_model("qwen3_moe").eval()
    folder = str(root / "src")
    mf.write_safetensors(model, folder)
    mf.write_char_tokenizer(folder, 96)
    bundles = {}
    for scheme in ("f32", "q8_0", "q4_0"):
        bundles[scheme] = str(root / f"{scheme}.ktb")
        compile_bundle(folder, bundles[scheme], cpu_scheme=scheme, dense_scheme="f32" if scheme == "f32" else scheme,
                       max_tokens=64)
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(WORDS, 60))
    path = root / "text.txt"
    path.write_text(text, encoding="utf-8")
    return model, folder, bundles, text, str(path)


def transformers_perplexity(model, folder: str, text: str) -> float:
    """The perplexity by llama-perplexity's convention, written out here against transformers'
    model: windows of CTX tokens, the logits of positions CTX/2 .. CTX-2 against the next tokens."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False).input_ids
    windows = torch.tensor(ids[:WINDOWS * CTX]).view(WINDOWS, CTX)
    nll = []
    with torch.no_grad():
        for window in windows:
            logp = torch.log_softmax(model(window[None]).logits[0].double(), dim=-1)
            for pos in range(CTX // 2, CTX - 1):
                nll.append(-float(logp[pos, window[pos + 1]]))
    return math.exp(sum(nll) / len(nll))


def test_windows_follow_llama_perplexity():
    windows = ppl.make_windows(list(range(100, 171)), 16, bos=1)
    assert windows.tokens.shape == (4, 16)  # 71 tokens: four whole windows, the rest dropped
    assert (windows.tokens[:, 0] == 1).all() and windows.tokens[1, 1] == 117
    assert windows.first == 8 and windows.scored == 7
    assert windows.targets(2).tolist() == list(range(100 + 2 * 16 + 9, 100 + 3 * 16))
    assert ppl.make_windows(list(range(40)), 16, max_windows=1).tokens.shape == (1, 16)
    with pytest.raises(KtcError, match="fewer than one window"):
        ppl.make_windows(list(range(10)), 16)


class _BosTokenizer:
    """Characters as ids 10+, with BOS (1) first unless add_special_tokens=False."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + [10 + ord(c) % 50 for c in text])


def test_bos_leads_the_text_and_every_window():
    ids, bos = ppl.tokenize(_BosTokenizer(), "abcdefgh")
    assert bos == 1 and ids[:2] == [1, 10 + ord("a") % 50] and len(ids) == 9  # as llama-perplexity tokenizes
    windows = ppl.make_windows(ids, 4, bos=bos)
    assert windows.tokens[:, 0].tolist() == [1, 1] and windows.tokens[0, 1] == 10 + ord("a") % 50


def test_f32_bundle_perplexity_equals_transformers(models):
    model, folder, bundles, text, _ = models
    got = ppl.measure(bundles["f32"], text, ctx=CTX, max_windows=WINDOWS)
    want = transformers_perplexity(model, folder, text)
    assert got["windows"] == WINDOWS and got["tokens"] == WINDOWS * (CTX - 1 - CTX // 2)
    assert abs(got["perplexity"] - want) / want < 1e-4
    assert got["perplexity_error"] > 0


def test_kld_of_a_bundle_against_itself_is_zero(models):
    _, _, bundles, text, _ = models
    got = ppl.measure(bundles["q4_0"], text, ctx=CTX, max_windows=WINDOWS, reference=bundles["q4_0"])["reference"]
    assert got["kld_max"] == 0.0 and got["kld_mean"] == 0.0
    assert got["top1_agreement"] == 1.0 and got["rms_delta_p"] == 0.0


def test_coarser_schemes_diverge_more(models):
    _, folder, bundles, text, _ = models
    kld = {scheme: ppl.measure(bundles[scheme], text, ctx=CTX, max_windows=WINDOWS,
                               reference=folder)["reference"] for scheme in ("f32", "q8_0", "q4_0")}
    # against the checkpoint run by transformers: f32 by rounding at most, q8_0 by less than q4_0
    # (tiny figures: a random model's distributions are nearly uniform)
    assert kld["f32"]["kld_mean"] < 1e-9 < kld["q8_0"]["kld_mean"] < kld["q4_0"]["kld_mean"] / 4
    assert kld["q4_0"]["rms_delta_p"] > kld["q8_0"]["rms_delta_p"] > 0


def test_saved_logprobs_give_the_same_figures(models, tmp_path):
    _, _, bundles, text, _ = models
    saved = str(tmp_path / "f32.logprobs")
    base = ppl.measure(bundles["f32"], text, ctx=CTX, max_windows=WINDOWS, save_logits=saved)
    header, data = ppl.read_logprobs(saved)
    assert header["ctx"] == CTX and data.shape == (WINDOWS, CTX - 1 - CTX // 2, 96)
    direct = ppl.measure(bundles["q4_0"], text, ctx=CTX, max_windows=WINDOWS, reference=bundles["f32"])
    from_file = ppl.measure(bundles["q4_0"], text, ctx=CTX, max_windows=WINDOWS, logits=saved)
    assert from_file["reference"]["perplexity"] == base["perplexity"]
    for key in ("kld_mean", "kld_p99", "top1_agreement", "rms_delta_p"):
        assert from_file["reference"][key] == direct["reference"][key]
    # fewer windows than were saved: the first ones; other windows: refused
    assert ppl.measure(bundles["q4_0"], text, ctx=CTX, max_windows=2, logits=saved)["windows"] == 2
    with pytest.raises(KtcError, match="other windows"):
        ppl.measure(bundles["q4_0"], text, ctx=CTX // 2, logits=saved)


def test_an_interrupted_save_leaves_no_file(models, tmp_path):
    windows = ppl.make_windows(list(range(64)), 16)
    path = str(tmp_path / "x.logprobs")
    writer = ppl.LogprobWriter(path, windows, 8, "test")
    writer.add(np.zeros((windows.scored, 8), np.float32))
    writer.abort()
    assert os.listdir(tmp_path) == []
    with open(path, "wb") as f:
        f.write(b"not log-probabilities")
    with pytest.raises(KtcError, match="not a ktc log-probabilities file"):
        ppl.read_logprobs(path)


def test_cli_json_and_text(models, tmp_path):
    _, _, bundles, _, text_path = models
    runner = CliRunner()
    result = runner.invoke(main, ["perplexity", bundles["q8_0"], "--text", text_path, "--ctx", str(CTX),
                                  "--chunks", "3", "--reference", bundles["f32"], "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["format"] == "ktc-perplexity" and out["windows"] == 3 and out["perplexity"] > 1
    assert 0 < out["reference"]["kld_mean"] and 0.5 < out["reference"]["top1_agreement"] <= 1
    result = runner.invoke(main, ["perplexity", bundles["q8_0"], "--text", text_path, "--ctx", str(CTX),
                                  "--chunks", "2"])
    assert result.exit_code == 0, result.output
    assert "PPL = " in result.output and "2 windows of 32 tokens" in result.output
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    result = runner.invoke(main, ["perplexity", bundles["q8_0"], "--text", str(short), "--ctx", str(CTX)])
    assert result.exit_code != 0 and "fewer than one window" in result.output
