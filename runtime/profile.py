"""Routing statistics recorded from text (``ktc profile``): how often the router of each MoE
layer chose each expert while the bundle's model read the text, in the activation-profile format
``ktc plan --profile`` reads (``formats.activation_profile``).

The text runs as prefill only (no generation), in sequences of at most ``ctx`` tokens, each from
an empty KV cache: a text file is cut into consecutive sequences of ``ctx`` tokens (its tail
too); a prompts file gives one sequence per non-empty line (tokenized as a prompt is, special
tokens included; longer lines are cut the same way). The counts are the experts' own routing
counts (``ExpertSet.counts``), which every path through them keeps.

Pre-gating, as a prefetch one layer ahead would do it: each MoE layer's input (its hidden
states after attention) through the next MoE layer's router, its k largest logits taken as the
guess; the figure is the share of the next layer's chosen experts the guess named.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.activation_profile import ActivationProfile


def sequences(tokenizer: Any, *, text: str | None = None, prompts: list[str] | None = None,
              ctx: int) -> list[list[int]]:
    """The token sequences the text (or the prompts) make, each at most ``ctx`` long."""
    if (text is None) == (prompts is None):
        raise KtcError("give the text to profile with --text FILE or --prompts FILE (one of them)")
    if text is not None:
        pieces = [list(tokenizer(text, add_special_tokens=False).input_ids)]
    else:
        pieces = [list(tokenizer(line).input_ids) for line in prompts or [] if line.strip()]
    out = [ids[at:at + ctx] for ids in pieces for at in range(0, len(ids), ctx)]
    if not out:
        raise KtcError("the text to profile is empty")
    return out


def record(bundle: str, *, text: str | None = None, prompts: list[str] | None = None, ctx: int = 512,
           batch: int | None = None, threads: int | None = None, progress: bool = False,
           source: str = "ktc profile", trace: bool = False) -> tuple[ActivationProfile, dict[str, Any]]:
    """(the routing counts of ``bundle``'s model over the text, as an activation profile; the
    figures: tokens, sequences, per layer the share of choices its most chosen expert took, the
    pre-gating accuracy (``pregating``), and with ``trace`` the routing token by token,
    ``"trace"``: int array [tokens, MoE layers, k], the sequences one after another)."""
    from tqdm import tqdm

    from .hf import from_bundle
    from .prefetch import pregate

    with from_bundle(bundle, threads=threads) as km:
        if not km.experts:
            raise KtcError("the bundle's model has no routed experts to profile", path=bundle)
        runs = sequences(km.tokenizer, text=text, prompts=prompts, ctx=min(ctx, km.max_tokens))
        experts = sorted(km.experts, key=lambda e: e.layer)
        top_k = int(km.bundle.manifest["model"]["moe_layers"][0]["top_k"])
        routes: list[list[np.ndarray]] = [[] for _ in experts]
        guesses: list[list[np.ndarray]] = [[] for _ in experts]  # the next MoE layer's, from this one's input
        routers = [km.bundle.tensor_float32(f"layers.{e.layer}.router") for e in experts]
        for i, e in enumerate(experts):
            e.counts[:] = 0
            e.observers.append(lambda hidden, idx, i=i: routes[i].append(idx.copy()))
            if i + 1 < len(experts):
                e.observers.append(
                    lambda hidden, idx, i=i: guesses[i].append(pregate(hidden, routers[i + 1], top_k)))
        try:
            with tqdm(total=sum(map(len, runs)), unit="token", desc="profiling", disable=None if progress else True,
                      leave=False) as bar:
                for ids in runs:
                    km.forward_window(np.asarray(ids, dtype=np.int64), 0, 0, batch)
                    bar.update(len(ids))
        finally:
            for e in experts:
                e.observers.clear()
        counts = np.stack([e.counts for e in experts]).astype(np.float64)
    chosen = np.stack([np.concatenate(r) for r in routes], axis=1)  # [tokens, layers, k]
    pregating = [_overlap(np.concatenate(guesses[i]), chosen[:, i + 1]) for i in range(len(experts) - 1)]
    profile = ActivationProfile(tuple(e.layer for e in experts), counts, source)
    tokens = sum(map(len, runs))
    share = counts.max(axis=1) / np.maximum(counts.sum(axis=1), 1)
    figures = {"tokens": tokens, "sequences": len(runs), "moe_layers": len(experts), "top_k": top_k,
               "num_experts": profile.num_experts, "top_expert_share": share.tolist(), "pregating": pregating}
    return profile, figures | ({"trace": chosen} if trace else {})


def _overlap(guess: np.ndarray, chosen: np.ndarray) -> float:
    """The share of the experts chosen (each row's k) that the guess (each row's k) named: how
    many a prefetch from the guess would have had on their way."""
    hits = sum(len(set(g) & set(c)) for g, c in zip(guess.tolist(), chosen.tolist()))
    return hits / max(chosen.size, 1)
