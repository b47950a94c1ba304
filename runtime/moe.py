"""A MoE layer served from a bundle with ktc's own routing for every supported family: the
routed experts (``runtime.experts``) and the shared experts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ktc.errors import BundleError, KtcError, UnsupportedModelError
from ktc.formats.bundle import Bundle
from ktc.formats.kernel_args import read_only, writable

from . import vnni
# Imported by name for the compiled _moe_token: a benchmark's clock may wrap the module's
# attribute in Python, which compiled code cannot call.
from .rows import chosen_experts_token
from .experts import ExpertSet
from .kernels import _matvec_bf16, _matvec_f32, exact_bf16, matmul_t


class MoELayer:
    """The routed experts (and shared experts) of one MoE layer of an opened bundle, with the
    model's own routing: for hosts that run the rest of the model themselves, without
    transformers (``runtime.hf`` runs whole models through transformers' own routing).

    ``device`` is a torch device for the experts the plan put on the GPU (``"cuda"``; ``"cpu"``
    runs the same torch code on the CPU, as tests do). With ``device=None`` every expert runs in
    the Numba kernels. ``counts`` records how often each expert is chosen. ``experts``: the
    layer's ``ExpertSet`` where the caller has one open (``runtime.fast_decode``). ``shared``
    False: the routed experts only (the caller computes the shared experts from its own weights;
    here they are decoded to float32).
    """

    def __init__(self, bundle: Bundle, layer: int, *, device: str | None = None,
                 experts: ExpertSet | None = None, shared: bool = True) -> None:
        model = bundle.manifest["model"]
        info = next((i for i in model["moe_layers"] if i["layer"] == layer), None)
        if info is not None and info["gating"] not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(
                f"the {model.get('family')} router is not one ktc's MoE layer computes", path=bundle.path,
                hint="run the whole model (ktc run, ktc.runtime.hf.from_bundle): transformers routes "
                     "and ktc's experts compute")
        self.experts = ExpertSet(bundle, layer, device=device) if experts is None else experts
        self.info = info = next(i for i in model["moe_layers"] if i["layer"] == layer)
        self.layer = layer
        self.hidden_size = self.experts.hidden_size
        self.num_experts = self.experts.num_experts
        self.top_k = int(info["top_k"])
        prefix = f"layers.{layer}."
        self.router = bundle.tensor_float32(prefix + "router")
        self.router_bias = bundle.tensor_float32(prefix + "router_bias") if info["router_bias"] else None
        self.score_bias = (bundle.tensor_float32(prefix + "score_correction_bias")
                           if info["score_correction_bias"] else None)
        self.shared = None
        if info["shared_experts"] and shared:
            self.shared = tuple(bundle.tensor_float32(prefix + f"shared_experts.{p}") for p in ("gate", "up", "down"))
        self.shared_gate = (bundle.tensor_float32(prefix + "shared_expert_gate")
                            if info["shared_expert_gate"] and shared else None)
        self._one_call_args: tuple | None = None  # type: ignore[type-arg]  # (tables, router, arguments)

    @property
    def counts(self) -> np.ndarray:
        return self.experts.counts

    @property
    def device_bytes(self) -> int:
        return self.experts.device_bytes

    @property
    def gpu_experts(self) -> tuple[int, ...]:
        return self.experts.gpu_experts

    # ------------------------------------------------------------------------------------------
    # Routing

    def route(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expert indices [T, top_k], weights [T, top_k]) as the model's own router computes them."""
        info = self.info
        logits = matmul_t(hidden, self.router)
        if self.router_bias is not None:
            logits = logits + self.router_bias
        k = self.top_k
        if info["gating"] == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-logits))
            choice = scores + (self.score_bias if self.score_bias is not None else 0.0)
            groups = int(info["num_groups"])
            if groups > 1:
                per = self.num_experts // groups
                grouped = choice.reshape(-1, groups, per)
                group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
                keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, : int(info["topk_groups"])]
                mask = np.zeros_like(group_scores, dtype=bool)
                np.put_along_axis(mask, keep, True, axis=-1)
                choice = np.where(np.repeat(mask, per, axis=-1), choice, -np.inf)
            idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
            weights = np.take_along_axis(scores, idx, axis=-1)
            if info["norm_topk_prob"]:
                weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        elif logits.shape[0] == 1:  # a decode step: compiled (numpy's passes cost ~0.1 ms a layer)
            idx, weights = _softmax_top_k(np.ascontiguousarray(logits[0], dtype=np.float32), k,
                                          bool(info["norm_topk_prob"]))
            idx, weights = idx[None, :], weights[None, :]
        else:
            shifted = logits - logits.max(axis=-1, keepdims=True)
            probs = np.exp(shifted)
            probs /= probs.sum(axis=-1, keepdims=True)
            idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            weights = np.take_along_axis(probs, idx, axis=-1)
            if info["norm_topk_prob"]:
                weights = weights / weights.sum(axis=-1, keepdims=True)
        weights = weights * np.float32(info["routed_scaling_factor"])
        return idx, weights.astype(np.float32)

    # ------------------------------------------------------------------------------------------
    # Forward

    def forward(self, hidden: np.ndarray) -> np.ndarray:
        """The MoE block's output for ``hidden`` [tokens, hidden_size] (float32)."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size:
            raise KtcError(f"hidden states have shape {hidden.shape}; this layer takes [tokens, "
                           f"{self.hidden_size}]")
        args = self._one_call() if hidden.shape[0] == 1 else None
        if args is not None:  # a decode step through VNNI experts: one compiled call
            out = _moe_token(*args, writable(hidden[0]), vnni.stamps())
            if out.shape[0] == 0:
                raise KtcError("hidden states contain NaN or Inf")
            out = out[None, :]
        else:
            if not np.all(np.isfinite(hidden)):
                raise KtcError("hidden states contain NaN or Inf")
            idx, weights = self.route(hidden)
            out = self.experts.forward(hidden, idx, weights)
        if self.shared is not None:
            gate, up, down = self.shared
            g = matmul_t(hidden, gate)
            shared = matmul_t(g / (1 + np.exp(-g)) * matmul_t(hidden, up), down)
            if self.shared_gate is not None:
                shared = shared / (1 + np.exp(-matmul_t(hidden, self.shared_gate)))
            out += shared
        return out

    def _one_call(self) -> tuple | None:  # type: ignore[type-arg]
        """The arguments (but the token and the stamps) of ``_moe_token`` for this layer, the
        router first, or None where one token does not take it: the experts' one call
        (``ExpertSet.one_call_tables``). Softmax or sigmoid routing (``route``'s, compiled:
        ``_sigmoid_top_k``). Built once per tables and router."""
        tables = self.experts.one_call_tables()
        if tables is None:
            return None
        cached = self._one_call_args
        if cached is None or cached[0] is not tables or cached[1] is not self.router:
            none = np.zeros(1, dtype=np.float32)
            bias = self.router_bias if self.router_bias is not None else none
            score = self.score_bias if self.score_bias is not None else none
            router = read_only(exact_bf16(self.router))
            sigmoid = self.info["gating"] == "sigmoid"
            cached = (tables, self.router, (router, read_only(bias), self.router_bias is not None, sigmoid,
                                            read_only(np.ascontiguousarray(score, dtype=np.float32)),
                                            self.score_bias is not None, int(self.info["num_groups"]) if sigmoid else 1,
                                            int(self.info["topk_groups"]) if sigmoid else 1,
                                            self.top_k, bool(self.info["norm_topk_prob"]),
                                            np.float32(self.info["routed_scaling_factor"]), *tables))
            self._one_call_args = cached
        return cached[2]

    def close(self) -> None:
        self.experts.close()


@njit(cache=True, nogil=True)
def _moe_token(router, router_bias, has_router_bias, sigmoid, score_bias, has_score_bias, groups, topk_groups, k,
               normalize, scaling, file, f32, f16, e8m0, gu_kinds,
               gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows, inter, clamped, limit, alpha, gu_bias, has_gu_bias,
               dn_bias, has_dn_bias, counts, x, stamps):  # pragma: no cover - compiled
    # One token through the layer: its router (softmax, top k; or ``sigmoid``: ``_sigmoid_top_k``),
    # then rows' one call over the chosen experts. Empty when x is not finite. Stamps 7 and 8 (vnni.STAMPS) bracket the
    # routing, 9 the end of the router's product.
    for j in range(x.shape[0]):
        if not np.isfinite(x[j]):
            return np.empty(0, dtype=np.float32)
    timed = stamps.shape[0] == vnni.STAMP_COUNT
    if timed:
        stamps[7] = vnni._cycles()
    logits = np.empty(router.shape[0], dtype=np.float32)
    if router.itemsize == 2:  # bf16 bit patterns (kernels.exact_bf16)
        _matvec_bf16(router, x, logits)
    else:
        _matvec_f32(router, x, logits)
    if timed:
        stamps[9] = vnni._cycles()
    if has_router_bias:
        logits += router_bias
    if sigmoid:
        idx, weights = _sigmoid_top_k(logits, score_bias, has_score_bias, k, groups, topk_groups, normalize)
    else:
        idx, weights = _softmax_top_k(logits, k, normalize)
    weights *= scaling
    if timed:
        stamps[8] = vnni._cycles()
    return chosen_experts_token(file, f32, f16, e8m0, gu_kinds, gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows,
                                inter, clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias, counts,
                                idx, weights, x, stamps)


@njit(cache=True, nogil=True)
def _softmax_top_k(logits, k, normalize):  # pragma: no cover - compiled
    # The k largest of softmax(logits) (the lowest index first among equals, as a stable sort
    # of the negated probabilities picks them) and their probabilities, renormalized to sum 1
    # when ``normalize``. One pass keeps the k largest in order (insertion into k slots): with
    # k passes over every expert and numpy's array steps, a decode step's routing beside the
    # router's product took 4.7-5.2 us at Qwen3-30B-A3B's shape (128 experts, k = 8; its code and
    # data evicted between steps), 3.2-4.0 this way.
    n = logits.shape[0]
    top = logits[0]
    for e in range(1, n):
        top = max(top, logits[e])
    probs = np.empty(n, dtype=np.float32)
    total = np.float32(0.0)
    for e in range(n):
        probs[e] = np.exp(logits[e] - top)
        total += probs[e]
    probs /= total
    idx, weights = _top_k(probs, k)
    if normalize:
        weights /= weights.sum()
    return idx, weights


@njit(cache=True, nogil=True, inline="always")
def _top_k(values, k):  # pragma: no cover - compiled
    # The k largest of ``values`` in order and their places, the lowest place first among equals
    # (as a stable sort of the negated values picks them): one pass, insertion into k slots.
    idx = np.empty(k, dtype=np.int64)
    top = np.empty(k, dtype=values.dtype)
    held = 0
    for e in range(values.shape[0]):
        v = values[e]
        if held == k and not v > top[k - 1]:
            continue
        j = held if held < k else k - 1
        while j > 0 and top[j - 1] < v:
            top[j], idx[j] = top[j - 1], idx[j - 1]
            j -= 1
        top[j], idx[j] = v, e
        held = min(held + 1, k)
    return idx, top


@njit(cache=True, nogil=True)
def _sigmoid_top_k(logits, score_bias, has_score_bias, k, groups, topk_groups, normalize):  # pragma: no cover - compiled
    # ``MoELayer.route``'s sigmoid routing for one token (DeepSeek-V3's, GLM-4.5's): the scores
    # sigmoid(logits); the choice scores plus the score correction; with groups, each group's two
    # largest choices summed, the topk_groups best groups kept (the lowest index first among
    # equals), the rest out of the choice; the k largest choices (the lowest index first among
    # equals, as a stable sort picks them), weighted by their scores, renormalized (plus 1e-20)
    # when ``normalize``. numpy's steps for it took 0.37 ms at GLM-4.5-Air's shape (128 experts)
    # after a 600 MB read; inside its decode the layer's time did not move beyond the noise
    # (four alternating pairs of processes, 4.3-4.9 ms a layer either way): the routing now
    # stays in the one compiled call with the experts, as softmax routing does.
    n = logits.shape[0]
    scores = np.empty(n, dtype=np.float32)
    choice = np.empty(n, dtype=np.float32)
    for e in range(n):
        scores[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[e]))
        choice[e] = scores[e] + score_bias[e] if has_score_bias else scores[e]
    if groups > 1:
        per = n // groups
        group_scores = np.empty(groups, dtype=np.float32)
        for g in range(groups):
            first, second = -np.inf, -np.inf
            for e in range(g * per, (g + 1) * per):
                v = choice[e]
                if v > first:
                    first, second = v, first
                elif v > second:
                    second = v
            group_scores[g] = first + second if per > 1 else first
        kept = np.zeros(groups, dtype=np.bool_)
        for _ in range(topk_groups):
            best = -1
            for g in range(groups):
                if not kept[g] and (best < 0 or group_scores[g] > group_scores[best]):
                    best = g
            kept[best] = True
        for g in range(groups):
            if not kept[g]:
                for e in range(g * per, (g + 1) * per):
                    choice[e] = -np.inf
    idx, _ = _top_k(choice, k)
    weights = np.empty(k, dtype=np.float32)
    for j in range(k):
        weights[j] = scores[idx[j]]
    if normalize:
        weights /= weights.sum() + np.float32(1e-20)
    return idx, weights


def moe_layers(bundle: Bundle, *, device: str | None = None) -> list[MoELayer]:
    """Every MoE layer of the bundle."""
    if "moe_layers" not in bundle.manifest.get("model", {}):
        raise BundleError("the manifest has no MoE layers", path=bundle.path)
    return [MoELayer(bundle, info["layer"], device=device) for info in bundle.manifest["model"]["moe_layers"]]


def routing_profile(layers: list[MoELayer]):  # type: ignore[no-untyped-def]
    """The layers' routing counts as an activation profile for ``ktc plan --profile``."""
    from ktc.formats.activation_profile import ActivationProfile

    return ActivationProfile(tuple(layer.layer for layer in layers),
                             np.stack([layer.counts for layer in layers]).astype(np.float64), "routing counts")
