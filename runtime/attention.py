"""Prompt attention on the CPU a block of queries at a time, registered with transformers'
attention interface (``transformers.AttentionInterface``) as ``ktc_blocked``.

torch's ``scaled_dot_product_attention`` on the CPU does every query's products with every key
whatever the causal mask: a 512-token prompt through one Qwen3-30B-A3B attention layer (32 query
heads, 4 key/value heads of 128) took 23-25 ms on the Zen 5 machine with ``is_causal``, a float
or a boolean mask alike, a third of that model's one-layer prefill. Here the queries go a block
of ``BLOCK`` at a time, each block's scores only against the keys its rows can see (the block's
last row's, from the mask; the mask applied only where some row of the block does not see a
key), through torch's batched products on the key/value heads (a head's query group as rows, no
repeated keys), f32 throughout (within 3e-6 of SDPA's outputs). Medians of 7 calls, this layer's
shape, blocked against SDPA: 512 queries from the first key 17.7-19.6 against 23.7-25.3 ms,
after 512 earlier keys 40-43 against 50-53, after 1024 78-80 against 75 (there the earlier keys'
products, which no mask saves, are most of it, and SDPA's own kernel does them faster: more
keys than ``FAR`` times the queries go to SDPA), 1024 from the first key 58-66 against 87-98,
256 4.5-5.1 against 5.8-6.7, 128 1.4-1.7 against 1.6-2.0. Fewer than ``MIN_QUERIES`` queries,
masks per head, batches, dropout, attention sinks, soft-capping and position biases go to
transformers' own SDPA path.
"""
from __future__ import annotations

from typing import Any

NAME = "ktc_blocked"
BLOCK = 64  # queries a block (a first version of the loop, 512 queries, the layer above): 32 14.1 ms, 64 14.7, 128 16.9
MIN_QUERIES = 128
FAR = 2  # more keys seen than this many times the queries: SDPA (above)


def blocked_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Transformers' attention function signature: ``query`` [B, H, L, D], ``key``/``value`` [B,
    Hkv, S, D], ``attention_mask`` None (causal) or [B, 1, L, S] (boolean: True where a query
    sees a key; or additive floats); returns the output [B, L, H, D] and no weights."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa() -> tuple[Any, None]:  # transformers' own path, with the arguments as they came
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    mask = attention_mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (length < MIN_QUERIES or batch != 1 or query.device.type != "cpu" or dropout or heads % kv_heads
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "sinks", "s_aux"))
            or getattr(module, "sinks", None) is not None or (mask is None and not causal)
            or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != length))):
        return sdpa()
    if mask is None:  # causal from the first key, as SDPA's is_causal (transformers crops the keys to the queries)
        key, value = key[:, :, :length], value[:, :, :length]
        visible = torch.ones(length, length, dtype=torch.bool).tril()
    elif mask.dtype == torch.bool:
        visible = mask[0, 0]
    else:
        visible = mask[0, 0] > torch.finfo(mask.dtype).min / 2
    if (not bool(visible[:, : key.shape[2]].any(dim=1).all())  # a query that sees no key: SDPA's own answer
            or int(visible.any(dim=0).nonzero().max()) + 1 > FAR * length):  # mostly earlier keys: SDPA's faster
        return sdpa()
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = (query * scale).view(batch, kv_heads, groups, length, dim)
    keys_t = key.transpose(-1, -2)
    out = torch.empty(batch, kv_heads, groups, length, value.shape[-1], dtype=query.dtype)
    for first in range(0, length, BLOCK):
        last = min(length, first + BLOCK)
        rows = last - first
        sees = visible[first:last, : key.shape[2]]
        extent = int(sees.any(dim=0).nonzero().max()) + 1  # the keys this block's rows can see
        # from ``start`` on some row does not see a key or has a bias for it: the mask applies there only
        differs = ~sees[:, :extent].all(dim=0)
        if mask is not None and mask.dtype != torch.bool:
            differs |= (mask[0, 0, first:last, :extent] != 0).any(dim=0)
        start = int(differs.nonzero().min()) if bool(differs.any()) else extent
        scores = torch.matmul(grouped[:, :, :, first:last].reshape(batch, kv_heads, groups * rows, dim),
                              keys_t[..., :extent]).view(batch, kv_heads, groups, rows, extent)
        if mask is not None and mask.dtype != torch.bool:
            scores[..., start:] += mask[0, 0, first:last, start:extent]
        else:
            scores[..., start:].masked_fill_(~sees[:, start:extent], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[:, :, :, first:last] = torch.matmul(weights.view(batch, kv_heads, groups * rows, extent),
                                                value[..., :extent, :]).view(batch, kv_heads, groups, rows, -1)
    return out.view(batch, heads, length, -1).transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers ``blocked_attention`` with transformers as ``NAME``, with SDPA's masks (without a
    mask function of its own transformers gives a custom attention no mask at all); returns the
    name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, blocked_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
