"""The routed experts of one MoE layer of an opened bundle, run for routing the caller decided.

This is what transformers' experts interface asks of an implementation — ``(hidden_states,
top_k_index, top_k_weights)`` in, the weighted sum of the chosen experts out — and what
``runtime.moe.MoELayer`` calls after its own routing. Experts the plan put on the device run in
torch there; CPU experts run in the Numba kernels in a worker thread at the same time (the
kernels release the GIL). Only device experts take device memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.bundle import Bundle
from ktc.formats.kernel_args import read_only
from ktc.formats.schemes import expert_scheme_name, expert_schemes

from . import interleave as interleaving
from . import rows, triton_experts, vnni
from .device import DEVICE_DECODERS, batched_matmul, check_device, from_host, upload
from .device_cache import DeviceSlots
from .kernels import (LANES_MIN_TOKENS, _act, expert_forward, expert_forward_batch, experts_token, interleaved_linear,
                      linear)
from .offload import PrefillOffload


def _expert_scheme(bundle: Bundle, prefix: str) -> str:
    """The expert scheme (``formats.schemes.expert_schemes``) of the expert at ``prefix``."""
    return expert_scheme_name(f"{bundle.tensors[prefix + 'gate_up'].scheme}+{bundle.tensors[prefix + 'down'].scheme}")


@dataclass(frozen=True)
class _CpuExpert:
    gate_up: np.ndarray
    down: np.ndarray
    scheme: str
    gate_up_bias: np.ndarray | None
    down_bias: np.ndarray | None


Work = list[tuple[int, np.ndarray, np.ndarray]]  # (expert, token rows, routing weights)
_TOKEN_ZERO = np.zeros(1, dtype=np.int64)  # the rows of a forward of one token (read only)
_TOKEN_ZERO.setflags(write=False)


# rows' kind codes of the schemes multiplied in place, and their names (rows.groups_fit says which
# of them have the row tiles of rows.experts_groups)
_IN_PLACE_NAMES = {rows.kind(name): name for name in LANES_MIN_TOKENS if rows.kind(name) is not None}
_INTERLEAVED_NAMES = {code: name for name, code in rows.INTERLEAVED.items()}


def _few_tokens_limit(code: int, cols: int) -> int:
    """Tokens an expert has fewer of where ``rows.experts_groups`` takes its matrix of kind
    ``code`` with rows of ``cols`` values: up to the scheme's vector path (``LANES_MIN_TOKENS``),
    for an interleaved copy's up to its few-token tiles' end (``interleave.FEW_TOKENS``); 0
    where it does not take them."""
    if code in _INTERLEAVED_NAMES:
        return interleaving.FEW_TOKENS[_INTERLEAVED_NAMES[code]]
    name = _IN_PLACE_NAMES.get(code)
    return LANES_MIN_TOKENS[name] if name and rows.groups_fit(name, cols) else 0


def disk_tier(bundle: Bundle) -> bool:
    """Whether the bundle's plan keeps experts on disk (``disk:SCHEME`` placements)."""
    placement = (bundle.manifest.get("plan") or {}).get("placement") or {}
    return any(p.startswith("disk:") for row in placement.values() for p in row)


def _numba_threads(threads: int) -> None:
    import numba

    numba.set_num_threads(max(1, threads))


# The most matrix elements a chunk of device experts decodes at once (float32 while decoding:
# 512 MiB): a chunk holds as many experts as fit (Qwen3-30B-A3B's: 28), and always at least one
# (Mixtral-8x7B's gate/up alone is 117M).
DECODED_ELEMENTS = 1 << 27


