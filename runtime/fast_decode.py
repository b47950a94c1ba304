"""One-token decode steps of a whole model without transformers' modules (``FastDecode``).

transformers' decoder layer spends about 2 ms a layer in Python around ktc's kernels at
Qwen3-30B-A3B's shape (a module call per projection and norm, each norm six torch ops, the
router, the cache update, the attention interface), about twice the time its kernels take to
read the layer's Q4_0 weights: a 48-layer model would spend most of each token there. For the
families whose decode step it computes (``FAMILIES``) on a CPU-only model, ``FastDecode`` runs
the step itself, one compiled call a layer where the projections and experts take ktc's VNNI
kernels (``_moe_layer_token``; two where the experts do not, a few more elsewhere): RMSNorm,
the projections through ktc's kernels (the same ``HostLinear`` weights), query/key norms, the
rotary embedding (cos and sin from the model's own rotary module, kept by blocks of positions;
on a part of each head where the model turns only that, as GLM-4.5's half),
the keys and values into the same preallocated KV cache, attention over the cache (with gpt-oss's
sinks: a logit a head that takes part in the softmax and attends to nothing), the projections'
biases where a model has them (gpt-oss, Qwen2-MoE), and the MoE block through
``runtime.moe.MoELayer``'s routing and experts (the same ``ExpertSet``), with Qwen2-MoE's shared
expert beside them (``_Shared``; GLM-4.5's shared experts without its gate). DeepSeek-V2's and
V3's multi-head latent attention (Kimi-K2's, Moonlight's: the ``deepseek_v3`` family) in its absorbed
form (``_Latent``), whose work a step does not grow with the cache as transformers' does. A
layer with a shared expert, a dense layer and a latent attention layer take one compiled call
each (``_one_call_layer``), not the stack's one call. Prefill stays transformers'.
``KTC_FAST_DECODE=0`` turns it off. Tests check its logits and greedy tokens against
transformers' own steps, family by family.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange, typed, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.errors import KtcError, UnsupportedModelError

from ktc.formats.kernel_args import read_only

from . import lanes, rows, vnni
from .kernels import decode, exact_bf16
from .moe import MoELayer, _moe_token
from .projections import Projections, stack_token

# transformers model types whose decoder layer ``FastDecode`` computes: pre-norm RMSNorm,
# grouped-query attention with rotate-half rotary embeddings (Qwen3: RMSNorm on each head's
# queries and keys; OLMoE: on all the queries and all the keys at once, then clipped where the
# config says; gpt-oss: none, but biased projections and a sink logit a head), softmax top-k
# routing (gpt-oss's softmax over the top k logits is the same weights); dense MLP layers too
# (Qwen3's mlp_only_layers). Each with where its attention's sliding window comes from:
# Mixtral's attention passes the config's, Qwen3's and gpt-oss's keep their own (None where a
# layer attends to everything; gpt-oss alternates), OLMoE has none. Qwen2-MoE: biased query,
# key and value projections, and a shared expert beside the routed ones, its output times the
# sigmoid of a gate (``_Shared``). GLM-4.5: biased projections, the rotary embedding on the first
# half of each head (the rest as it is), sigmoid routing (``MoELayer.route``), shared experts
# without a gate. dots.llm1: Qwen3's attention, DeepSeek-V3's routing, shared experts.
# DeepSeek-V3: multi-head latent attention (``_Latent``; rotary pairs neighbours or half a head
# apart, a compressed query or not), DeepSeek-V3's routing, shared experts, dense first layers;
# DeepSeek-V2: the same with complex rotary factors (``PAIRED_ROTARY``) and softmax routing.
FAMILIES = {"mixtral": "config", "qwen3_moe": "attention", "olmoe": "attention", "gpt_oss": "attention",
            "qwen2_moe": "attention", "glm4_moe": "attention", "dots1": "attention", "deepseek_v3": "attention",
            "deepseek_v2": "attention"}
# Families whose rotary module gives cos and sin for half a head (gpt-oss: each value j < D/2
# turns with j + D/2 by angle j): their tables are widened to the head by repeating them, the
# rotate-half form the steps compute.
HALF_ROTARY = ("gpt_oss",)
# Families whose rotary module gives complex factors a pair of neighbouring values (DeepSeek-V2's
# freqs_cis: value 2j turns with 2j + 1 by angle j, each pair kept in its place): their tables are
# its real and imaginary parts, widened as above (``_Latent.pairs`` 2).
PAIRED_ROTARY = ("deepseek_v2",)
_ROTARY_BLOCK = 256  # positions of rotary cos/sin computed at once
_NONE = np.zeros(0, np.float32)  # a layer's biases or sinks where it has none
# _attend's second part of the queries and keys where there is none
_NO_MORE, _NO_MORE_KEYS = np.zeros((1, 0), np.float32), np.zeros((1, 1, 0), np.float32)


class _Unsupported(Exception):
    """The model has a part ``FastDecode`` does not compute: transformers' step runs instead."""


@dataclass
class _Norm:
    weight: np.ndarray
    eps: np.float32  # float32 wherever the norm is called from: one compiled type of _rms_norm


@dataclass
class _Shared:
    """A MoE layer's shared expert (``HostLinear``s): SiLU(gate x) * (up x), through down, times
    sigmoid(shared_gate x) where the model has that gate (Qwen2-MoE's, one row). ``first``:
    gate and up in one call (``Projections``), where one call takes them."""

    gate: Any
    up: Any
    down: Any
    shared_gate: Any | None
    first: Projections | None


@dataclass
class _Latent:
    """DeepSeek-V3's multi-head latent attention (MLA) in its absorbed form. The cache keeps,
    as transformers' attention does, each position's latent (the normed first ``lora`` values
    of ``kv_a``'s output) and its rotary key (the last ``rope``, turned), both shared by every
    head; transformers multiplies every cached latent by ``kv_b`` at every step (its keys and
    values per head: the step's work grows with the cache), where the absorbed form moves
    ``kv_b`` to the query and the output instead: a head's query's non-rotary part times its
    key rows of ``kv_b`` gives a query in the latent's space (``k_up``), attention over the
    latents and rotary keys gives a latent a head, and the head's value rows of ``kv_b``
    (``v_up``) turn that into its values. The same products in another order: one query
    against one key head of ``lora + rope`` values. ``k_up`` and ``v_up`` (``_per_head``'s
    specs): where the bundle keeps them apart in a block scheme or a K-quant (a GGUF's
    ``attn_k_b`` and ``attn_v_b``, as llama.cpp's converter stores MLA), their own rows, each
    head's activations quantized as the scheme's kernels quantize one vector; else float32
    copies of ``kv_b``'s values (bf16 where every value is one: a bf16 bundle's), multiplied by
    float32 queries and latents."""

    q: Any | None  # q_proj, where the model has no query compression
    q_a: Any | None  # or q_a_proj, its norm and q_b_proj
    q_norm: _Norm | None
    q_b: Any | None
    kv_a: Any
    kv_norm: _Norm
    k_up: tuple  # type: ignore[type-arg]  # each head's key rows of kv_b, transposed: [lora, nope] a head
    v_up: tuple  # type: ignore[type-arg]  # its value rows: [v, lora] a head
    nope: int  # a query head's values without the rotary embedding, then ``rope`` with it
    rope: int
    # the rotary pairs: 0 half a head apart; neighbours turned as halves, the evens first
    # (DeepSeek-V3's rope_interleave), 1; neighbours kept in place (DeepSeek-V2's complex rotary), 2
    pairs: int
    first: Projections | None  # q_a (or q) and kv_a in one call, where one call takes them


@dataclass
class _Layer:
    input_norm: _Norm
    q: Any
    k: Any
    v: Any
    o: Any
    q_norm: _Norm | None
    k_norm: _Norm | None
    whole_norms: bool  # q_norm and k_norm over all heads at once (OLMoE), not each head
    clip: float | None  # |q|, |k|, |v| clipped to this (OLMoE's clip_qkv)
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None
    cache: Any  # the layer's runtime.hf PreallocatedLayer
    keys: np.ndarray  # its key and value buffers, [kv heads, capacity, head dim] views
    values: np.ndarray
    post_norm: _Norm
    moe: MoELayer | None
    mlp: tuple[Any, Any, Any] | None  # gate, up, down of a dense layer
    shared: _Shared | None  # a MoE layer's shared expert
    # float32 arrays, empty where the model has none: the query, key and value projections'
    # biases one after another, the output projection's, the attention sinks (one a query head)
    qkv_bias: np.ndarray
    o_bias: np.ndarray
    sinks: np.ndarray
    latent: _Latent | None = None  # a multi-head latent attention's parts (then q, k, v are None)
    # _attention_token's (or, for a latent attention, _latent_token's) arguments, where it runs
    compiled: tuple | None = None  # type: ignore[type-arg]
    ffn: tuple | None = None  # type: ignore[type-arg]  # _mlp_token's for the dense MLP or shared expert


def fast_decoder(km: Any) -> FastDecode | None:
    """A ``FastDecode`` for ``km`` (a ``runtime.hf.KtcModel``), or None where transformers'
    step must run: a model on a device, a family not in ``FAMILIES``, a part it does not
    compute, or ``KTC_FAST_DECODE=0``."""
    if km.device is not None or os.environ.get("KTC_FAST_DECODE", "1") == "0":
        return None
    if getattr(km.model.config, "model_type", None) not in FAMILIES:
        return None
    try:
        return FastDecode(km)
    except _Unsupported:
        return None


