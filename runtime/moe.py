"""A MoE layer served from a bundle: routing for every supported family, CPU experts through the
Numba kernels in a worker thread, device experts through torch at the same time, shared experts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import BundleError, KtcError
from ktc.formats.bundle import Bundle
from ktc.formats.quantize import dequantize

from .device import matmul, upload
from .kernels import expert_forward, expert_forward_batch, experts_token, matmul_t

_PLAIN = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


def _as_float32(bundle: Bundle, name: str) -> np.ndarray:
    """A non-expert tensor as float32 (routers and biases are stored float32 already)."""
    t = bundle.tensors[name]
    raw = bundle.tensor(name)
    if t.scheme == "f32":
        return np.asarray(raw, dtype=np.float32)
    cols = t.shape[-1]
    rows = t.shape[0] if len(t.shape) > 1 else 1
    flat = raw.view(np.uint8).reshape(rows, -1)
    return dequantize(flat, t.scheme, cols).reshape(t.shape)


@dataclass(frozen=True)
class _CpuExpert:
    gate_up: np.ndarray
    down: np.ndarray
    scheme: str
    gate_up_bias: np.ndarray | None
    down_bias: np.ndarray | None


class MoELayer:
    """The routed experts (and shared experts) of one MoE layer of an opened bundle.

    ``device`` is a torch device for the experts the plan put on the GPU (``"cuda"``; ``"cpu"``
    runs the same torch code on the CPU, as tests do). With ``device=None`` every expert runs in
    the Numba kernels. ``counts`` records how often each expert is chosen.
    """

    def __init__(self, bundle: Bundle, layer: int, *, device: str | None = None) -> None:
        model = bundle.manifest["model"]
        infos = {info["layer"]: info for info in model["moe_layers"]}
        if layer not in infos:
            raise KtcError(f"layer {layer} is not a MoE layer of this bundle "
                           f"(MoE layers: {sorted(infos)[:8]}...)", path=bundle.path)
        self.info = info = infos[layer]
        self.layer = layer
        self.hidden_size = int(model["config"]["hidden_size"])
        self.num_experts = int(info["num_experts"])
        self.top_k = int(info["top_k"])
        self.activation = info["activation"]
        self.swiglu_limit = model["config"].get("swiglu_limit")
        self.swiglu_alpha = model["config"].get("swiglu_alpha")
        prefix = f"layers.{layer}."
        self.router = _as_float32(bundle, prefix + "router")
        self.router_bias = _as_float32(bundle, prefix + "router_bias") if info["router_bias"] else None
        self.score_bias = (_as_float32(bundle, prefix + "score_correction_bias")
                           if info["score_correction_bias"] else None)
        self.shared = None
        if info["shared_experts"]:
            self.shared = tuple(_as_float32(bundle, prefix + f"shared_experts.{p}") for p in ("gate", "up", "down"))
        self.shared_gate = _as_float32(bundle, prefix + "shared_expert_gate") if info["shared_expert_gate"] else None
        placement = bundle.manifest["plan"]["placement"][str(layer)]
        self.cpu: dict[int, _CpuExpert] = {}
        gpu: list[int] = []
        for e in range(self.num_experts):
            name = f"{prefix}experts.{e}."
            on_gpu = placement[e].startswith("gpu:") and device is not None
            if on_gpu:
                gpu.append(e)
                continue
            scheme = bundle.tensors[name + "gate_up"].scheme
            self.cpu[e] = _CpuExpert(
                bundle.tensor(name + "gate_up"), bundle.tensor(name + "down"), scheme,
                _as_float32(bundle, name + "gate_up_bias") if name + "gate_up_bias" in bundle.tensors else None,
                _as_float32(bundle, name + "down_bias") if name + "down_bias" in bundle.tensors else None)
        # Every CPU expert in one scheme that has a multi-expert kernel (int8; int4 on a VNNI
        # CPU) and uncompressed: one token takes a fused path that runs all its experts
        # in two parallel regions instead of two per expert.
        self._fused = None
        schemes = {ex.scheme for ex in self.cpu.values()}
        if len(schemes) == 1:
            (scheme,) = schemes
            from . import vnni

            if scheme == "int8" or (vnni.HAVE_VNNI and scheme in vnni.FUSED_GROUPS):
                gu = {e: bundle.tensors[f"{prefix}experts.{e}.gate_up"].offset for e in self.cpu}
                dn = {e: bundle.tensors[f"{prefix}experts.{e}.down"].offset for e in self.cpu}
                if None not in gu.values() and None not in dn.values():
                    self._fused = (scheme, bundle.file_view(), gu, dn)
        self.device = device
        self.gpu_experts = tuple(gpu)
        self.device_bytes = 0
        self._device_weights: dict[str, Any] = {}
        self._device_index: dict[int, tuple[str, int]] = {}
        if gpu:
            self._load_device(bundle, prefix, gpu, device)
        self.counts = np.zeros(self.num_experts, dtype=np.int64)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ktc-moe-{layer}")

    # ------------------------------------------------------------------------------------------
    # Device experts

    def _load_device(self, bundle: Bundle, prefix: str, experts: list[int], device: str | None) -> None:
        """Upload the device experts' bytes, stacked per scheme, at their scheme (see
        ``device.py``): the device holds exactly the bytes the plan counted for them."""
        import torch

        parts: dict[str, tuple[list, list, list, list, list]] = {}
        for e in experts:
            name = f"{prefix}experts.{e}."
            meta = bundle.tensors[name + "gate_up"]
            ids, gate_up, down, gu_bias, d_bias = parts.setdefault(meta.scheme, ([], [], [], [], []))
            ids.append(e)
            for target, suffix in ((gate_up, "gate_up"), (down, "down")):
                t = bundle.tensors[name + suffix]
                target.append(bundle.tensor(name + suffix).view(np.uint8).reshape(t.shape[0], -1))
            if name + "gate_up_bias" in bundle.tensors:
                gu_bias.append(_as_float32(bundle, name + "gate_up_bias"))
                d_bias.append(_as_float32(bundle, name + "down_bias"))
        self._device_weights = {scheme: upload(scheme, *lists[1:], device) for scheme, lists in parts.items()}
        self._device_index = {e: (scheme, i) for scheme, lists in parts.items() for i, e in enumerate(lists[0])}
        self.device_bytes = sum(stack.nbytes for stack in self._device_weights.values())
        self._compute_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

    def _run_device(self, hidden: np.ndarray, work: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
        import torch

        results = []
        x_all = torch.from_numpy(hidden).to(self.device)
        hidden_size = self.hidden_size
        for e, tokens, weights in work:
            scheme, i = self._device_index[e]
            stack = self._device_weights[scheme]
            inter = stack.gate_up.shape[1] // 2
            x = x_all[torch.from_numpy(tokens).to(self.device)]
            h = matmul(x, stack.gate_up[i], scheme, hidden_size, self._compute_dtype)
            if stack.gate_up_bias is not None:
                h = h + stack.gate_up_bias[i]
            gate, up = h[:, :inter], h[:, inter:]
            if self.activation == "swiglu_clamped":
                limit = float(self.swiglu_limit if self.swiglu_limit is not None else 7.0)
                alpha = float(self.swiglu_alpha if self.swiglu_alpha is not None else 1.702)
                gate = gate.clamp(max=limit)
                a = (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
            else:
                a = torch.nn.functional.silu(gate) * up
            y = matmul(a, stack.down[i], scheme, inter, self._compute_dtype)
            if stack.down_bias is not None:
                y = y + stack.down_bias[i]
            results.append((tokens, (y * torch.from_numpy(weights).to(self.device)[:, None]).cpu().numpy()))
        return results

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
        if not np.all(np.isfinite(hidden)):
            raise KtcError("hidden states contain NaN or Inf")
        idx, weights = self.route(hidden)
        np.add.at(self.counts, idx.ravel(), 1)
        cpu_work, gpu_work = [], []
        for e in np.unique(idx).tolist():
            tokens, slot = np.nonzero(idx == e)
            item = (e, tokens, weights[tokens, slot])
            (gpu_work if e in self._device_index else cpu_work).append(item)
        if gpu_work:
            future = self._pool.submit(self._run_cpu, hidden, cpu_work)  # overlaps with the device
            results = self._run_device(hidden, gpu_work)
            results += future.result()
        else:  # nothing to overlap with: no thread hand-off
            results = self._run_cpu(hidden, cpu_work)
        out = np.zeros_like(hidden)
        for tokens, y in results:
            if len(tokens) == 1:
                out[tokens[0]] += y[0]
            else:
                np.add.at(out, tokens, y)
        if self.shared is not None:
            gate, up, down = self.shared
            g = matmul_t(hidden, gate)
            shared = matmul_t(g / (1 + np.exp(-g)) * matmul_t(hidden, up), down)
            if self.shared_gate is not None:
                shared = shared / (1 + np.exp(-matmul_t(hidden, self.shared_gate)))
            out += shared
        return out

    def _run_cpu(self, hidden: np.ndarray, work: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._fused is not None and len(hidden) == 1 and work:
            scheme, file, gu, dn = self._fused
            experts = [e for e, _, _ in work]
            first = self.cpu[experts[0]]
            biases = first.gate_up_bias is not None
            y = experts_token(file, scheme, np.array([gu[e] for e in experts], dtype=np.int64),
                              np.array([dn[e] for e in experts], dtype=np.int64), self.hidden_size,
                              first.gate_up.shape[0] // 2, hidden[0],
                              np.array([w[0] for _, _, w in work], dtype=np.float32),
                              activation=self.activation, limit=self.swiglu_limit, alpha=self.swiglu_alpha,
                              gate_up_bias=np.stack([self.cpu[e].gate_up_bias for e in experts]) if biases else None,
                              down_bias=np.stack([self.cpu[e].down_bias for e in experts]) if biases else None)
            return [(np.zeros(1, dtype=np.int64), y[None, :])]
        results = []
        for e, tokens, weights in work:
            ex = self.cpu[e]
            kw = dict(activation=self.activation, gate_up_bias=ex.gate_up_bias, down_bias=ex.down_bias,
                      limit=self.swiglu_limit, alpha=self.swiglu_alpha)
            if len(tokens) == 1:
                y = expert_forward(ex.gate_up, ex.down, ex.scheme, hidden[tokens[0]], **kw)[None, :]
            else:
                y = expert_forward_batch(ex.gate_up, ex.down, ex.scheme, hidden[tokens], **kw)
            results.append((tokens, y * weights[:, None]))
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True)


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
