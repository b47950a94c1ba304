"""The hidden states that reach each MoE layer's experts over a text, from the source model as
transformers runs it (float32): what ``--calibration-text`` measures the schemes' errors on
(``passes/activation_error.py``).

Transformers' experts modules take ``(hidden_states, top_k_index, top_k_weights)``; a forward
pre-hook on each records its inputs. The text is cut into windows of ``ctx`` tokens, each run
without a cache, up to ``max_tokens`` tokens in all.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import numpy as np

from ktc.errors import KtcError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _experts_modules(model: Any) -> dict[int, Any]:
    """Decoder layer index -> the experts module of transformers' experts interface in it."""
    found = {}
    for name, module in model.named_modules():
        match = _LAYER.search(name + ".")
        if match is None or not name.endswith("experts"):
            continue
        try:
            parameters = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if "top_k_index" in parameters:
            found[int(match.group(1))] = module
    return found


@functools.lru_cache(maxsize=2)  # a compile that plans measures the same text twice
def expert_inputs(path: str, text: str, *, max_tokens: int = 1024, ctx: int = 256) -> dict[int, tuple[np.ndarray,
                                                                                                        np.ndarray]]:
    """Per MoE layer (decoder layer index): (the hidden states entering its experts [T, hidden],
    float32; the experts the router chose for each [T, top_k]) over ``text``, run through the
    checkpoint at ``path`` (a folder transformers loads). Kept for the next call with the same
    arguments: treat the arrays as read-only."""
    import torch

    from .hf import require_transformers
    from .perplexity import tokenize

    transformers = require_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as exc:  # transformers raises many types for a checkpoint it cannot load
        raise KtcError(f"--calibration-text runs the source model through transformers, which cannot load it "
                       f"({type(exc).__name__}: {exc})", path=path,
                       hint="give a Hugging Face checkpoint folder (config.json, weights, tokenizer)") from None
    ids, _ = tokenize(tokenizer, text)
    ids = ids[:max_tokens]
    if len(ids) < 2:
        raise KtcError("the calibration text has fewer than 2 tokens")
    modules = _experts_modules(model)
    if not modules:
        raise KtcError("transformers' model of this checkpoint has no experts module that takes "
                       "(hidden_states, top_k_index, top_k_weights)", path=path)
    seen: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {layer: [] for layer in modules}

    def hook(layer: int) -> Any:
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            hidden, chosen = bound.arguments["hidden_states"], bound.arguments["top_k_index"]
            seen[layer].append((hidden.detach().float().reshape(-1, hidden.shape[-1]).numpy().copy(),
                                chosen.detach().reshape(hidden.numel() // hidden.shape[-1], -1).numpy().copy()))
        return record

    handles = [module.register_forward_pre_hook(hook(layer), with_kwargs=True) for layer, module in modules.items()]
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), ctx):
                window = ids[start:start + ctx]
                model(input_ids=torch.as_tensor([window]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (np.concatenate([h for h, _ in parts]), np.concatenate([c for _, c in parts]))
            for layer, parts in seen.items() if parts}
