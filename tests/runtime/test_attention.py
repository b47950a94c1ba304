"""Prompt attention a block of queries at a time (``runtime.attention``) against transformers'
SDPA path on the same tensors."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ktc.runtime import attention
from ktc.runtime.attention import blocked_attention


class Layer:
    """What the attention functions read of an attention module."""

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.is_causal = True


def tensors(length: int, past: int, heads: int, kv_heads: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    keys = past + length
    return (torch.randn(1, heads, length, 32, generator=g), torch.randn(1, kv_heads, keys, 32, generator=g),
            torch.randn(1, kv_heads, keys, 32, generator=g))


def causal_mask(length: int, past: int, keys: int, window: int | None = None) -> torch.Tensor:
    position = torch.arange(length)[:, None] + past
    key = torch.arange(keys)[None, :]
    sees = key <= position
    if window is not None:
        sees &= key > position - window
    return sees[None, None]


@pytest.mark.parametrize("length, past, heads, kv_heads", [(130, 0, 4, 4), (200, 70, 8, 2), (256, 200, 6, 1)])
@pytest.mark.parametrize("kind", ["bool", "float", "sliding", "none"])
def test_blocked_attention_equals_sdpa(length, past, heads, kv_heads, kind):
    """Boolean, additive and sliding-window masks, no mask (causal), grouped key/value heads, keys
    before the prompt (a later chunk): the same outputs as transformers' SDPA path."""
    if kind == "none" and past:
        pytest.skip("no mask means a causal prompt from the first key")
    q, k, v = tensors(length, past, heads, kv_heads)
    mask = None if kind == "none" else causal_mask(length, past, past + length, 50 if kind == "sliding" else None)
    if kind == "float":
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    layer = Layer(heads // kv_heads)
    scaling = None if kind == "none" else 0.3  # None: 1 / sqrt(head size)
    got, _ = blocked_attention(layer, q, k, v, mask, scaling=scaling)
    want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=scaling)
    assert got.shape == want.shape == (1, length, heads, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take_goes_to_sdpa(monkeypatch):
    """Short prompts, prompts mostly after earlier keys, and a query that sees no key go to
    transformers' SDPA path as they are."""
    calls = []
    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward",
                        lambda *args, **kw: calls.append(args[1].shape[2]) or (None, None))
    layer = Layer(2)
    q, k, v = tensors(attention.MIN_QUERIES - 1, 0, 4, 2)
    blocked_attention(layer, q, k, v, None)
    q, k, v = tensors(130, 300, 4, 2)
    blocked_attention(layer, q, k, v, causal_mask(130, 300, 430))
    q, k, v = tensors(130, 0, 4, 2)
    blind = causal_mask(130, 0, 130).clone()
    blind[0, 0, 5] = False
    blocked_attention(layer, q, k, v, blind)
    assert calls == [attention.MIN_QUERIES - 1, 130, 130]
    blocked_attention(layer, q, k, v, causal_mask(130, 0, 130))
    assert len(calls) == 3