def _norm(module: Any, size: int) -> _Norm:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if weight is None or eps is None or tuple(weight.shape) != (size,) or not type(module).__name__.endswith("RMSNorm"):
        raise _Unsupported(f"norm {type(module).__name__}")
    return _Norm(np.ascontiguousarray(weight.detach().float().numpy()), np.float32(eps))


def _silu_mlp(module: Any) -> tuple[Any, Any, Any]:
    """The gate, up and down ``HostLinear``s of a SiLU MLP module (a dense layer's, a shared
    expert's); ``_Unsupported`` for anything else."""
    parts = tuple(getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if type(getattr(module, "act_fn", None)).__name__ != "SiLUActivation" or None in parts:
        raise _Unsupported("MLP")
    return tuple(_host(p) for p in parts)  # type: ignore[return-value]


def _shared(expert: Any, gate: Any, hidden: int) -> _Shared:
    """A shared expert module (gate_proj, up_proj, down_proj, SiLU) and its gate (a [1, hidden]
    matrix, or None), as ``_Shared``; ``_Unsupported`` for anything else."""
    g, u, d = _silu_mlp(expert)
    sg = None if gate is None else _host(gate)
    if sg is not None and (sg.out_features != 1 or sg.in_features != hidden):
        raise _Unsupported("shared expert gate")
    return _Shared(g, u, d, sg, Projections.of([g, u]))


def _biases(*linears: Any) -> np.ndarray:
    """The biases of ``linears`` (``HostLinear``) one after another, float32; empty where none
    has one (a zero bias for a matrix without one where another has)."""
    if all(lin.bias is None for lin in linears):
        return _NONE
    return np.concatenate([np.zeros(lin.out_features, np.float32) if lin.bias is None
                           else lin.bias.detach().float().numpy().reshape(-1) for lin in linears]).astype(np.float32)


def _host(module: Any) -> Any:
    from .linear import HostLinear

    if not isinstance(module, HostLinear):
        raise _Unsupported(f"projection {type(module).__name__}")
    return module


class FastDecode:
    """The decode steps of a CPU-only ``KtcModel`` of a family in ``FAMILIES``: ``step(token)``
    appends the token to the model's KV cache and returns the next token's logits.
    ``seconds`` accumulates the steps' time by part: each layer's, then the final norm and
    ``lm_head``'s (the embedding lookup and rotary tables are in neither); ``steps`` counts them."""

    def __init__(self, km: Any) -> None:
        from .linear import BundleEmbedding

        model = km.model
        inner = getattr(model, "model", None)
        config = model.config
        if inner is None or not isinstance(getattr(inner, "embed_tokens", None), BundleEmbedding):
            raise _Unsupported("embedding")
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            raise _Unsupported("soft-capped logits")
        self.embed = inner.embed_tokens
        self.head = _host(model.lm_head)
        self.rotary = getattr(inner, "rotary_emb", None)
        if self.rotary is None:
            raise _Unsupported("rotary embedding")
        # rope types whose cos and sin depend on the position alone (dynamic scaling and
        # longrope also look at the sequence length): those are kept by blocks of positions
        self._rotary_static = getattr(self.rotary, "rope_type", None) in ("default", "linear", "llama3", "yarn")
        self._half_rotary = config.model_type in HALF_ROTARY
        self._rotary_tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        hidden = int(config.hidden_size)
        self.norm = _norm(inner.norm, hidden)
        cache_layers = km.cache.layers
        experts = {e.layer: e for e in km.experts}
        self.layers = [self._layer(km, config, i, layer, cache_layers[i], experts.get(i), hidden)
                       for i, layer in enumerate(inner.layers)]
        self.hidden_size = hidden
        self.seconds = np.zeros(len(self.layers) + 1)
        # each layer's first attended position and the cycle counter's marks (_layers_token)
        self._marks = (np.zeros(len(self.layers), dtype=np.int64), np.zeros(len(self.layers) + 1, dtype=np.int64))
        self.steps = 0
        self.warmed = False  # warm ran (generate's first generation)
        self._every: tuple[list[Any], Any] | None = None  # (the MoE arguments it was built from, the list)
        self._mixed_types = False  # the layers' arguments did not go into one typed list
        # Called after a layer whose routing ran inside its compiled call, with (the next layer's
        # index, this layer's output through the next layer's post-attention norm, [1, hidden]):
        # the pre-gating prefetch's guess at the next layer's experts. With hooks the layers run
        # one call each instead of the whole stack in one.
        self.hooks: list[Callable[[int, np.ndarray], None]] = []
        cos, _ = self._rotary(0)
        # on each head's first values (all of them, or a part: GLM-4.5's half), in pairs
        if any(cos.shape[0] > layer.head_dim or cos.shape[0] % 2 for layer in self.layers) or \
                any(layer.latent is not None and cos.shape[0] != layer.latent.rope for layer in self.layers):
            raise _Unsupported("rotary embedding")

    @staticmethod
    def _layer(km: Any, config: Any, index: int, layer: Any, cache: Any, experts: Any, hidden: int) -> _Layer:
        import torch

        attn = layer.self_attn
        moe, dense, shared = FastDecode._mlp(km, index, layer.mlp, experts, hidden)
        buffer = getattr(cache, "key_buffer", None)
        if getattr(attn, "kv_lora_rank", None):
            return FastDecode._latent_layer(km.bundle, config, index, layer, cache, moe, dense, shared, hidden)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = int(attn.head_dim)
        if buffer is None or buffer.dtype != torch.float32 or (buffer.shape[1], buffer.shape[3]) != (kv_heads, head_dim):
            raise _Unsupported("KV cache")
        sinks = getattr(attn, "sinks", None)
        if heads % kv_heads or (sinks is not None and tuple(sinks.shape) != (heads,)):
            raise _Unsupported("attention")
        q_norm = getattr(attn, "q_norm", None)
        whole = q_norm is not None and tuple(q_norm.weight.shape) == (heads * head_dim,) and heads > 1
        q_norm = _norm(q_norm, heads * head_dim if whole else head_dim) if q_norm is not None else None
        k_norm = getattr(attn, "k_norm", None)
        k_norm = _norm(k_norm, kv_heads * head_dim if whole else head_dim) if k_norm is not None else None
        clip = getattr(config, "clip_qkv", None)
        window = getattr(config if FAMILIES[config.model_type] == "config" else attn, "sliding_window", None)
        q, k, v, o = (_host(getattr(attn, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        made = _Layer(_norm(layer.input_layernorm, hidden), q, k, v, o, q_norm, k_norm, whole,
                      None if clip is None else float(clip), heads, kv_heads, head_dim, float(attn.scaling),
                      int(window) if window else None, cache, cache.key_buffer[0].numpy(),
                      cache.value_buffer[0].numpy(), _norm(layer.post_attention_layernorm, hidden), moe,
                      dense, shared, _biases(q, k, v), _biases(o),
                      _NONE if sinks is None else np.ascontiguousarray(sinks.detach().float().numpy()))  # type: ignore[arg-type]
        made.compiled = _compiled_attention(made)
        made.ffn = _compiled_mlp(made)
        return made

    @staticmethod
    def _mlp(km: Any, index: int, mlp: Any, experts: Any, hidden: int) -> tuple[Any, Any, Any]:
        """A layer's (MoE block, dense MLP, shared expert), each None where it has none."""
        if experts is None:
            return None, _silu_mlp(mlp), None
        if getattr(mlp, "experts", None) is None or getattr(mlp.experts, "_ktc_experts", None) is not experts:
            raise _Unsupported("MoE block")
        shared = None
        if getattr(mlp, "shared_expert", None) is not None:  # Qwen2-MoE's, with its gate
            shared = _shared(mlp.shared_expert, getattr(mlp, "shared_expert_gate", None), hidden)
        elif getattr(mlp, "shared_experts", None) is not None:  # GLM-4.5's, DeepSeek-V3's: summed as they are
            shared = _shared(mlp.shared_experts, None, hidden)
        try:
            moe = MoELayer(km.bundle, index, experts=experts, shared=False)
        except UnsupportedModelError as error:  # a router ktc's MoE layer does not compute
            raise _Unsupported("router") from error
        return moe, None, shared

    @staticmethod
    def _latent_layer(bundle: Any, config: Any, index: int, layer: Any, cache: Any, moe: Any, dense: Any, shared: Any,
                      hidden: int) -> _Layer:
        """A layer of multi-head latent attention (``_Latent``)."""
        import torch

        attn = layer.self_attn
        heads, lora = int(config.num_attention_heads), int(attn.kv_lora_rank)
        nope, rope, v = int(attn.qk_nope_head_dim), int(attn.qk_rope_head_dim), int(attn.v_head_dim)
        keys, values = getattr(cache, "key_buffer", None), getattr(cache, "value_buffer", None)
        if keys is None or keys.dtype != torch.float32 or (keys.shape[1], keys.shape[3]) != (1, lora) or \
                (values.shape[1], values.shape[3]) != (1, rope):
            raise _Unsupported("KV cache")
        if getattr(attn, "q_lora_rank", None):
            q, q_a, q_b = None, _host(attn.q_a_proj), _host(attn.q_b_proj)
            q_norm = _norm(attn.q_a_layernorm, q_a.out_features)
        else:
            q, q_a, q_b, q_norm = _host(attn.q_proj), None, None, None
        kv_a, kv_b, o = _host(attn.kv_a_proj_with_mqa), _host(attn.kv_b_proj), _host(attn.o_proj)
        if (q_b or q).out_features != heads * (nope + rope) or kv_a.out_features != lora + rope or \
                kv_b.bias is not None or (kv_b.in_features, kv_b.out_features) != (lora, heads * (nope + v)):
            raise _Unsupported("attention")
        k_up, v_up = _stored_halves(bundle, index, heads, lora, nope, v)
        if k_up is None or v_up is None:
            up = decode(kv_b.raw, kv_b.scheme, lora).reshape(heads, nope + v, lora)
            k_up, v_up = (k_up or _float_spec(np.ascontiguousarray(up[:, :nope].transpose(0, 2, 1))),
                          v_up or _float_spec(np.ascontiguousarray(up[:, nope:])))
        pairs = 2 if config.model_type in PAIRED_ROTARY else int(bool(getattr(config, "rope_interleave", False)))
        latent = _Latent(q, q_a, q_norm, q_b, kv_a, _norm(attn.kv_a_layernorm, lora), k_up, v_up,
                         nope, rope, pairs, Projections.of([q_a or q, kv_a]))
        made = _Layer(_norm(layer.input_layernorm, hidden), None, None, None, o, None, None, False, None, heads, 1,
                      nope + rope, float(attn.scaling), None, cache, keys[0].numpy(), values[0].numpy(),
                      _norm(layer.post_attention_layernorm, hidden), moe, dense, shared, _NONE, _biases(o), _NONE,
                      latent)
        made.compiled = _compiled_latent(made)
        made.ffn = _compiled_mlp(made)
        return made

    def warm(self, experts: list[Any]) -> None:
        """One step on token 0, undone: a process's first call of the compiled step loads it
        from Numba's cache (a one-layer Qwen3-30B-A3B-shaped Q4_0 model: 930 ms, against 9-19 for
        the next steps), or compiles it on a first run (minutes), which ``ktc run`` would otherwise
        count as decode time (34 tokens/s reported for 48 tokens decoded at 136). ``generate``
        calls it before its first generation's timers; not at load, where a program that runs
        forwards only (``ktc perplexity``, ``ktc profile``, transformers' ``generate``) paid it
        for nothing: a DeepSeek-V3-shaped fp8 test model's forward, its kernels compiled afresh,
        took 144 s with it and 7.5 without. The caches are emptied again, the timers, the hooks and
        ``experts``' (the layers' ``ExpertSet``s) routing counts put back. A step the model
        refuses on token 0 (non-finite hidden states) is left to the first real one."""
        counts = [e.counts.copy() for e in experts]
        hooks, self.hooks = self.hooks, []  # the prefetcher's guesses are the real steps' alone
        try:
            self.step(0)
        except KtcError:
            pass
        finally:
            self.hooks = hooks
            for layer in self.layers:
                layer.cache.reset()
            for e, saved in zip(experts, counts):
                e.counts[:] = saved
            self.seconds[:] = 0
            self.steps = 0
            self.warmed = True

    def step(self, token: int) -> np.ndarray:
        """The logits (float32 [vocab]) after ``token``, whose keys and values go into the cache
        at the next position."""
        if not 0 <= token < self.embed.num_embeddings:
            raise IndexError(f"token id out of range 0..{self.embed.num_embeddings - 1}")
        position = self.layers[0].cache.length
        x = self.embed.rows(np.array([token], dtype=np.int64))[0]
        if self.embed.scale is not None:
            x = x * np.float32(self.embed.scale)
        cos, sin = self._rotary(position)
        seconds, clock = self.seconds, time.perf_counter
        at = clock()
        every = self._every_layer() if not self.hooks else None
        if every is not None:  # the whole stack in one compiled call
            x = self._layers_step(every, x, cos, sin, position, at)
            at = clock()
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x = self._layer_step(layer, x, cos, sin)
                # after a layer whose routing ran inside a compiled call (_moe_token, the layer's
                # or MoELayer.forward's; the others' experts call their observers, which guess too)
                if self.hooks and i < last and layer.moe is not None and layer.moe._one_call() is not None:
                    post = self.layers[i + 1].post_norm
                    guess_input = _rms_norm(x, post.weight, post.eps)[None, :]
                    for hook in self.hooks:
                        hook(i + 1, guess_input)
                now = clock()
                seconds[i] += now - at
                at = now
        logits = self.head.matvec(_rms_norm(x, self.norm.weight, self.norm.eps))
        seconds[-1] += clock() - at
        self.steps += 1
        return logits

    def _every_layer(self) -> Any:
        """Each layer's ``_moe_layer_token`` arguments (attention, MoE block) in a Numba typed
        list, or None where a layer does not take that one call (a dense MLP, shared experts,
        projections or experts outside the VNNI kernels) or the layers' arguments are not all of
        one type. Kept while every layer's MoE arguments stay the same objects: unboxing the
        list is one pointer, where a call a layer cost 30-50 us of Python each (among streaming
        weights that had evicted the interpreter from the caches; 3.6 us with it in them)."""
        if self._mixed_types:
            return None
        current = []
        for layer in self.layers:
            one_call = _moe_one_call(layer)
            # the stack's layers are _attention_token's
            if layer.compiled is None or one_call is None or layer.latent is not None:
                return None
            current.append(one_call)
        kept = self._every
        if kept is not None and all(a is b for a, b in zip(kept[0], current)):
            return kept[1]
        try:
            stack = _new_list((self.layers[0].compiled, current[0]))
            for layer, one_call in zip(self.layers[1:], current[1:]):
                _append(stack, (layer.compiled, one_call))
        except Exception:  # noqa: BLE001  - layers whose arguments differ in type: one call each
            self._mixed_types = True
            return None
        self._every = (current, stack)
        return stack

    def _layers_step(self, stack: Any, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, position: int,
                     started: float) -> np.ndarray:
        """Every layer's decode step in one call (``_layers_token``); each layer's time from the
        cycle counter's marks between them, as a share of the time since ``started`` (the Python
        around the call is the layers' too, as where each layer takes a call of its own)."""
        starts, marks = self._marks
        for i, layer in enumerate(self.layers):
            layer.cache.check_room(1)
            starts[i] = _window_start(layer, position)
        out = _layers_token(stack, x, cos, sin, position, starts, marks, vnni.stamps())
        if out.shape[0] == 0:
            raise KtcError("hidden states contain NaN or Inf")
        for layer in self.layers:
            layer.cache.advance(1)
        elapsed = time.perf_counter() - started
        # one compiled call for the shares: numpy's few small operations here took about 0.2 ms
        # a token inside a decode step (their code evicted from the caches by the weights)
        _add_shares(self.seconds, marks, elapsed)
        return out

    def _rotary(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of the rotary embedding at ``position``, from the model's rotary module:
        kept by blocks of positions where they depend on the position alone (the module's call
        took 0.4 ms, a fifth of a Qwen3-30B-A3B-shaped layer step beside its weights)."""
        import torch

        block, at = divmod(position, _ROTARY_BLOCK)
        table = self._rotary_tables.get(block) if self._rotary_static else None
        if table is None:
            first = block * _ROTARY_BLOCK if self._rotary_static else position
            count = _ROTARY_BLOCK if self._rotary_static else 1
            probe = torch.zeros((1, 1, self.hidden_size), dtype=torch.float32)
            positions = torch.arange(first, first + count).view(1, -1)
            with torch.inference_mode():
                made = self.rotary(probe, positions)
            if torch.is_tensor(made) and made.is_complex():  # PAIRED_ROTARY's factors
                cos, sin = made.real[0].float(), made.imag[0].float()
            else:
                cos, sin = made[0][0].float(), made[1][0].float()
            if self._half_rotary or torch.is_tensor(made):
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            table = (np.ascontiguousarray(cos.numpy()), np.ascontiguousarray(sin.numpy()))
            if not self._rotary_static:
                return table[0][0], table[1][0]
            self._rotary_tables[block] = table
        return table[0][at], table[1][at]

    @staticmethod
    def _layer_step(layer: _Layer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        if layer.compiled is not None:
            cache = layer.cache
            position = cache.length
            cache.check_room(1)
            start = _window_start(layer, position)
            out = _one_call_layer(layer, x, cos, sin, position, start)
            if out is not None:  # the whole layer in one compiled call
                if out.shape[0] == 0:
                    raise KtcError("hidden states contain NaN or Inf")
                cache.advance(1)
                return out
            if layer.latent is not None:
                x, h = _latent_token(*layer.compiled, x, cos, sin, position, start)
            else:
                x, h = _attention_token(*layer.compiled, x, cos, sin, position, start)
            cache.advance(1)
            return FastDecode._mlp_step(layer, x, h)
        if layer.latent is not None:
            return FastDecode._latent_step(layer, layer.latent, x, cos, sin)
        h = _rms_norm(x, layer.input_norm.weight, layer.input_norm.eps)
        q, k, v = layer.q.matvec(h), layer.k.matvec(h), layer.v.matvec(h)
        if layer.whole_norms:
            q = _rms_norm(q, layer.q_norm.weight, layer.q_norm.eps)  # type: ignore[union-attr]
            k = _rms_norm(k, layer.k_norm.weight, layer.k_norm.eps)  # type: ignore[union-attr]
        q = q.reshape(layer.heads, layer.head_dim)
        k = k.reshape(layer.kv_heads, layer.head_dim)
        v = v.reshape(layer.kv_heads, layer.head_dim)
        if layer.q_norm is not None and not layer.whole_norms:
            q = _rms_norm_rows(q, layer.q_norm.weight, layer.q_norm.eps)
        if layer.k_norm is not None and not layer.whole_norms:
            k = _rms_norm_rows(k, layer.k_norm.weight, layer.k_norm.eps)
        if layer.clip is not None:
            for part in (q, k, v):
                np.clip(part, -layer.clip, layer.clip, out=part)
        cache = layer.cache
        position = cache.length
        cache.check_room(1)
        _rope_into(q, k, v, cos, sin, layer.keys, layer.values, position)
        cache.advance(1)
        start = _window_start(layer, position)
        attended = _attend(q, layer.keys, layer.values, start, position + 1, np.float32(layer.scaling), layer.sinks,
                           _NO_MORE, _NO_MORE_KEYS)
        x = x + layer.o.matvec(attended)
        return FastDecode._mlp_step(layer, x, _rms_norm(x, layer.post_norm.weight, layer.post_norm.eps))

    @staticmethod
    def _latent_step(layer: _Layer, latent: _Latent, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """A layer of multi-head latent attention, then its MLP or MoE block."""
        h = _rms_norm(x, layer.input_norm.weight, layer.input_norm.eps)
        if latent.first is not None:  # the query's (or its compression's) and kv_a's products in one call
            q, kv = latent.first.split(latent.first(h))
        else:
            q, kv = (latent.q or latent.q_a).matvec(h), latent.kv_a.matvec(h)
        if latent.q_b is not None:
            q = latent.q_b.matvec(_rms_norm(q, latent.q_norm.weight, latent.q_norm.eps))  # type: ignore[union-attr]
        cache = layer.cache
        position = cache.length
        cache.check_room(1)
        attended = _latent_attention(q.reshape(layer.heads, -1), kv, latent.kv_norm.weight, latent.kv_norm.eps,
                                     latent.k_up, latent.v_up, *vnni._tables(), cos, sin, latent.pairs,
                                     layer.keys, layer.values,
                                     position, _window_start(layer, position), np.float32(layer.scaling))
        cache.advance(1)
        x = x + layer.o.matvec(attended)
        return FastDecode._mlp_step(layer, x, _rms_norm(x, layer.post_norm.weight, layer.post_norm.eps))

    @staticmethod
    def _mlp_step(layer: _Layer, x: np.ndarray, h: np.ndarray) -> np.ndarray:
        """x plus the layer's MoE block (and its shared expert) or MLP of h (x after the
        post-attention norm)."""
        if layer.moe is not None:
            y = layer.moe.forward(h[None, :])[0]
            if layer.shared is not None:
                y = y + _shared_expert(layer.shared, h)
            return x + y
        gate, up, down = layer.mlp  # type: ignore[misc]
        return x + down.matvec(_silu_times(gate.matvec(h), up.matvec(h)))


def _shared_expert(shared: _Shared, h: np.ndarray) -> np.ndarray:
    """The shared expert's output for h, times its gate's sigmoid where it has one."""
    if shared.first is not None:  # gate and up in one call
        gate, up = shared.first.split(shared.first(h))
    else:
        gate, up = shared.gate.matvec(h), shared.up.matvec(h)
    y = shared.down.matvec(_silu_times(gate, up))
    if shared.shared_gate is not None:
        y *= np.float32(1.0) / (np.float32(1.0) + np.exp(-shared.shared_gate.matvec(h)[0]))
    return y


def _window_start(layer: _Layer, position: int) -> int:
    """The first cache position the query at ``position`` attends to (its sliding window)."""
    return max(0, position + 1 - layer.window) if layer.window else 0


def _moe_one_call(layer: _Layer) -> tuple | None:  # type: ignore[type-arg]
    """The layer's MoE block's ``_moe_token`` arguments where its decode step takes that one
    call (no shared experts), else None."""
    moe = layer.moe
    return moe._one_call() if moe is not None and moe.shared is None and layer.shared is None else None


def _one_call_layer(layer: _Layer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, position: int,
                    start: int) -> np.ndarray | None:
    """The layer's step in one compiled call, or None where it does not take one (its attention
    half compiled, ``layer.compiled``, and its MoE block in one call, ``MoELayer._one_call``,
    its dense MLP or shared expert, ``layer.ffn``, where it has one): the output, empty where a
    hidden state is not finite."""
    moe = layer.moe._one_call() if layer.moe is not None else None
    if layer.moe is not None and moe is None:  # its experts outside the one call
        return None
    if (layer.moe is None or layer.shared is not None) and layer.ffn is None:  # its MLP outside it
        return None
    stamps = vnni.stamps()
    latent = layer.latent is not None
    attention = layer.compiled
    if moe is None:  # a dense layer
        return (_latent_mlp_token if latent else _attention_mlp_token)(attention, layer.ffn, x, cos, sin, position,
                                                                       start)
    if layer.shared is not None:
        return (_latent_shared_token if latent else _attention_shared_token)(attention, moe, layer.ffn, x, cos, sin,
                                                                             position, start, stamps)
    return (_latent_moe_token if latent else _moe_layer_token)(attention, moe, x, cos, sin, position, start, stamps)


def _parts(p: Projections) -> tuple:  # type: ignore[type-arg]
    """A ``Projections``' arrays as ``stack_token`` takes them."""
    return p.mats, p.f32s, p.kinds, p.starts, p.chunk_starts


def _compiled_mlp(layer: _Layer) -> tuple | None:  # type: ignore[type-arg]
    """``_mlp_token``'s arguments (but the input) for the layer's dense MLP or shared expert, or
    None where it has neither or one call does not take its matrices (``Projections``)."""
    from .vnni import _tables

    if layer.shared is not None:
        gate, up, down, shared_gate = layer.shared.gate, layer.shared.up, layer.shared.down, layer.shared.shared_gate
    elif layer.mlp is not None:
        (gate, up, down), shared_gate = layer.mlp, None
    else:
        return None
    first, second = Projections.of([gate, up]), Projections.of([down])
    if first is None or second is None:
        return None
    gate_row = _NONE
    if shared_gate is not None:  # one row (Qwen2-MoE's), kept in a float scheme: its values
        if shared_gate.scheme not in ("f32", "bf16", "f16") or shared_gate.bias is not None:
            return None
        gate_row = read_only(decode(shared_gate.raw, shared_gate.scheme, shared_gate.in_features)[0].copy())
    return (*_parts(first), *_parts(second), gate_row, *_tables())


def _compiled_latent(layer: _Layer) -> tuple | None:  # type: ignore[type-arg]
    """``_latent_token``'s arguments (but the hidden state, the rotary cos/sin and the
    positions), or None where its projections are not one call's (``Projections``)."""
    from .vnni import _tables

    latent = layer.latent
    assert latent is not None
    query = latent.q or latent.q_a
    first = Projections.of([query, latent.kv_a], biases_apart=True)
    second = Projections.of([latent.q_b], biases_apart=True) if latent.q_b is not None else first
    o = Projections.of([layer.o], biases_apart=True)
    if first is None or second is None or o is None:
        return None
    q_norm = latent.q_norm or _Norm(_NO_NORM, np.float32(0.0))
    q_b_bias = _biases(latent.q_b) if latent.q_b is not None else _NONE
    return (layer.input_norm.weight, np.float32(layer.input_norm.eps), *_parts(first),
            _biases(query, latent.kv_a), latent.q_b is not None, *_parts(second), q_norm.weight,
            np.float32(q_norm.eps), q_b_bias, latent.kv_norm.weight, np.float32(latent.kv_norm.eps), latent.k_up,
            latent.v_up, latent.pairs, layer.keys, layer.values, np.float32(layer.scaling), *_parts(o), layer.o_bias,
            *_tables(), layer.heads, layer.post_norm.weight, np.float32(layer.post_norm.eps))


_NO_NORM = np.ones(1, dtype=np.float32)


def _compiled_attention(layer: _Layer) -> tuple | None:  # type: ignore[type-arg]
    """``_attention_token``'s arguments for ``layer`` (but the hidden state, the rotary cos/sin
    and the positions), or None where its projections are not one call's (``Projections``)."""
    from .vnni import _tables

    qkv = Projections.of([layer.q, layer.k, layer.v], biases_apart=True)  # the step adds them
    o = Projections.of([layer.o], biases_apart=True)
    if qkv is None or o is None:
        return None
    f16, e8m0 = _tables()
    norm_mode = 0 if layer.q_norm is None else 2 if layer.whole_norms else 1
    q_norm = layer.q_norm or _Norm(_NO_NORM, np.float32(0.0))
    k_norm = layer.k_norm or _Norm(_NO_NORM, np.float32(0.0))

    return (layer.input_norm.weight, np.float32(layer.input_norm.eps), *_parts(qkv), *_parts(o), f16, e8m0,
            layer.heads, layer.kv_heads, layer.head_dim, norm_mode, q_norm.weight, np.float32(q_norm.eps),
            k_norm.weight, np.float32(k_norm.eps), layer.clip is not None, np.float32(layer.clip or 0.0), layer.keys,
            layer.values, np.float32(layer.scaling), layer.sinks, layer.qkv_bias, layer.o_bias, layer.post_norm.weight,
            np.float32(layer.post_norm.eps))


@njit(cache=True, nogil=True)
def _attention_token(in_w, in_eps, qkv_mats, qkv_f32s, qkv_kinds, qkv_starts, qkv_chunks, o_mats, o_f32s, o_kinds,
                     o_starts, o_chunks, f16, e8m0, heads, kv_heads, head_dim, norm_mode, q_w, q_eps, k_w, k_eps,
                     clipped, clip, keys, values, scaling, sinks, qkv_bias, o_bias, post_w, post_eps, x, cos, sin,
                     position, start):  # pragma: no cover - compiled
    # The attention half of a decode step in one call (``FastDecode._layer_step``'s steps, the
    # projections each set in one parallel region): returns x plus attention, and it after the
    # post-attention norm. norm_mode: 0 no query/key norms, 1 per head, 2 over all heads.
    # qkv_bias, o_bias, sinks: empty where the model has none.
    h = _rms_norm(x, in_w, in_eps)
    qkv = stack_token(qkv_mats, qkv_f32s, qkv_kinds, qkv_starts, qkv_chunks, f16, e8m0, h)
    if qkv_bias.shape[0]:
        qkv += qkv_bias
    nq, nk = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
    if norm_mode == 2:
        q, k = _rms_norm(q, q_w, q_eps), _rms_norm(k, k_w, k_eps)
    q2, k2, v2 = q.reshape(heads, head_dim), k.reshape(kv_heads, head_dim), v.reshape(kv_heads, head_dim)
    if norm_mode == 1:
        q2, k2 = _rms_norm_rows(q2, q_w, q_eps), _rms_norm_rows(k2, k_w, k_eps)
    if clipped:
        for part in (q2, k2, v2):
            for r in range(part.shape[0]):
                for j in range(part.shape[1]):
                    part[r, j] = min(max(part[r, j], -clip), clip)
    _rope_into(q2, k2, v2, cos, sin, keys, values, position)
    attended = _attend(q2, keys, values, start, position + 1, scaling, sinks, _NO_MORE, _NO_MORE_KEYS)
    projected = stack_token(o_mats, o_f32s, o_kinds, o_starts, o_chunks, f16, e8m0, attended)
    if o_bias.shape[0]:
        projected += o_bias
    out = x + projected
    return out, _rms_norm(out, post_w, post_eps)


@njit(cache=True, nogil=True)
def _moe_layer_token(attention, moe, x, cos, sin, position, start, stamps):  # pragma: no cover - compiled
    # A MoE layer's decode step in one call: _attention_token, then moe._moe_token (routing and
    # the chosen experts) on its output; empty when the hidden state is not finite. The Python
    # between two calls ran among streaming weights that had evicted it from the caches.
    return _with_moe(*_attention_token(*attention, x, cos, sin, position, start), moe, stamps)


@njit(cache=True, nogil=True)
def _latent_token(in_w, in_eps, f_mats, f_f32s, f_kinds, f_starts, f_chunks, f_bias, compressed, b_mats, b_f32s,
                  b_kinds, b_starts, b_chunks, q_w, q_eps, b_bias, kv_w, kv_eps, k_up, v_up, pairs, latents, rotated,
                  scaling, o_mats, o_f32s, o_kinds, o_starts, o_chunks, o_bias, f16, e8m0, heads, post_w, post_eps, x,
                  cos, sin, position, start):  # pragma: no cover - compiled
    # The attention half of a latent attention layer's decode step in one call
    # (FastDecode._latent_step's steps): the query (or its compression) and kv_a in one parallel
    # region, the compression's norm and q_b, _latent_attention, the output projection; returns
    # x plus attention, and it after the post-attention norm. f_bias, b_bias, o_bias: empty where
    # none.
    h = _rms_norm(x, in_w, in_eps)
    first = stack_token(f_mats, f_f32s, f_kinds, f_starts, f_chunks, f16, e8m0, h)
    if f_bias.shape[0]:
        first += f_bias
    q = first[:f_starts[1]]
    if compressed:
        q = stack_token(b_mats, b_f32s, b_kinds, b_starts, b_chunks, f16, e8m0, _rms_norm(q, q_w, q_eps))
        if b_bias.shape[0]:
            q += b_bias
    q = np.ascontiguousarray(q)
    values = _latent_attention(q.reshape(heads, q.shape[0] // heads), first[f_starts[1]:f_starts[2]], kv_w, kv_eps,
                               k_up, v_up, f16, e8m0, cos, sin, pairs, latents, rotated, position, start,
                               scaling)
    projected = stack_token(o_mats, o_f32s, o_kinds, o_starts, o_chunks, f16, e8m0, values)
    if o_bias.shape[0]:
        projected += o_bias
    out = x + projected
    return out, _rms_norm(out, post_w, post_eps)


@njit(cache=True, nogil=True)
def _mlp_token(a_mats, a_f32s, a_kinds, a_starts, a_chunks, d_mats, d_f32s, d_kinds, d_starts, d_chunks, gate_row,
               f16, e8m0, h):  # pragma: no cover - compiled
    # A SiLU MLP of h (a dense layer's, a shared expert's): gate and up in one parallel region,
    # SiLU(gate) * up, down; times the sigmoid of gate_row . h where it is not empty (Qwen2-MoE's
    # shared expert's one-row gate).
    both = stack_token(a_mats, a_f32s, a_kinds, a_starts, a_chunks, f16, e8m0, h)
    y = stack_token(d_mats, d_f32s, d_kinds, d_starts, d_chunks, f16, e8m0,
                    _silu_times(both[:a_starts[1]], both[a_starts[1]:a_starts[2]]))
    if gate_row.shape[0]:
        g = np.float32(0.0)
        for j in range(h.shape[0]):
            g += gate_row[j] * h[j]
        y *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
    return y


# A layer's one call is its attention half's function (_attention_token or _latent_token) and
# then what follows it (_with_moe, _with_shared or _with_mlp): a wrapper for each pair, as the
# compiled steps do not take functions as arguments (_moe_layer_token is the first pair).


@njit(cache=True, nogil=True)
def _with_moe(out, h, moe, stamps):  # pragma: no cover - compiled
    # out plus the routed experts' output for h; empty where h is not finite
    y = _moe_token(*moe, h, stamps)
    if y.shape[0] == 0:
        return y
    return out + y


@njit(cache=True, nogil=True)
def _with_shared(out, h, moe, mlp, stamps):  # pragma: no cover - compiled
    # the same and the shared expert's output
    y = _with_moe(out, h, moe, stamps)
    return y if y.shape[0] == 0 else y + _mlp_token(*mlp, h)


@njit(cache=True, nogil=True)
def _with_mlp(out, h, mlp):  # pragma: no cover - compiled
    # out plus a dense layer's MLP of h; empty where that is not finite
    return _finite(out + _mlp_token(*mlp, h))


@njit(cache=True, nogil=True)
def _attention_shared_token(attention, moe, mlp, x, cos, sin, position, start, stamps):  # pragma: no cover - compiled
    return _with_shared(*_attention_token(*attention, x, cos, sin, position, start), moe, mlp, stamps)


@njit(cache=True, nogil=True)
def _attention_mlp_token(attention, mlp, x, cos, sin, position, start):  # pragma: no cover - compiled
    return _with_mlp(*_attention_token(*attention, x, cos, sin, position, start), mlp)


@njit(cache=True, nogil=True)
def _latent_moe_token(attention, moe, x, cos, sin, position, start, stamps):  # pragma: no cover - compiled
    return _with_moe(*_latent_token(*attention, x, cos, sin, position, start), moe, stamps)


@njit(cache=True, nogil=True)
def _latent_shared_token(attention, moe, mlp, x, cos, sin, position, start, stamps):  # pragma: no cover - compiled
    return _with_shared(*_latent_token(*attention, x, cos, sin, position, start), moe, mlp, stamps)


@njit(cache=True, nogil=True)
def _latent_mlp_token(attention, mlp, x, cos, sin, position, start):  # pragma: no cover - compiled
    return _with_mlp(*_latent_token(*attention, x, cos, sin, position, start), mlp)


@njit(cache=True, nogil=True)
def _finite(x):  # pragma: no cover - compiled
    # x, or an empty array where a value of it is not finite (as _moe_token answers)
    for j in range(x.shape[0]):
        if not np.isfinite(x[j]):
            return np.empty(0, dtype=np.float32)
    return x


@njit(cache=True, nogil=True)
def _layers_token(stack, x, cos, sin, position, starts, marks, stamps):  # pragma: no cover - compiled
    # Every layer's _moe_layer_token in turn (``stack``: FastDecode._every_layer), the cycle
    # counter read before the first and after each into ``marks``; empty as soon as a hidden
    # state is not finite.
    marks[0] = vnni._cycles()
    for i in range(len(stack)):
        attention, moe = stack[i]
        x = _moe_layer_token(attention, moe, x, cos, sin, position, starts[i], stamps)
        if x.shape[0] == 0:
            return x
        marks[i + 1] = vnni._cycles()
    return x


@njit(cache=True, nogil=True)
def _new_list(first):  # pragma: no cover - compiled
    # A typed list of ``first`` (a layer's arguments), compiled and cached: a typed list filled
    # from Python compiles its methods for the item type in every process (1.9 s of each
    # ``ktc run``'s start). An item at a time (_append): a function taking every layer's
    # arguments as one tuple compiled for over 14 minutes for 48 layers.
    stack = typed.List()
    stack.append(first)
    return stack


@njit(cache=True, nogil=True)
def _append(stack, item):  # pragma: no cover - compiled
    # stack.append(item), compiled and cached (_new_list); an item of another type is refused
    stack.append(item)


@njit(cache=True, nogil=True)
def _add_shares(seconds, marks, elapsed):  # pragma: no cover - compiled
    # seconds[i] += layer i's share of ``elapsed``: its span between marks i and i + 1.
    total = max(marks[-1] - marks[0], 1)
    for i in range(marks.shape[0] - 1):
        seconds[i] += elapsed * (marks[i + 1] - marks[i]) / total


@njit(cache=True, nogil=True)
def _rms_norm(x, weight, eps):  # pragma: no cover - compiled
    # weight * (x / sqrt(mean(x^2) + eps)), as transformers' RMSNorm computes it in float32
    total = 0.0
    for j in range(x.shape[0]):
        total += np.float64(x[j]) * x[j]
    inverse = np.float32(1.0 / np.sqrt(np.float32(total / x.shape[0]) + eps))
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = weight[j] * (x[j] * inverse)
    return out


@njit(cache=True, nogil=True)
def _rms_norm_rows(x, weight, eps):  # pragma: no cover - compiled
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        out[r] = _rms_norm(x[r], weight, eps)
    return out


@njit(cache=True, nogil=True)
def _rope_into(q, k, v, cos, sin, keys, values, position):  # pragma: no cover - compiled
    # The rotary embedding (rotate-half over the first R = len(cos) values of a head: value j
    # pairs with j + R/2; R is D, or a part of it, the rest left as it is) on q in place and on
    # k, then k and v into the cache at ``position`` (keys, values: [kv heads, capacity, D]).
    half = cos.shape[0] // 2
    for r in range(q.shape[0]):
        for j in range(half):
            a, b = q[r, j], q[r, j + half]
            q[r, j] = a * cos[j] - b * sin[j]
            q[r, j + half] = b * cos[j + half] + a * sin[j + half]
    for r in range(k.shape[0]):
        for j in range(half):
            a, b = k[r, j], k[r, j + half]
            keys[r, position, j] = a * cos[j] - b * sin[j]
            keys[r, position, j + half] = b * cos[j + half] + a * sin[j + half]
        for j in range(2 * half, k.shape[1]):
            keys[r, position, j] = k[r, j]
        for j in range(v.shape[1]):
            values[r, position, j] = v[r, j]


@njit(cache=True, nogil=True)
def _latent_attention(q, kv, kv_w, kv_eps, k_up, v_up, f16, e8m0, cos, sin, pairs, latents, rotated, position,
                      start, scaling):  # pragma: no cover - compiled
    # The absorbed multi-head latent attention of one token (_Latent): q [heads, nope + rope]
    # its query, kv kv_a's output (the latent, then the rotary key); the normed latent into
    # ``latents`` and the turned rotary key into ``rotated`` ([1, capacity, lora or rope]) at
    # ``position``; returns each head's values [heads * v]. pairs: _Latent.pairs.
    heads, width = q.shape
    lora, nope = k_up[6], k_up[7]
    rope = width - nope
    latents[0, position] = _rms_norm(kv[:lora], kv_w, kv_eps)
    q_rot = np.empty((heads, rope), np.float32)
    k_rot = np.empty((1, rope), np.float32)
    for r in range(heads):
        _rotary_order(q[r, nope:], q_rot[r], pairs != 0)
    _rotary_order(kv[lora:], k_rot[0], pairs != 0)
    if pairs == 2:  # turned as halves, then each pair back in its place, where the cache keeps it
        turned = np.empty((1, 1, rope), np.float32)
        _rope_into(q_rot, k_rot, _NO_MORE, cos, sin, turned, turned, 0)
        for r in range(heads):
            _in_pairs(q_rot[r].copy(), q_rot[r])
        _in_pairs(turned[0, 0], rotated[0, position])
    else:
        _rope_into(q_rot, k_rot, _NO_MORE, cos, sin, rotated, rotated, position)
    absorbed = _per_head(*k_up, f16, e8m0, q)  # each head's query in the latent's space
    attended = _attend(absorbed, latents, latents, start, position + 1, scaling, _NONE, q_rot, rotated)
    return _per_head(*v_up, f16, e8m0, attended.reshape(heads, lora)).reshape(-1)


@njit(cache=True, nogil=True)
def _in_pairs(source, target):  # pragma: no cover - compiled
    # _rotary_order's inverse: the first half's values to the even places, the second's to the odd
    half = source.shape[0] // 2
    for j in range(half):
        target[2 * j] = source[j]
        target[2 * j + 1] = source[half + j]


@njit(cache=True, nogil=True)
def _rotary_order(source, target, interleave):  # pragma: no cover - compiled
    # source into target in rotate-half order: where the rotary pairs are neighbours
    # (DeepSeek-V3's rope_interleave, DeepSeek-V2's), the evens first, then the odds
    half = target.shape[0] // 2
    for j in range(half):
        target[j] = source[2 * j] if interleave else source[j]
        target[half + j] = source[2 * j + 1] if interleave else source[half + j]


_NO_ROWS = read_only(np.zeros((1, 4), np.uint8))  # a float spec's stored rows (none)
_NO_FLOATS = read_only(np.zeros((0, 0, 0), np.uint8))  # a stored spec's float values (none)
_F32, _BF16 = -1, -2  # _per_head's codes of float values


def _float_spec(w: np.ndarray) -> tuple:  # type: ignore[type-arg]
    """``_per_head``'s spec of float values w [heads, rows, cols]: bf16 bit patterns (half the
    bytes, the same products) where every value is one and its rows are whole steps of
    ``vnni.bf16_dot`` (which runs compiled), else float32; as bytes, so that every spec is one
    Numba type (each type compiles the latent attention's step again: about 30 s)."""
    code = _F32
    if vnni._COMPILED and w.shape[-1] % 16 == 0:
        w = exact_bf16(w)
        code = _BF16 if w.dtype == np.uint16 else _F32
    heads, rows_, cols = w.shape
    return (code, _NO_ROWS, _NO_ROWS.reshape(-1).view(np.float32), 0, 0, 0, rows_, cols,
            read_only(np.ascontiguousarray(w).view(np.uint8).reshape(heads, rows_, -1)))


def _stored_halves(bundle: Any, layer: int, heads: int, lora: int, nope: int, v: int) -> tuple[Any, Any]:
    """``_per_head``'s specs of a GGUF's ``blk.N.attn_k_b`` ([heads * lora rows, nope]) and
    ``attn_v_b`` ([heads * v rows, lora]) where the bundle keeps them in a block scheme or a
    K-quant (on a VNNI CPU, the scheme's row kernels), each None where not."""
    from ktc.formats.schemes import get_scheme

    specs = []
    for half, per_head, cols in (("k", lora, nope), ("v", v, lora)):
        name = bundle.by_source.get(f"blk.{layer}.attn_{half}_b.weight")
        t = bundle.tensors.get(name) if name else None
        scheme = t.scheme if t is not None else None
        if t is None or not vnni.HAVE_VNNI or not (scheme in vnni.BLOCK_KINDS and cols % 32 == 0 or
                                                   scheme in vnni.KQUANTS and cols % 256 == 0) or \
                int(np.prod(t.shape)) != heads * per_head * cols:
            specs.append(None)
            continue
        row_bytes = get_scheme(scheme).matrix_bytes(1, cols)
        raw = read_only(np.ascontiguousarray(bundle.tensor(name)).view(np.uint8).reshape(heads * per_head, row_bytes))
        specs.append((rows.kind(scheme), raw, raw.reshape(-1)[:4].view(np.float32), row_bytes, 0, per_head,
                      per_head, cols, _NO_FLOATS))
    return specs[0], specs[1]


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _per_head(code, raw, f32, row_bytes, base, stride, per_head, cols, w, f16, e8m0, x):  # pragma: no cover - compiled
    # Each head's own matrix-vector product, [heads, per_head]: out[h, r] = row r of head h's
    # matrix . x[h, :cols]. code _F32 or _BF16: the matrices are w [heads, per_head, bytes of
    # cols values] (_float_spec); else stored rows of that kind (rows.rows), head h's rows from
    # row base + h * stride of raw (row_bytes each; f32: its float32 view), x's rows quantized
    # for the kind first.
    heads = x.shape[0]
    out = np.empty((heads, per_head), np.float32)
    if code < 0:
        for h in prange(heads):
            xh = np.ascontiguousarray(x[h, :cols])
            for r in range(per_head):
                if code == _BF16:  # 16 bf16 values a step, widened exactly
                    out[h, r] = vnni.bf16_dot(w[h, r].view(np.uint16), 0, cols // 16, xh)
                    continue
                row = w[h, r].view(np.float32)
                d = np.float32(0.0)
                for j in range(cols):
                    d += row[j] * xh[j]
                out[h, r] = d
        return out
    xs = np.empty((heads, cols), np.float32)
    for h in range(heads):
        xs[h] = x[h, :cols]
    act = rows.activations(xs.reshape(-1), heads, cols, np.array([code], dtype=np.int64))
    chunks = (per_head + rows.ROWS_PER_ITEM - 1) // rows.ROWS_PER_ITEM
    flat = raw.reshape(-1)
    for item in prange(heads * chunks):
        h = item // chunks
        first = (item - h * chunks) * rows.ROWS_PER_ITEM
        acc = np.zeros(16, np.float32)
        rows.rows(code, flat, f32, f16, e8m0, (base + h * stride) * row_bytes, row_bytes, first,
                  min(per_head, first + rows.ROWS_PER_ITEM), cols, act, h, out[h], acc)
    return out


_ATTEND_SPAN = 256  # cache positions a work item of _attend
_ATTEND_ITEMS = 16  # work items _attend makes at least, where its query heads allow
_LOG2E = np.float32(1.4426950408889634)  # exp(x) = 2^(x * _LOG2E)
_TILE_HEADS = 4  # query heads _dots multiplies at a time (its four accumulators a position)


@njit(cache=True, nogil=True)
def _heads_an_item(group, spans):  # pragma: no cover - compiled
    """The query heads of a key head's span that one of ``_attend``'s work items takes: as many as
    make ``_ATTEND_ITEMS`` items where the spans are fewer, rounded up to whole tiles of
    ``_TILE_HEADS`` (``_qk_tile``, ``_pv_tile``; a group's last part may be short). Not rounded,
    Qwen3-30B-A3B's 8 query heads a key head at 513-768 positions (12 spans) took items of 6 and
    2 heads, each item's last tile computing two heads again: ``_attend`` at 528 positions from
    the caches 90.7 against 71.1 us, after a 64 MB read 237 against 211 (two threads, medians of
    31 calls in rotated order)."""
    per = min(max(_TILE_HEADS, (group * spans + _ATTEND_ITEMS - 1) // _ATTEND_ITEMS), group)
    return (per + _TILE_HEADS - 1) // _TILE_HEADS * _TILE_HEADS


@njit(cache=True, nogil=True, parallel=True, fastmath=True, error_model="numpy")
def _attend(q, keys, values, start, end, scaling, sinks, q_more, keys_more):  # pragma: no cover - compiled
    # softmax(q K^T * scaling) V over cache positions start..end-1, each query head h with key
    # head h // (heads / kv heads), as transformers' repeat_kv pairs them; [heads * D]. With
    # sinks (one a query head; empty: none), head h's softmax also takes sinks[h] as a logit
    # whose value is nothing (gpt-oss's attention). q_more [heads, R] and keys_more [kv heads,
    # capacity, R]: a second part of each query and key, kept apart (R = 0: none): the absorbed
    # latent attention's rotary part, whose keys the cache keeps beside the latent (_Latent).
    #
    # A work item is a key head's span of _ATTEND_SPAN positions for all the query heads that
    # share it: each key and value row is read once for the group (a query head at a time read
    # them once a head: at 4096 positions a key head's 4 MB of keys and values, eight times over,
    # from L3), and the spans of one head run on both threads; each item keeps its span's
    # largest score and sum, and the spans are combined after (the flash-decoding split). The
    # spans are fixed by the positions, not the threads: the same result however the items are
    # shared. Qwen3-30B-A3B's shape (32 query heads, 4 key heads, 128 values), two threads,
    # from the caches: 96 positions 37.5 against 44.4 us, 1024 301 against 397, 4096 1175
    # against 2917. Where the spans are fewer than _ATTEND_ITEMS (the latent attention's one key
    # head before _ATTEND_SPAN positions ran on one thread), a span's query heads are parted
    # among items too, a multiple of _TILE_HEADS an item: a head's sums do not depend on which item
    # computes it, so the result stays the same. (The items are not counted from Numba's
    # threads: get_num_threads inside a function keeps Numba from caching it.) The softmax's
    # exponentials are vnni's polynomial (relative error about 2e-7; 2^-126 for a score more than
    # 87 below its span's largest, whose own term is 1), in a loop LLVM vectorizes (np.exp was a
    # library call a score). Two threads, 15 interleaved rounds from the caches: Qwen3-30B-A3B's
    # shape (32 heads, 4 key heads, 128 values) 1.11x as fast at 64 positions, 1.21-1.22x at
    # 512-4096; 64 heads 1.13-1.22x; the latent attention (one key head, 576 values) 1.02-1.05x.
    heads, dim = q.shape
    kv = keys.shape[0]
    group = heads // kv
    dv = values.shape[2]
    more = q_more.shape[1]
    chunks = (end - start + _ATTEND_SPAN - 1) // _ATTEND_SPAN
    spans = kv * chunks
    per = _heads_an_item(group, spans)
    parts = (group + per - 1) // per
    tops = np.empty((spans, group), np.float32)
    sums = np.empty((spans, group), np.float32)
    acc = np.zeros((spans, group, dv), np.float32)
    for it in prange(spans * parts):
        span = it // parts
        h0 = (it - span * parts) * per
        h1 = min(group, h0 + per)
        g = span // chunks
        t0 = start + (span - g * chunks) * _ATTEND_SPAN
        t1 = min(end, t0 + _ATTEND_SPAN)
        first = g * group
        scores = np.zeros((h1 - h0, t1 - t0), np.float32)
        _dots(q[first + h0:first + h1], keys[g], t0, t1, scores)
        if more:
            _dots(q_more[first + h0:first + h1], keys_more[g], t0, t1, scores)
        for i in range(h0, h1):
            row = scores[i - h0]
            top = row[0] * scaling
            for u in range(t1 - t0):
                row[u] *= scaling
                top = max(top, row[u])
            total = np.float32(0.0)
            for u in range(t1 - t0):
                e = vnni._exp2_neg((row[u] - top) * _LOG2E)
                row[u] = e
                total += e
            tops[span, i] = top
            sums[span, i] = total
        _weighted_rows(scores, values[g], t0, t1, acc[span, h0:h1])
    out = np.zeros((heads, dv), np.float32)
    for g in range(kv):
        for i in range(group):
            top = tops[g * chunks, i]
            for c in range(1, chunks):
                top = max(top, tops[g * chunks + c, i])
            total = np.float32(0.0)
            if sinks.shape[0]:
                sink = sinks[g * group + i]
                top = max(top, sink)
                total = np.exp(sink - top)
            for c in range(chunks):
                total += sums[g * chunks + c, i] * np.exp(tops[g * chunks + c, i] - top)
            oh = out[g * group + i]
            for c in range(chunks):
                f = np.exp(tops[g * chunks + c, i] - top) / total
                ac = acc[g * chunks + c, i]
                for j in range(dv):
                    oh[j] += f * ac[j]
    return out.reshape(-1)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _dots(qs, keys, t0, t1, out):  # pragma: no cover - compiled
    # out[i, t - t0] += qs[i] . keys[t] for positions t0..t1-1: four query heads by two positions
    # a step (eight sums, each key's and query's values loaded once for them), the last step's
    # missing heads and position read again and not stored. A head by a position at a time, each
    # dot product's loads (two for a product) bounded it: 16 heads of 512 values by 64
    # positions took 32 us on one thread, 14.5 this way. Where the rows are whole 16-value
    # vectors, ``_qk_tile``'s four heads by four positions (8 heads by 256 positions of 128
    # values: 8.7 -> 6.8 us).
    heads, dim = qs.shape
    if vnni._COMPILED and dim % 16 == 0 and qs.strides[1] == 4 and keys.strides[1] == 4 and out.strides[1] == 4:
        # four heads by four positions a step (``_qk_tile``)
        for t in range(t0, t1, 4):
            u = t - t0
            for i in range(0, heads, 4):
                _qk_tile(qs, qs.strides[0] // 4, i, heads, keys, keys.strides[0] // 4, t, t1, dim, out,
                         out.strides[0] // 4, u)
        return
    last = heads - 1
    for t in range(t0, t1, 2):
        ka, kb = keys[t], keys[min(t + 1, t1 - 1)]
        u = t - t0
        for i in range(0, heads, _TILE_HEADS):
            q0, q1, q2, q3 = qs[i], qs[min(i + 1, last)], qs[min(i + 2, last)], qs[min(i + 3, last)]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for j in range(dim):
                x, y = ka[j], kb[j]
                a0 += q0[j] * x
                a1 += q1[j] * x
                a2 += q2[j] * x
                a3 += q3[j] * x
                b0 += q0[j] * y
                b1 += q1[j] * y
                b2 += q2[j] * y
                b3 += q3[j] * y
            for c, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
                if i + c <= last:
                    out[i + c, u] += a
                    if t + 1 < t1:
                        out[i + c, u + 1] += b


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _weighted_rows(w, values, t0, t1, acc):  # pragma: no cover - compiled
    # acc[i] += sum over t0..t1-1 of w[i, t - t0] * values[t]: eight positions a step, each head's
    # accumulator loaded and stored once for them (the last step's missing positions weighted 0).
    # A position at a time (a load and a store of the accumulator for each product): 16 heads of
    # 512 values by 64 positions took 37-50 us on one thread, 19 this way. Where the rows are
    # whole 32-value tiles, ``_pv_tile``'s (8 heads by 256 positions of 128 values: 11.3 -> 5.0 us).
    n = t1 - t0
    if (vnni._COMPILED and acc.shape[1] % 32 == 0 and w.strides[1] == 4 and values.strides[1] == 4
            and acc.strides[1] == 4):
        for h in range(0, w.shape[0], 4):
            for c in range(0, acc.shape[1], 32):
                _pv_tile(w, w.strides[0] // 4, values, values.strides[0] // 4, t0, n, acc, acc.strides[0] // 4, h,
                         w.shape[0], c)
        return
    for u in range(0, n, 8):
        v0, v1, v2, v3 = values[t0 + u], values[t0 + min(u + 1, n - 1)], values[t0 + min(u + 2, n - 1)], \
            values[t0 + min(u + 3, n - 1)]
        v4, v5, v6, v7 = values[t0 + min(u + 4, n - 1)], values[t0 + min(u + 5, n - 1)], \
            values[t0 + min(u + 6, n - 1)], values[t0 + min(u + 7, n - 1)]
        for i in range(w.shape[0]):
            wi = w[i]
            w0, w1, w2, w3 = _weight(wi, u, n), _weight(wi, u + 1, n), _weight(wi, u + 2, n), _weight(wi, u + 3, n)
            w4, w5, w6, w7 = _weight(wi, u + 4, n), _weight(wi, u + 5, n), _weight(wi, u + 6, n), _weight(wi, u + 7, n)
            ai = acc[i]
            for j in range(ai.shape[0]):
                ai[j] += (w0 * v0[j] + w1 * v1[j] + w2 * v2[j] + w3 * v3[j]) + (w4 * v4[j] + w5 * v5[j] + w6 * v6[j]
                                                                               + w7 * v7[j])


def _clamped_rows(builder, first, bound):  # type: ignore[no-untyped-def]
    """The four row indices first..first + 3 of a tile, those at or past ``bound`` made bound - 1
    (computed again as the last row; the tiles store such a row once more, or not at all)."""
    from llvmlite import ir

    last = builder.sub(bound, ir.Constant(bound.type, 1))
    rows = []
    for k in range(4):
        at = builder.add(first, ir.Constant(first.type, k))
        rows.append(builder.select(builder.icmp_signed("<", at, bound), at, last))
    return rows


@intrinsic
def _qk_tile(typingctx, qs, qstride, h0, heads, keys, kstride, t, end, dim, out, ostride,
             u):  # type: ignore[no-untyped-def]
    """out[h, u + p] += the dot product of query row h with key row t + p over ``dim`` values (a
    multiple of 16), for the rows h0..h0 + 3 below ``heads`` and t..t + 3 below ``end`` (those
    past them computed as the last one again, not stored): 16 accumulators of 16 lanes, each
    step's four query and four key vectors loaded once for all of them, then summed across their
    lanes together (four rounds of shuffles and adds: 16 sums from 16 vectors in 30
    instructions, where one vector's own sum takes eight). The strides are the rows' in
    float32s."""
    from llvmlite import ir

    f32, i32 = ir.FloatType(), ir.IntType(32)
    floats = ir.VectorType(f32, 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        q_a, k_a, out_a = vnni._arrays(context, builder, signature, args, (0, 4, 9))
        qstride_v, h0_v, heads_v, kstride_v, t_v, end_v, dim_v, ostride_v, u_v = vnni._indices(
            context, builder, signature, args, (1, 2, 3, 5, 6, 7, 8, 10, 11))
        index_t = t_v.type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                             "llvm.fma.v16f32")

        load = lanes._loader(builder)
        q_rows = [builder.mul(r, qstride_v) for r in _clamped_rows(builder, h0_v, heads_v)]
        k_rows = [builder.mul(r, kstride_v) for r in _clamped_rows(builder, t_v, end_v)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 16)) for _ in range(16)]
        with cgutils.for_range(builder, builder.udiv(dim_v, ir.Constant(index_t, 16))) as loop:
            c = builder.mul(loop.index, ir.Constant(index_t, 16))
            qv = [load(q_a, builder.add(r, c), floats, 4) for r in q_rows]
            kv = [load(k_a, builder.add(r, c), floats, 4) for r in k_rows]
            for k in range(4):
                for p in range(4):
                    acc_p = accs[4 * k + p]
                    builder.store(builder.call(fma, [qv[k], kv[p], builder.load(acc_p)]), acc_p)
        vectors = [builder.load(acc_p) for acc_p in accs]
        width = 16  # lanes each vector's accumulators take: 16 of one, then 8 of two, ... 1 of 16
        while len(vectors) > 1:
            held, half = 16 // width, width // 2
            low = [a * width + j for a in range(held) for j in range(half)]
            low += [16 + i for i in low]
            high = [i + half for i in low]
            vectors = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), low)),
                                    builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), high)))
                       for a, b in zip(vectors[::2], vectors[1::2])]
            width = half
        for k in range(4):
            h = builder.add(h0_v, ir.Constant(index_t, k))
            with builder.if_then(builder.icmp_signed("<", h, heads_v), likely=True):
                row = builder.add(builder.mul(h, ostride_v), u_v)
                for p in range(4):
                    with builder.if_then(builder.icmp_signed("<", builder.add(t_v, ir.Constant(index_t, p)), end_v),
                                         likely=True):
                        at = builder.gep(out_a.data, [builder.add(row, ir.Constant(index_t, p))])
                        value = builder.extract_element(vectors[0], ir.Constant(i32, 4 * k + p))
                        builder.store(builder.fadd(builder.load(at), value), at)
        return context.get_dummy_value()

    return types.void(qs, qstride, h0, heads, keys, kstride, t, end, dim, out, ostride, u), codegen