def host_copy(hidden: Any, idx: Any, weights: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hidden [tokens, hidden] (as float32), idx [tokens, k] (as int64) and weights [tokens, k]
    (as float32), torch tensors on any device, on the host in one copy: their 32-bit words in one
    tensor (float32 values through bit views, the indices as int32: every value's bits kept)."""
    import torch

    tokens, k = idx.shape
    words = torch.cat([hidden.detach().to(torch.float32).reshape(-1).view(torch.int32),
                       weights.detach().to(torch.float32).reshape(-1).view(torch.int32),
                       idx.detach().to(torch.int32).reshape(-1)]).cpu().numpy()
    at = hidden.shape[0] * hidden.shape[1]
    return (words[:at].view(np.float32).reshape(hidden.shape), words[at + tokens * k:].astype(np.int64).reshape(tokens, k),
            words[at:at + tokens * k].view(np.float32).reshape(tokens, k))


class ExpertSet:
    """The routed experts of MoE layer ``layer``.

    ``device`` is a torch device for the experts the plan put on the GPU (``"cuda"``; ``"cpu"``
    runs the same torch code on the CPU, as tests do); with ``device=None`` every expert runs in
    the Numba kernels. ``compute_dtype`` is the torch dtype of device products (bf16 on CUDA,
    float32 elsewhere, by default). ``counts`` records how often each expert was chosen.

    ``cache_slots``: besides the plan's device experts, this many device slots for CPU experts,
    filled on demand (``device_cache.DeviceSlots``; its policy ``expert_cache.LayerCache`` takes
    ``cache_prior``, the profile's use counts of the layer's experts). A use of a CPU expert a
    slot holds runs on the device; any other runs on the CPU, never waiting for a copy.
    ``offload``: an ``offload.PrefillOffload`` (shared by a model's layers): a forward of many
    tokens copies the CPU experts its cost model chooses to the device for that forward alone.
    ``cpu_threads``: the Numba threads of the worker that runs the CPU experts beside the
    device's (by default the creating thread's, less one where that leaves three or more).
    ``interleave``: without a device, a layer whose experts share one scheme on a VNNI CPU reads
    them from one copy with the rows of their q4_0, q8_0, mxfp4 and q4_k matrices interleaved
    (``runtime.interleave``; int8's as q8_0 blocks, each with its row's scale in fp16, where every
    scale allows it; the others, Q4_K_M's q6_k down rows, copied as they are; made here,
    the experts' size again in memory, the map's pages of them released: ``Bundle.release``),
    unless the plan keeps experts on disk; False reads the bundle's own layout.
    """

    def __init__(self, bundle: Bundle, layer: int, *, device: Any = None, compute_dtype: Any = None,
                 cache_slots: int = 0, cache_prior: np.ndarray | None = None,
                 offload: PrefillOffload | None = None, cpu_threads: int | None = None,
                 interleave: bool = True) -> None:
        device = check_device(device)
        model = bundle.manifest["model"]
        infos = {info["layer"]: info for info in model["moe_layers"]}
        if layer not in infos:
            raise KtcError(f"layer {layer} is not a MoE layer of this bundle "
                           f"(MoE layers: {sorted(infos)[:8]}...)", path=bundle.path)
        info = infos[layer]
        self.layer = layer
        self.hidden_size = int(model["config"]["hidden_size"])
        self.num_experts = int(info["num_experts"])
        self.intermediate_size = int(info["intermediate_size"])
        self.activation = info["activation"]
        self.swiglu_limit = model["config"].get("swiglu_limit")
        self.swiglu_alpha = model["config"].get("swiglu_alpha")
        prefix = f"layers.{layer}."
        placement = bundle.manifest["plan"]["placement"][str(layer)]
        self.cpu: dict[int, _CpuExpert] = {}
        gpu: list[int] = []
        for e in range(self.num_experts):
            name = f"{prefix}experts.{e}."
            if placement[e].startswith("gpu:") and device is not None:
                gpu.append(e)
                continue
            self.cpu[e] = _CpuExpert(
                bundle.tensor(name + "gate_up"), bundle.tensor(name + "down"), _expert_scheme(bundle, name),
                bundle.tensor_float32(name + "gate_up_bias") if name + "gate_up_bias" in bundle.tensors else None,
                bundle.tensor_float32(name + "down_bias") if name + "down_bias" in bundle.tensors else None)
        # Every CPU expert in a scheme that has a multi-expert kernel (int8; on a VNNI CPU any
        # mix of int8, q8_0, q4_0, mxfp4, int4, the K-quants and iq4_xs, gate/up and down in
        # different ones too) and uncompressed: one token takes a fused path that runs all its
        # experts in two parallel regions instead of two per expert.
        self._fused = None
        self._fused_biases: tuple[np.ndarray, np.ndarray] | None = None
        self._one_call: tuple | None = None  # type: ignore[type-arg]
        schemes = {ex.scheme for ex in self.cpu.values()}
        parts = {part.name for name in schemes for part in expert_schemes(name)}  # gate/up and down
        if schemes:
            if schemes == {"int8"} or (vnni.HAVE_VNNI and parts <= vnni.FUSED):
                # one scheme: its name; mixed: each expert's, looked up per token
                scheme = next(iter(schemes)) if len(schemes) == 1 else np.array(
                    [self.cpu[e].scheme if e in self.cpu else "" for e in range(self.num_experts)], dtype=object)
                gu = np.full(self.num_experts, -1, dtype=np.int64)
                dn = np.full(self.num_experts, -1, dtype=np.int64)
                for e in self.cpu:
                    gu[e] = bundle.tensors[f"{prefix}experts.{e}.gate_up"].offset or -1
                    dn[e] = bundle.tensors[f"{prefix}experts.{e}.down"].offset or -1
                if (gu[list(self.cpu)] >= 0).all() and (dn[list(self.cpu)] >= 0).all():
                    self._fused = (scheme, bundle.file_view(), gu, dn)
                    first = next(iter(self.cpu.values()))
                    if first.gate_up_bias is not None:  # stacked once: indexed per token
                        self._fused_biases = (
                            np.stack([self.cpu[e].gate_up_bias if e in self.cpu else np.zeros_like(first.gate_up_bias)
                                      for e in range(self.num_experts)]),
                            np.stack([self.cpu[e].down_bias if e in self.cpu else np.zeros_like(first.down_bias)
                                      for e in range(self.num_experts)]))
        # (copy, gate/up offsets, down offsets, whether each is interleaved): the experts' copy, where made
        self._interleaved: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[bool, bool]] | None = None
        # not where the plan keeps experts on disk: a copy would read them all into RAM
        if interleave and device is None and self._fused is not None and len(schemes) == 1 and vnni.HAVE_VNNI \
                and not disk_tier(bundle):
            gu_part, dn_part = (part.name for part in expert_schemes(next(iter(schemes))))
            which = (self._copies(gu_part, 2 * self.intermediate_size, self.hidden_size, "gate_up"),
                     self._copies(dn_part, self.hidden_size, self.intermediate_size, "down"))
            if any(which):
                self._interleaved = self._interleave(which)
                for e in self.cpu:  # the map's pages of them are no longer read
                    bundle.release(f"{prefix}experts.{e}.gate_up")
                    bundle.release(f"{prefix}experts.{e}.down")
        self.device = device
        self.gpu_experts = tuple(gpu)
        self.device_bytes = 0  # the plan's device experts' (the cache's slots: ``cache.nbytes``)
        self._device_weights: dict[str, Any] = {}
        self._device_index: dict[int, tuple[str, int]] = {}
        self._compute_dtype = compute_dtype
        if device is not None and compute_dtype is None:
            import torch

            self._compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if gpu:
            self._load_device(bundle, prefix, gpu, device)
        self.cache: DeviceSlots | None = None
        if cache_slots > 0 and device is not None and self.cpu:
            self.cache = self._make_cache(bundle, cache_slots, cache_prior)
        for stack in [*self._device_weights.values(), *([self.cache.weights] if self.cache is not None else [])]:
            self._warm_token_kernels(stack)
        self.offload = offload if device is not None and self.cpu else None
        self._offloaded: dict[int, tuple[Any, int]] = {}  # this forward's copied CPU experts: (stack, index)
        # copies started a layer ahead (``prepare_offload``) on this layer's worker thread: the
        # future of {expert: (stack, index)}
        self._prepared: Any = None
        self.counts = np.zeros(self.num_experts, dtype=np.int64)
        # one-token forwards' device stacks, by the path that ran them: the fused kernels
        # (``triton_experts``) or torch's operations
        self.token_kernels = {"fused": 0, "torch": 0}
        # Set by the model around a forward whose last rows alone are read past this layer (the
        # model's last layer in a prefill chunk: only the positions whose logits are kept): the
        # other rows' expert outputs are zeros, as llama.cpp skips them in its last layer.
        self.rows_wanted: int | None = None
        # Called with each forward's hidden states (float32 [tokens, hidden]) and routing (int64
        # [tokens, k]) before the experts run (``ktc profile``: its trace and pre-gating).
        self.observers: list[Callable[[np.ndarray, np.ndarray], None]] = []
        # Numba's thread count is per thread, and a new thread starts at every core: the worker
        # takes its creator's, less the core of the thread that drives the device meanwhile
        # (Python's kernel launches) where that leaves three or more.
        if cpu_threads is None:
            import numba

            cpu_threads = numba.get_num_threads()
            cpu_threads = cpu_threads - 1 if cpu_threads >= 4 else cpu_threads
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ktc-experts-{layer}",
                                         initializer=_numba_threads, initargs=(cpu_threads,))
                      if self._on_device else None)

    def _copies(self, scheme: str, rows: int, cols: int, matrix: str) -> bool:
        """Whether the CPU experts' ``matrix`` ("gate_up", "down") of ``scheme`` are read from an
        interleaved copy (int8's where every row scale allows it, ``interleave.int8_copies``; rows
        of whole blocks that do not fill whole units too, their last unit filled out: gpt-oss's
        2880 values a row are 22.5 units of mxfp4's 128)."""
        if interleaving.copy_scheme(scheme) not in interleaving.SCHEMES or not interleaving.fits(rows, cols, scheme,
                                                                                                 tail=True):
            return False
        return scheme not in interleaving.COPIES or all(interleaving.int8_copies(getattr(ex, matrix))
                                                        for ex in self.cpu.values())

    def _copy_shape(self, matrix: np.ndarray, scheme: str, interleaved: bool) -> tuple[int, int]:
        """The shape of ``matrix``'s place in the copy (int8's copy rows are q8_0's)."""
        rows, row_bytes = matrix.shape
        return rows, interleaving.copy_row_bytes(scheme, row_bytes) if interleaved else row_bytes

    def _interleave(self, which: tuple[bool, bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[bool, bool]]:
        """Every CPU expert's gate/up and down matrices in one read-only copy, each interleaved
        (``interleave.repack``) where ``which`` says so (gate/up, down) and as it is otherwise
        (Q4_K_M's q6_k down rows beside q4_k gate/up), their byte offsets in it (-1 for an expert
        not on the CPU), and ``which``."""
        first = next(iter(self.cpu.values()))
        parts = tuple(part.name for part in expert_schemes(first.scheme))
        shapes = [self._copy_shape(m, part, flag) for m, part, flag in zip((first.gate_up, first.down), parts, which)]
        copy = interleaving.aligned_empty(len(self.cpu) * sum(rows * row_bytes for rows, row_bytes in shapes))
        gu = np.full(self.num_experts, -1, dtype=np.int64)
        dn = np.full(self.num_experts, -1, dtype=np.int64)
        at = 0
        for e, ex in sorted(self.cpu.items()):
            for matrix, offsets, part, interleaved, shape in zip((ex.gate_up, ex.down), (gu, dn), parts, which, shapes):
                target = copy[at:at + shape[0] * shape[1]].reshape(shape)
                if interleaved:
                    interleaving.repack(matrix, part, out=target)
                else:
                    target[...] = matrix
                offsets[e] = at
                at += target.nbytes
        return read_only(copy), gu, dn, which

    def _interleaved_forward(self, e: int, x: np.ndarray) -> np.ndarray:
        """Tokens x [T, hidden] through CPU expert ``e``'s matrices in the copy (``interleaved_linear``
        where interleaved; where the interleaved are q4_k's and the tokens many, ``lanes``' products
        as the stored layout's, over the rows put back a chunk at a time)."""
        copy, gu, dn, which = self._interleaved  # type: ignore[misc]
        ex = self.cpu[e]
        stored = tuple(part.name for part in expert_schemes(ex.scheme))
        shapes = [self._copy_shape(m, part, flag) for m, part, flag in zip((ex.gate_up, ex.down), stored, which)]
        gate_up = copy[gu[e]:gu[e] + shapes[0][0] * shapes[0][1]].reshape(shapes[0])
        down = copy[dn[e]:dn[e] + shapes[1][0] * shapes[1][1]].reshape(shapes[1])
        # the copy's schemes (int8's interleaved rows are q8_0's)
        parts = tuple(interleaving.copy_scheme(part) if flag else part for part, flag in zip(stored, which))
        if (len(x) >= interleaving.K_LANES_MIN_TOKENS and self.activation in ("silu", "swiglu_clamped")
                and all(part in interleaving.K_SCHEMES for part, flag in zip(parts, which) if flag)):
            return expert_forward_batch(gate_up, down, ex.scheme, x, activation=self.activation,
                                        gate_up_bias=ex.gate_up_bias, down_bias=ex.down_bias,
                                        limit=self.swiglu_limit, alpha=self.swiglu_alpha, interleaved=which)

        def product(x: np.ndarray, matrix: np.ndarray, scheme: str, interleaved: bool) -> np.ndarray:
            return interleaved_linear(x, matrix, scheme) if interleaved else linear(x, matrix, scheme)

        h = product(x, gate_up, parts[0], which[0])
        if ex.gate_up_bias is not None:
            h += ex.gate_up_bias
        y = product(_act(h, self.intermediate_size, self.activation, self.swiglu_limit,
                         self.swiglu_alpha).astype(np.float32), down, parts[1], which[1])
        if ex.down_bias is not None:
            y += ex.down_bias
        return y

    # ------------------------------------------------------------------------------------------
    # Device experts

    def _load_device(self, bundle: Bundle, prefix: str, experts: list[int], device: Any) -> None:
        """Upload the device experts' bytes, stacked per scheme, at their scheme (see
        ``device.py``): the device holds exactly the bytes the plan counted for them."""
        parts: dict[str, tuple[list, list, list, list, list]] = {}
        for e in experts:
            name = f"{prefix}experts.{e}."
            ids, gate_up, down, gu_bias, d_bias = parts.setdefault(_expert_scheme(bundle, name), ([], [], [], [], []))
            ids.append(e)
            for target, suffix in ((gate_up, "gate_up"), (down, "down")):
                t = bundle.tensors[name + suffix]
                target.append(bundle.tensor(name + suffix).view(np.uint8).reshape(t.shape[0], -1))
            if name + "gate_up_bias" in bundle.tensors:
                gu_bias.append(bundle.tensor_float32(name + "gate_up_bias"))
                d_bias.append(bundle.tensor_float32(name + "down_bias"))
        self._device_weights = {scheme: upload(scheme, *lists[1:], device) for scheme, lists in parts.items()}
        self._device_index = {e: (scheme, i) for scheme, lists in parts.items() for i, e in enumerate(lists[0])}
        self.device_bytes = sum(stack.nbytes for stack in self._device_weights.values())

    def _make_cache(self, bundle: Bundle, slots: int, prior: np.ndarray | None) -> DeviceSlots:
        """Device slots for the layer's CPU experts of its most common CPU scheme (one stack
        holds one scheme; where a layer's CPU experts mix schemes, the others stay on the CPU)."""
        schemes = [ex.scheme for ex in self.cpu.values()]
        scheme = max(sorted(set(schemes)), key=schemes.count)
        missing = [part.name for part in expert_schemes(scheme) if part.name not in DEVICE_DECODERS]
        if missing:
            raise KtcError(f"layer {self.layer}: no device decoder for {', '.join(missing)}, so its CPU experts "
                           "cannot take cache slots", hint="run without --cache-slots")
        candidates = [e for e, ex in self.cpu.items() if ex.scheme == scheme]
        return DeviceSlots(bundle, self.layer, self.num_experts, candidates, scheme, slots, self.device,
                           resident=self.gpu_experts, prior=prior)

    def _stack(self, expert: int) -> tuple[Any, int]:
        """The device stack holding ``expert`` and its index there (a resident's, or a slot's)."""
        if expert in self._device_index:
            scheme, i = self._device_index[expert]
            return self._device_weights[scheme], i
        if expert in self._offloaded:
            return self._offloaded[expert]
        return self.cache.weights, self.cache.slot_of[expert]  # type: ignore[union-attr]

    def _run_device(self, x_all: Any, work: Work, out: Any) -> None:
        """Add the device experts' weighted outputs for ``work`` into ``out`` (float32, on the
        device); ``x_all`` holds every token's hidden state on the device.

        The experts of one device stack (a scheme's residents, the cache's slots, a forward's
        offloaded copies) run together (``_chunk``): their matrices decoded at once and
        multiplied in batched products, each expert's tokens padded to the most any of them has
        (with weight 0). The indices and weights go to the device in one copy a forward (two
        for several tokens). An expert a time, a decode step's experts cost about 30 kernel
        launches and two host-to-device copies each, which on an H200 took longer than the
        CPU's experts beside them."""
        groups: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
        for item in work:
            stack, i = self._stack(item[0])
            groups.setdefault(id(stack), (stack, []))[1].append((i, item))
        per = max(1, DECODED_ELEMENTS // (3 * self.hidden_size * self.intermediate_size))
        if x_all.shape[0] == 1:  # one token: no rows to gather or scatter
            # each chunk's stack indices, then its weights, as float32 (indices far below 2^24); the
            # fused kernels decode nothing in memory, so a stack they serve is one chunk
            chunks = [(stack, fused, members[start:start + size]) for stack, members in groups.values()
                      for fused in [self._fused_schemes(stack)]
                      for size in [len(members) if fused else per]
                      for start in range(0, len(members), size)]
            packed = from_host(np.array(
                [v for _, _, part in chunks for v in [i for i, _ in part] + [float(item[2][0]) for _, item in part]],
                dtype=np.float32), self.device)
            at = 0
            for stack, fused, part in chunks:
                n = len(part)
                index, weights = packed[at: at + n], packed[at + n: at + 2 * n]
                at += 2 * n
                if fused and self._token_kernels(stack, fused, index, weights, x_all, out):
                    self.token_kernels["fused"] += 1
                    continue
                self.token_kernels["torch"] += 1
                y = self._chunk(stack, index.long(), x_all.expand(n, 1, self.hidden_size))
                out.addmm_(weights[None, :], y.reshape(n, self.hidden_size))
            return
        chunks, ints, floats = [], [], []
        for stack, members in groups.values():
            members.sort(key=lambda m: -len(m[1][1]))  # similar token counts share a chunk's padding
            for start in range(0, len(members), per):
                part = members[start:start + per]
                most = len(part[0][1][1])
                rows_ = np.zeros((len(part), most), dtype=np.int64)
                weights = np.zeros((len(part), most), dtype=np.float32)
                for j, (_, (_, tokens, chosen)) in enumerate(part):
                    rows_[j, : len(tokens)] = tokens
                    weights[j, : len(tokens)] = chosen
                chunks.append((stack, len(part), most))
                ints += [np.array([i for i, _ in part], dtype=np.int64), rows_.ravel()]
                floats.append(weights.ravel())
        ints_d = from_host(np.concatenate(ints), self.device)
        floats_d = from_host(np.concatenate(floats), self.device)
        at = weighted = 0
        for stack, n, most in chunks:
            index, token_rows = ints_d[at: at + n], ints_d[at + n: at + n + n * most]
            weights = floats_d[weighted: weighted + n * most].reshape(n, most, 1)
            at, weighted = at + n + n * most, weighted + n * most
            y = self._chunk(stack, index, x_all[token_rows].reshape(n, most, self.hidden_size))
            out.index_add_(0, token_rows, (y * weights).reshape(n * most, self.hidden_size))

    def _fused_schemes(self, stack: Any) -> tuple[str, str] | None:
        """(gate/up scheme, down scheme) of ``stack`` where the fused device kernels
        (``triton_experts``) serve it on this device, else None."""
        gate_up_scheme, down_scheme = (s.name for s in expert_schemes(stack.scheme))
        if triton_experts.enabled(self.device) and triton_experts.supported(gate_up_scheme, down_scheme):
            return gate_up_scheme, down_scheme
        return None

    def _token_kernels(self, stack: Any, schemes: tuple[str, str], index: Any, weights: Any, x_all: Any,
                       out: Any) -> bool:
        """One token's experts ``index`` (float32 stack indices) of ``stack`` (its ``schemes``,
        ``_fused_schemes``) weighted by ``weights`` and added into ``out`` [1, hidden] by the fused
        device kernels (two kernel launches, the weights read at their scheme); False where they
        did not build (the torch path then)."""
        return triton_experts.token(
            stack, *schemes, index, weights, x_all[0].float().contiguous(), out[0], self.hidden_size,
            stack.gate_up.shape[1] // 2, self.activation == "swiglu_clamped",
            float(self.swiglu_limit if self.swiglu_limit is not None else 7.0),
            float(self.swiglu_alpha if self.swiglu_alpha is not None else 1.702))

    def _warm_token_kernels(self, stack: Any) -> None:
        """Build the fused kernels a decode step will take for ``stack`` now, at load, not in
        the first decode steps (``triton_experts.warm``)."""
        schemes = self._fused_schemes(stack)
        if schemes is not None:
            triton_experts.warm(stack, *schemes, self.hidden_size, self.activation == "swiglu_clamped")

    def _chunk(self, stack: Any, index: Any, x: Any) -> Any:
        """The experts ``index`` of device ``stack`` on their tokens ``x`` [n, tokens, hidden]:
        their outputs [n, tokens, hidden], float32, unweighted."""
        import torch

        gate_up_scheme, down_scheme = (s.name for s in expert_schemes(stack.scheme))
        inter = stack.gate_up.shape[1] // 2
        h = batched_matmul(x, stack.gate_up[index], gate_up_scheme, self.hidden_size, self._compute_dtype)
        if stack.gate_up_bias is not None:
            h = h + stack.gate_up_bias[index][:, None, :]
        gate, up = h[..., :inter], h[..., inter:]
        if self.activation == "swiglu_clamped":
            limit = float(self.swiglu_limit if self.swiglu_limit is not None else 7.0)
            alpha = float(self.swiglu_alpha if self.swiglu_alpha is not None else 1.702)
            gate = gate.clamp(max=limit)
            a = (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
        else:
            a = torch.nn.functional.silu(gate) * up
        y = batched_matmul(a, stack.down[index], down_scheme, inter, self._compute_dtype)
        if stack.down_bias is not None:
            y = y + stack.down_bias[index][:, None, :]
        return y

    # ------------------------------------------------------------------------------------------
    # Forward

    def _split(self, idx: np.ndarray, weights: np.ndarray, cached: frozenset[int] = frozenset()) -> tuple[Work, Work]:
        """Per selected expert, its tokens and their weights: (CPU work, device work); the
        experts in ``cached`` run from their cache slots."""
        if idx.shape[0] == 1 and len(set(chosen := idx[0].tolist())) == len(chosen):
            return self._split_token(chosen, weights[0].tolist(), cached)
        self.counts += np.bincount(idx.ravel(), minlength=self.num_experts)[: self.num_experts]
        cpu_work: Work = []
        dev_work: Work = []
        for e in np.unique(idx).tolist():
            if not 0 <= e < self.num_experts:
                raise KtcError(f"layer {self.layer}: routing chose expert {e}; the layer has {self.num_experts}")
            tokens, slot = np.nonzero(idx == e)
            chosen = np.ascontiguousarray(weights[tokens, slot], dtype=np.float32)
            if len(tokens) > 1 and (tokens[1:] == tokens[:-1]).any():
                # a token that chose the expert twice (nonzero lists its slots side by side): its
                # weights add, so every expert's tokens are distinct (``_accumulate``)
                tokens, first = np.unique(tokens, return_index=True)
                chosen = np.add.reduceat(chosen, first)
            item = (e, tokens, chosen)
            (dev_work if e in self._device_index or e in cached else cpu_work).append(item)
        return cpu_work, dev_work

    def _split_token(self, experts: list[int], weights: list[float], cached: frozenset[int]) -> tuple[Work, Work]:
        """``_split`` of one token's distinct experts (a decode step), the same work in the same
        order (by expert) without array operations for each expert: at Qwen3-30B-A3B's k = 8, 6 us a
        layer against 25 (the device path runs it every layer of every step)."""
        cpu_work: Work = []
        dev_work: Work = []
        for e, w in sorted(zip(experts, weights)):
            if not 0 <= e < self.num_experts:
                raise KtcError(f"layer {self.layer}: routing chose expert {e}; the layer has {self.num_experts}")
            self.counts[e] += 1
            item = (e, _TOKEN_ZERO, np.array([w], dtype=np.float32))
            (dev_work if e in self._device_index or e in cached else cpu_work).append(item)
        return cpu_work, dev_work

    def forward(self, hidden: np.ndarray, idx: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The experts' weighted sum for ``hidden`` [tokens, hidden_size] (float32, numpy)
        routed to ``idx`` [tokens, k] with ``weights`` [tokens, k]."""
        if self._on_device:  # forward_torch calls the observers
            import torch

            out = self.forward_torch(torch.from_numpy(hidden).to(self.device), torch.from_numpy(idx),
                                     torch.from_numpy(weights))
            return out.cpu().numpy()
        for observe in self.observers:
            observe(hidden, np.asarray(idx, dtype=np.int64))
        if self._fused is not None and idx.shape[0] == 1:  # one token: straight to the fused kernel
            return self._decode_token(hidden[0], idx[0].astype(np.int64, copy=False), weights[0])[None, :]
        cpu_work, _ = self._split(idx, weights)
        return self._accumulate(hidden.shape, self._run_cpu(hidden, cpu_work))

    def forward_torch(self, hidden: Any, idx: Any, weights: Any) -> Any:
        """The same for torch tensors (what transformers passes): ``hidden`` on any device and
        dtype; the result has ``hidden``'s device and dtype. With ``rows_wanted`` only the last
        rows are computed."""
        import torch

        if self.observers:
            seen = hidden.detach().to("cpu", torch.float32).numpy(), idx.detach().to("cpu", torch.int64).numpy()
            for observe in self.observers:
                observe(*seen)
        wanted = self.rows_wanted
        if wanted is not None and 0 < wanted < hidden.shape[0]:
            out = torch.zeros_like(hidden)
            out[-wanted:] = self._forward_torch(hidden[-wanted:], idx[-wanted:], weights[-wanted:])
            return out
        return self._forward_torch(hidden, idx, weights)

    def _host_inputs(self, hidden: Any, idx: Any, weights: Any) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(hidden float32 or None, idx int64, weights float32) on the host; the hidden states
        only where the layer has CPU experts. From a GPU, with them, in one copy
        (``host_copy``): one synchronisation of the device's stream a layer instead of three."""
        import torch

        if hidden.device.type != "cpu" and self.cpu:
            return host_copy(hidden, idx, weights)
        idx_np = idx.detach().to("cpu", torch.int64).numpy()
        weights_np = weights.detach().to("cpu", torch.float32).numpy()
        host = np.ascontiguousarray(hidden.detach().to("cpu", torch.float32).numpy()) if self.cpu else None
        return host, idx_np, weights_np

    def _forward_torch(self, hidden: Any, idx: Any, weights: Any) -> Any:
        host, idx_np, weights_np = self._host_inputs(hidden, idx, weights)
        if self._fused is not None and not self._on_device and idx_np.shape[0] == 1:
            # One token, every expert on the CPU (a decode step): straight to the fused kernel.
            y = self._decode_token(host[0], idx_np[0], weights_np[0])
            return from_host(y[None, :], hidden.device).to(hidden.dtype)
        cached = frozenset() if self.cache is None else self.cache.step(np.unique(idx_np))
        cpu_work, dev_work = self._split(idx_np, weights_np, cached)
        try:
            chosen = self._offload_choice(cpu_work, idx_np.shape[0]) if self.offload is not None and cpu_work else []
            prepared = self._take_prepared()
            if chosen:
                ready = {e: prepared[e] for e in chosen if e in prepared}
                self._offloaded.update(ready)
                if ready and self.offload is not None:  # copied a layer ahead, not again
                    self.offload.counters.ahead_used += len(ready)
                    self.offload.counters.bytes_uploaded -= sum(self._cpu_bytes(e) for e in ready)
                copy = [e for e in chosen if e not in ready]
                moved = [w for w in cpu_work if w[0] in chosen]
                cpu_work = [w for w in cpu_work if w[0] not in chosen]
                # the copies run beside the CPU's experts, as the offload's cost model has them
                return self._compute(hidden, host, cpu_work, dev_work + moved,
                                     (lambda: self._upload(copy)) if copy else None)
            return self._compute(hidden, host, cpu_work, dev_work)
        finally:
            self._offloaded = {}  # the copies are freed with the forward (and the unused prepared ones)

    def _compute(self, hidden: Any, host: np.ndarray | None, cpu_work: Work, dev_work: Work,
                 before_device: Callable[[], None] | None = None) -> Any:
        """The forward's CPU work on the worker thread beside its device work (``host``: the
        hidden states on the host, where there is CPU work); ``before_device`` runs on this
        thread once the CPU work has started (the prefill offload's copies)."""
        import torch

        if not dev_work:  # nothing to overlap with: no thread hand-off
            return from_host(self._accumulate(host.shape, self._run_cpu_timed(host, cpu_work)),
                             hidden.device).to(hidden.dtype)
        future = self._pool.submit(self._run_cpu_timed, host, cpu_work) if cpu_work else None
        try:
            if before_device is not None:
                before_device()
        except BaseException:
            if future is not None:
                future.result()  # never leave the worker running past a failed copy
            raise
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        self._run_device(hidden.detach().to(self.device), dev_work, out)
        if future is not None:
            out += from_host(self._accumulate(host.shape, future.result()), out.device)
        return out.to(hidden.dtype)

    def _offload_choice(self, cpu_work: Work, tokens: int) -> list[int]:
        """The CPU experts of this forward the offload's cost model moves to the device (those
        whose schemes the device decodes)."""
        work = self._offload_work((e, len(t)) for e, t, _ in cpu_work)
        return sorted(self.offload.choose(work, tokens)) if self.offload is not None else []

    def _offload_work(self, uses: Any) -> list[tuple[int, str, int, int]]:
        """The offload's view of (CPU expert, its tokens) pairs: (expert, scheme, tokens, bytes)
        for those whose schemes the device decodes."""
        return [(e, self.cpu[e].scheme, n, self._cpu_bytes(e)) for e, n in uses
                if all(part.name in DEVICE_DECODERS for part in expert_schemes(self.cpu[e].scheme))]

    def prepare_offload(self, guess: np.ndarray) -> None:
        """Start copying to the device, on this layer's worker thread (idle while the layer
        before runs), the CPU experts the offload would choose for a forward routed as
        ``guess`` [tokens, k] (pre-gating, a layer ahead: ``prefetch.Prefetcher``); the forward
        takes those it then chooses without copying them again, and frees the rest. Nothing for
        forwards below the offload's threshold."""
        offload = self.offload
        if offload is None or self._pool is None or guess.shape[0] < offload.min_tokens:
            return
        self._take_prepared()  # a guess not followed by a forward: dropped
        counts = np.bincount(guess.ravel(), minlength=self.num_experts)[: self.num_experts]
        pooled = frozenset() if self.cache is None else frozenset(self.cache.slot_of)
        work = self._offload_work((e, int(counts[e])) for e in sorted(self.cpu) if counts[e] and e not in pooled)
        chosen = sorted(offload.choose(work, guess.shape[0], ahead=True))
        if chosen:
            self._prepared = self._pool.submit(self._stacks, chosen)

    def _take_prepared(self) -> dict[int, tuple[Any, int]]:
        """The copies ``prepare_offload`` started (waited for), no longer held by this layer."""
        future, self._prepared = self._prepared, None
        return {} if future is None else future.result()

    def _upload(self, experts: list[int]) -> None:
        """Copy ``experts`` (CPU experts) to the device for this forward into ``_offloaded``."""
        self._offloaded.update(self._stacks(experts))

    def _stacks(self, experts: list[int]) -> dict[int, tuple[Any, int]]:
        """``experts`` (CPU experts) copied to the device, stacked per scheme (``device.upload``):
        {expert: (stack, index)}. The copies' time goes to the offload's copy rate."""
        started = time.perf_counter()
        out = self._stacked(experts)
        if self.offload is not None:
            if self.device.type == "cuda":
                import torch

                torch.cuda.current_stream(self.device).synchronize()  # until on the device
            self.offload.observe_copy(sum(self._cpu_bytes(e) for e in experts), time.perf_counter() - started)
        return out

    def _stacked(self, experts: list[int]) -> dict[int, tuple[Any, int]]:
        out: dict[int, tuple[Any, int]] = {}
        by_scheme: dict[str, list[int]] = {}
        for e in experts:
            by_scheme.setdefault(self.cpu[e].scheme, []).append(e)
        for scheme, chosen in by_scheme.items():
            parts = [self.cpu[e] for e in chosen]
            biases = parts[0].gate_up_bias is not None
            stack = upload(scheme, [p.gate_up.view(np.uint8).reshape(p.gate_up.shape[0], -1) for p in parts],
                           [p.down.view(np.uint8).reshape(p.down.shape[0], -1) for p in parts],
                           [p.gate_up_bias for p in parts] if biases else [],
                           [p.down_bias for p in parts] if biases else [], self.device)
            out.update({e: (stack, i) for i, e in enumerate(chosen)})
        return out

    def _cpu_bytes(self, expert: int) -> int:
        ex = self.cpu[expert]
        return int(ex.gate_up.nbytes + ex.down.nbytes)

    def _run_cpu_timed(self, hidden: np.ndarray, work: Work) -> list[tuple[np.ndarray, np.ndarray]]:
        """``_run_cpu``, timed for the offload's estimate where the work is several tokens of
        one scheme."""
        offload = self.offload
        if offload is None or len(hidden) < 2:
            return self._run_cpu(hidden, work)
        started = time.perf_counter()
        results = self._run_cpu(hidden, work)
        seconds = time.perf_counter() - started
        schemes = {self.cpu[e].scheme for e, _, _ in work}
        if len(schemes) == 1:
            offload.observe(schemes.pop(), sum(len(t) for _, t, _ in work),
                            sum(self._cpu_bytes(e) for e, _, _ in work), seconds)
        return results

    @staticmethod
    def _accumulate(shape: tuple[int, ...], results: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        # Each result's tokens are distinct (``_split``), so a fancy-indexed add is exact:
        # np.add.at, which allows repeats, took 60 ms of a 512-token prefill's 256 at
        # Qwen3-30B-A3B's shape (one layer), the 108 experts' outputs added a row at a time.
        out = np.zeros(shape, dtype=np.float32)
        for tokens, y in results:
            if len(tokens) == 1:
                out[tokens[0]] += y[0]
            else:
                out[tokens] += y
        return out

    def _decode_token(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """One token whose experts all run on the CPU (a decode step): counted, then fused."""
        tables = self.one_call_tables()
        if tables is not None:
            return rows.chosen_experts_token(*tables, np.ascontiguousarray(experts, dtype=np.int64),
                                             np.ascontiguousarray(weights, dtype=np.float32),
                                             np.ascontiguousarray(x, dtype=np.float32), vnni.stamps())
        self.counts[experts] += 1
        return self._fused_token(x, experts, weights)

    def one_call_tables(self) -> tuple | None:  # type: ignore[type-arg]
        """The per-expert tables (and counts) of ``rows.chosen_experts_token`` for this layer, or
        None where one token does not take that path: every expert on the CPU in the fused path,
        its gate/up and down in kinds of ``rows`` (the block kinds, the K-quants, iq4_xs, fp8_e4m3,
        int4), on a VNNI CPU. Built once per fused setup."""
        if self._on_device or len(self.cpu) != self.num_experts:
            return None
        return self._cpu_tables()

    def _cpu_tables(self) -> tuple | None:  # type: ignore[type-arg]
        """``one_call_tables`` for the CPU experts of any layer, also one that has device experts
        (a prompt chunk's CPU experts then take ``rows.pairs_token`` and ``rows.experts_groups``
        too): an expert not on the CPU has no offsets (-1) and another's scheme in the tables, and
        is never among the experts these calls are given."""
        fused = self._fused
        if fused is None or not vnni.HAVE_VNNI:
            return None
        cached = self._one_call
        if cached is not None and cached[0] is fused:
            return cached[1]
        scheme, file, gate_up, down = fused
        file = read_only(file)
        if isinstance(scheme, str):
            names = [scheme] * self.num_experts
        else:
            some = next(name for name in scheme if name)
            names = [name or some for name in scheme]
        pairs = [expert_schemes(name) for name in names]  # each expert's gate/up and down schemes
        gu_names, dn_names = tuple(p[0].name for p in pairs), tuple(p[1].name for p in pairs)
        tables = None
        if all(rows.kind(name) is not None for name in gu_names + dn_names):
            if self._interleaved is not None:  # the copy's schemes (int8's interleaved rows are q8_0's)
                which = self._interleaved[3]
                gu_names = tuple(interleaving.copy_scheme(n) for n in gu_names) if which[0] else gu_names
                dn_names = tuple(interleaving.copy_scheme(n) for n in dn_names) if which[1] else dn_names
            gu_kinds, gu_rows = rows.layout(gu_names, self.hidden_size)
            dn_kinds, dn_rows = rows.layout(dn_names, self.intermediate_size)
            if self._interleaved is not None:  # the copy, its offsets, its kinds, its rows' bytes (whole units)
                file, gate_up, down, which = self._interleaved
                if which[0]:
                    gu_kinds = np.full(self.num_experts, rows.INTERLEAVED[gu_names[0]], dtype=np.int64)
                    gu_rows = np.array([interleaving.copy_row_bytes(n, r) for n, r in zip(gu_names, gu_rows)],
                                       dtype=np.int64)
                if which[1]:
                    dn_kinds = np.full(self.num_experts, rows.INTERLEAVED[dn_names[0]], dtype=np.int64)
                    dn_rows = np.array([interleaving.copy_row_bytes(n, r) for n, r in zip(dn_names, dn_rows)],
                                       dtype=np.int64)
            f16, e8m0 = vnni._tables()
            biases = self._fused_biases
            none = np.zeros((1, 1), dtype=np.float32)
            tables = (file, file.view(np.float32), f16, e8m0, gu_kinds, gate_up, gu_rows, dn_kinds, down, dn_rows,
                      self.intermediate_size, self.activation == "swiglu_clamped",
                      np.float32(7.0 if self.swiglu_limit is None else self.swiglu_limit),
                      np.float32(1.702 if self.swiglu_alpha is None else self.swiglu_alpha),
                      biases[0] if biases else none, biases is not None, biases[1] if biases else none,
                      biases is not None, self.counts)
        self._one_call = (fused, tables)
        return tables

    def _fused_token(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """One token through ``experts`` (CPU experts, all in fused schemes), weighted."""
        scheme, file, gu, dn = self._fused  # type: ignore[misc]
        biases = self._fused_biases
        if not isinstance(scheme, str):
            scheme = scheme[experts].tolist()
        return experts_token(file, scheme, gu[experts], dn[experts], self.hidden_size, self.intermediate_size,
                             x, np.ascontiguousarray(weights, dtype=np.float32), activation=self.activation,
                             limit=self.swiglu_limit, alpha=self.swiglu_alpha,
                             gate_up_bias=biases[0][experts] if biases else None,
                             down_bias=biases[1][experts] if biases else None)

    def _run_cpu(self, hidden: np.ndarray, work: Work) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._fused is not None and self._interleaved is None and len(hidden) == 1 and work:
            experts = np.array([e for e, _, _ in work], dtype=np.int64)
            y = self._fused_token(hidden[0], experts, np.array([w[0] for _, _, w in work], dtype=np.float32))
            return [(np.zeros(1, dtype=np.int64), y[None, :])]
        results = []
        singles = [w for w in work if len(w[1]) == 1]
        tables = self._cpu_tables() if len(singles) > 1 else None
        if tables is not None:  # the experts of one token each in one compiled call (``rows.pairs_token``)
            tokens = np.array([t[0] for _, t, _ in singles], dtype=np.int64)
            out = rows.pairs_token(*tables[:-1], np.array([e for e, _, _ in singles], dtype=np.int64), tokens,
                                   np.array([w[0] for _, _, w in singles], dtype=np.float32),
                                   np.ascontiguousarray(hidden[tokens], dtype=np.float32), len(hidden))
            results.append((np.arange(len(hidden)), out))
            work = [w for w in work if len(w[1]) != 1]
        work = self._few_tokens(hidden, work, results)
        for e, tokens, weights in work:
            ex = self.cpu[e]
            kw = dict(activation=self.activation, gate_up_bias=ex.gate_up_bias, down_bias=ex.down_bias,
                      limit=self.swiglu_limit, alpha=self.swiglu_alpha)
            if self._interleaved is not None:
                y = self._interleaved_forward(e, hidden[tokens])
            elif len(tokens) == 1:
                y = expert_forward(ex.gate_up, ex.down, ex.scheme, hidden[tokens[0]], **kw)[None, :]
            else:
                y = expert_forward_batch(ex.gate_up, ex.down, ex.scheme, hidden[tokens], **kw)
            results.append((tokens, y * weights[:, None]))
        return results

    def _few_tokens(self, hidden: np.ndarray, work: Work, results: list[tuple[np.ndarray, np.ndarray]]) -> Work:
        """The experts of ``work`` with a few tokens each (2 up to their scheme's vector path,
        ``kernels.LANES_MIN_TOKENS``; in the interleaved copy up to its few-token tiles' end,
        ``interleave.FEW_TOKENS``), their gate/up of one kind and their down of one kind among
        the row-tile kinds (the block kinds, q4_k, q5_k, q6_k, the interleaved kinds), in one
        compiled call (``rows.experts_groups``), their outputs into ``results``; the rest of the
        work back. An expert a call, a prompt chunk's experts of 2-11 tokens (at Qwen3-30B-A3B's
        shape most of them, from about 16 tokens to a few hundred) each paid Python, two
        parallel regions' starts and numpy's activation: a 64-token prompt's prefill of two
        Qwen3-30B-A3B-shaped layers from the interleaved copy took 1.00x (Q4_K_M) and 1.13x
        (Q4_0) the stored layout's tokens/s that way, 1.07x and 1.20x in one call."""
        tables = self._cpu_tables() if len(work) > 1 else None
        if tables is None:
            return work
        gu_kinds, gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows = tables[4:10]
        by_kinds: dict[tuple[int, int], list[Any]] = {}
        for item in work:
            e = item[0]
            by_kinds.setdefault((int(gu_kinds[e]), int(dn_kinds[e])), []).append(item)
        rest: list[Any] = []
        for (gu_code, dn_code), items in by_kinds.items():
            limit = min(_few_tokens_limit(gu_code, self.hidden_size),
                        _few_tokens_limit(dn_code, self.intermediate_size))
            few = [item for item in items if 2 <= len(item[1]) < limit]
            if len(few) < 2:
                rest.extend(items)
                continue
            rest.extend(item for item in items if not 2 <= len(item[1]) < limit)
            experts = np.array([e for e, _, _ in few], dtype=np.int64)
            tokens = np.concatenate([t for _, t, _ in few]).astype(np.int64)
            per_token = np.repeat(experts, [len(t) for _, t, _ in few])
            groups = np.concatenate([[0], np.cumsum([len(t) for _, t, _ in few])]).astype(np.int64)
            file, _, f16, e8m0 = tables[:4]
            inter, clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias = tables[10:18]
            results.append((np.arange(len(hidden)), rows.experts_groups(
                file, f16, e8m0, gu_code, gu_offsets[experts], int(gu_rows[experts[0]]), dn_code, dn_offsets[experts],
                int(dn_rows[experts[0]]), inter, clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias,
                groups, per_token, np.ascontiguousarray(hidden[tokens], dtype=np.float32),
                np.concatenate([w for _, _, w in few]).astype(np.float32), tokens, len(hidden))))
        return rest

    @property
    def _on_device(self) -> bool:
        """Whether some of the layer's experts may run on the device (the plan's, cached, or
        copied for a prefill forward)."""
        return bool(self._device_index) or self.cache is not None or self.offload is not None

    def close(self) -> None:
        """Stop the worker threads and drop every reference to the bundle's memory and the device."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._prepared = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        self.cpu.clear()
        self._fused = None
        self._fused_biases = None
        self._device_weights.clear()
        self._device_index.clear()
