"""Routing statistics recorded from text (``ktc profile``): how often the router of each MoE
layer chose each expert while the bundle's model read the text, in the activation-profile format
``ktc plan --profile`` reads (``formats.activation_profile``).

The text runs as prefill only (no generation), in sequences of at most ``ctx`` tokens, each from
an empty KV cache: a text file is cut into consecutive sequences of ``ctx`` tokens (its tail
too); a prompts file gives one sequence per non-empty line (tokenized as a prompt is, special
tokens included; longer lines are cut the same way). The counts are the experts' own routing
counts (``ExpertSet.counts``), which every path through them keeps.
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
    figures: tokens, sequences, per layer the share of choices its most chosen expert took, and
    with ``trace`` the routing token by token, ``"trace"``: int array [tokens, MoE layers, k],
    the sequences one after another)."""
    from tqdm import tqdm

    from .hf import from_bundle

    with from_bundle(bundle, threads=threads) as km:
        if not km.experts:
            raise KtcError("the bundle's model has no routed experts to profile", path=bundle)
        runs = sequences(km.tokenizer, text=text, prompts=prompts, ctx=min(ctx, km.max_tokens))
        experts = sorted(km.experts, key=lambda e: e.layer)
        for e in experts:
            e.counts[:] = 0
            e.trace = [] if trace else None
        with tqdm(total=sum(map(len, runs)), unit="token", desc="profiling", disable=None if progress else True,
                  leave=False) as bar:
            for ids in runs:
                km.forward_window(np.asarray(ids, dtype=np.int64), 0, 0, batch)
                bar.update(len(ids))
        counts = np.stack([e.counts for e in experts]).astype(np.float64)
        routes = np.stack([np.concatenate(e.trace) for e in experts], axis=1) if trace else None
        for e in experts:
            e.trace = None
        top_k = int(km.bundle.manifest["model"]["moe_layers"][0]["top_k"])
    profile = ActivationProfile(tuple(e.layer for e in experts), counts, source)
    tokens = sum(map(len, runs))
    share = counts.max(axis=1) / np.maximum(counts.sum(axis=1), 1)
    figures = {"tokens": tokens, "sequences": len(runs), "moe_layers": len(experts), "top_k": top_k,
               "num_experts": profile.num_experts, "top_expert_share": share.tolist()}
    return profile, figures | ({"trace": routes} if trace else {})