@intrinsic
def _pv_tile(typingctx, w, wstride, values, vstride, t0, n, acc, astride, h0, heads, c):  # type: ignore[no-untyped-def]
    """acc[h, c:c + 32] += sum over u < n of w[h, u] * values[t0 + u, c:c + 32] for the four heads
    h0..h0 + 3 (those past the last, ``heads`` - 1, computed as the last one again: the same sums
    stored twice): eight 16-lane accumulators kept in registers over all n positions, each
    position's 32 values loaded once for the four heads and each weight broadcast once. The
    strides are each array's rows' in float32s."""
    from llvmlite import ir

    f32 = ir.FloatType()
    floats = ir.VectorType(f32, 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w_a, v_a, acc_a = vnni._arrays(context, builder, signature, args, (0, 2, 6))
        wstride_v, vstride_v, t0_v, n_v, astride_v, h0_v, heads_v, c_v = vnni._indices(
            context, builder, signature, args, (1, 3, 4, 5, 7, 8, 9, 10))
        index_t = t0_v.type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                             "llvm.fma.v16f32")
        load = lanes._loader(builder)
        rows = _clamped_rows(builder, h0_v, heads_v)
        targets = [[builder.add(builder.mul(r, astride_v), builder.add(c_v, ir.Constant(index_t, 16 * half)))
                    for half in (0, 1)] for r in rows]
        accs = [[cgutils.alloca_once_value(builder, load(acc_a, at, floats, 4)) for at in pair] for pair in targets]
        w_rows = [builder.mul(r, wstride_v) for r in rows]
        with cgutils.for_range(builder, n_v) as loop:
            u = loop.index
            at = builder.add(builder.mul(builder.add(t0_v, u), vstride_v), c_v)
            halves = [load(v_a, builder.add(at, ir.Constant(index_t, 16 * half)), floats, 4) for half in (0, 1)]
            for w_row, pair in zip(w_rows, accs):
                spread = lanes._splat(builder, builder.load(builder.gep(w_a.data, [builder.add(w_row, u)])), 16)
                for half, acc_p in zip(halves, pair):
                    builder.store(builder.call(fma, [spread, half, builder.load(acc_p)]), acc_p)
        for pair, target in zip(accs, targets):
            for acc_p, at in zip(pair, target):
                lanes._store(builder, builder.load(acc_p), acc_a, at)
        return context.get_dummy_value()

    return types.void(w, wstride, values, vstride, t0, n, acc, astride, h0, heads, c), codegen


@njit(nogil=True, inline="always")
def _weight(w, u, n):  # pragma: no cover - compiled
    return w[u] if u < n else np.float32(0.0)


@njit(cache=True, nogil=True)
def _silu_times(gate, up):  # pragma: no cover - compiled
    out = np.empty_like(gate)
    for j in range(gate.shape[0]):
        out[j] = gate[j] / (np.float32(1.0) + np.exp(-gate[j])) * up[j]
    return out
