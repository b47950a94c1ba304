"""Experts paged in ahead of their layer: where a bundle's experts are read from disk (their pages
not in the page cache, as a disk tier leaves them), a layer's experts are asked for one layer
early, guessed by pre-gating (the next MoE layer's router on this layer's input, its top k for
each token, as ``ktc profile`` measures it).

``page_in`` asks the kernel to read byte ranges of the bundle's map (``madvise(MADV_WILLNEED)``:
it starts the reads and returns; the layer's kernels then find the pages in memory instead of
faulting on each). ``resident_share`` says which share of a range's pages are in memory
(``mincore``). Python's ``mmap`` has ``madvise`` but not ``mincore``, so that is called through
ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.bundle import Bundle
from ktc.ir import is_input_embedding

from .kernels import exact_bf16, matvec

PAGE = mmap.PAGESIZE


def expert_ranges(bundle: Bundle, layer: int, experts: Iterable[int]) -> list[tuple[int, int]]:
    """(file offset, bytes) of the gate/up and down matrices of ``experts`` of ``layer``
    (compressed experts, which have no place in the map, left out)."""
    ranges = []
    for e in experts:
        for part in ("gate_up", "down"):
            t = bundle.tensors.get(f"layers.{layer}.experts.{int(e)}.{part}")
            if t is not None and t.offset is not None:
                ranges.append((t.offset, t.nbytes))
    return ranges


def dense_ranges(bundle: Bundle) -> list[tuple[int, int]]:
    """(file offset, bytes) of the tensors every decode step reads whole: all but the experts and
    an input embedding table of which a token reads one row (one tied to ``lm_head`` is read
    whole, and kept)."""
    tied = bool(bundle.manifest["model"]["config"].get("tie_word_embeddings"))
    return [(t.offset, t.nbytes) for name, t in bundle.tensors.items()
            if t.role != "expert" and t.offset is not None and (tied or not is_input_embedding(name))]


def pregate(hidden: np.ndarray, router: np.ndarray, k: int) -> np.ndarray:
    """Each token's guess [tokens, k] at the experts of the MoE layer whose ``router`` (float32
    [experts, hidden]) is given, from the hidden states entering the MoE layer before it: the k
    largest logits (the router's choice before its softmax or sigmoid), in no order."""
    return top_k(hidden @ router.T, k)


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The indices [tokens, k] of each row's k largest ``logits``, in no order."""
    if k >= logits.shape[1]:
        return np.broadcast_to(np.arange(logits.shape[1]), logits.shape)
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def _pages(start: int, nbytes: int) -> tuple[int, int]:
    first = start // PAGE * PAGE
    return first, (start + nbytes - first + PAGE - 1) // PAGE * PAGE


def _spans(size: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first byte, bytes) of the whole pages that hold ``ranges``, within a map of ``size``
    bytes (empty ones left out)."""
    spans = []
    for start, nbytes in ranges:
        first, length = _pages(start, nbytes)
        length = min(length, size - first)
        if length > 0:
            spans.append((first, length))
    return spans


def page_in(bundle: Bundle, ranges: Iterable[tuple[int, int]]) -> int:
    """Ask for the pages of ``ranges`` of the bundle's map to be read (returns at once); the
    bytes asked for."""
    spans = _spans(bundle.file_view().shape[0], ranges)
    for first, length in spans:
        bundle.advise(mmap.MADV_WILLNEED, first, length)
    return sum(length for _, length in spans)


def read_in(bundle: Bundle, ranges: Iterable[tuple[int, int]], *, lock: bool = False) -> tuple[str, int, str]:
    """Read the pages of ``ranges`` in: ``madvise(MADV_WILLNEED)``, which lets the page cache
    evict them again under pressure, or with ``lock`` ``mlock`` where the OS allows it (it keeps
    them from eviction until the map goes; an unprivileged process may lock only
    ``RLIMIT_MEMLOCK`` bytes, often 8 MiB, and is then given the former). Returns (the method,
    the bytes, why the fallback where it was taken).

    Not locking is the default: under a memory limit that the model's weights did not fit
    (``benchmarks/ram_short.py``), decode ran a third as fast with the plan's RAM set locked as
    with it read in alone (``docs/runtime.md``)."""
    view = bundle.file_view()
    spans = _spans(view.shape[0], ranges)
    total = sum(length for _, length in spans)
    if not lock:
        page_in(bundle, spans)
        return "willneed", total, ""
    base = view.ctypes.data
    libc = _libc()
    for i, (first, length) in enumerate(spans):
        if libc.mlock(ctypes.c_void_p(base + first), ctypes.c_size_t(length)) != 0:
            reason = os.strerror(ctypes.get_errno())
            for done, done_length in spans[:i]:
                libc.munlock(ctypes.c_void_p(base + done), ctypes.c_size_t(done_length))
            page_in(bundle, spans)
            return "willneed", total, f"mlock refused ({reason}; RLIMIT_MEMLOCK or no CAP_IPC_LOCK)"
    return "mlock", total, ""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def resident_share(bundle: Bundle, ranges: Iterable[tuple[int, int]]) -> float:
    """The share of the pages of ``ranges`` that are in memory now (``mincore``)."""
    view = bundle.file_view()
    base = view.ctypes.data
    libc = _libc()
    resident = total = 0
    for first, length in _spans(view.shape[0], ranges):
        flags = (ctypes.c_ubyte * ((length + PAGE - 1) // PAGE))()
        if libc.mincore(ctypes.c_void_p(base + first), ctypes.c_size_t(length), flags) != 0:
            raise KtcError(f"mincore failed: {os.strerror(ctypes.get_errno())}", path=bundle.path)
        pages = np.frombuffer(flags, np.uint8)
        resident += int((pages & 1).sum())
        total += pages.size
    return resident / total if total else 1.0


class Prefetcher:
    """Pre-gating prefetch over a model's MoE layers (their ``ExpertSet``s, in order): each
    layer's forward, before its experts run, pages in the experts the next layer's router
    (``routers[i + 1]``, float32 [experts, hidden]) picks for its tokens, and where the next
    layer has device cache slots (``ExpertSet.cache``), starts copying them there
    (``DeviceSlots.prefetch``); where it has the prefill offload, starts the copies it would
    choose for a forward so routed (``ExpertSet.prepare_offload``: the offload's copies double
    buffered across layers). ``asked`` counts the bytes asked for, ``guesses`` the experts a
    layer at a time (``keep_guesses``). ``accuracy`` scores the guesses: of the experts a layer
    used after a guess for it (its ``counts`` moved, until the next guess for it), the share the
    guess named (``used`` and ``named`` hold the guesses already followed by another).

    ``paged``: for each layer (decoder index), a boolean mask of the experts whose pages are
    worth asking for (a disk tier's: those on disk; the rest are in memory already); None asks
    for every guessed expert. With it, a layer with none of them, no cache slots and no offload
    is not guessed, and its routing not scored. A layer's pages are asked for only while its
    guesses of them are used often enough: ``precision(layer)``, the share of the pageable
    experts guessed that the layer then used (decayed by ``DECAY`` a guess, starting at one use
    of one), at least ``min_precision``. A page-in that is used spares the layer a read in its
    critical path; one that is not costs as much of the disk's time and evicts as many cached
    pages: about even at one half. ``benchmarks/ram_short.py``'s random model, whose guesses
    named about a quarter of the experts a layer used, decoded 0.86x as fast asking for every
    guessed expert's pages as asking for none (``docs/runtime.md``). The guesses go on being
    made and scored while a layer does not ask, so it asks again once they are used;
    ``skipped`` counts the guesses whose pages were not asked for."""

    DECAY = 0.9

    def __init__(self, bundle: Bundle, layers: list[Any], routers: list[np.ndarray], top_k: int, *,
                 page: bool = True, keep_guesses: bool = True, paged: dict[int, np.ndarray] | None = None,
                 min_precision: float = 0.5) -> None:
        if len(routers) != len(layers):
            raise KtcError(f"{len(routers)} routers for {len(layers)} MoE layers")
        self.bundle = bundle
        self.layers = layers
        self.page = page
        self.keep_guesses = keep_guesses
        self.asked = 0
        self.guesses: list[tuple[int, np.ndarray]] = []  # (the layer guessed for, its experts)
        self.used = self.named = 0
        self.skipped = 0
        self.paged = paged
        # the layers a disk mask leaves nothing to ask for (looked up each guess, not recomputed)
        self._nothing_paged = frozenset(layer for layer, mask in (paged or {}).items() if not mask.any())
        self.min_precision = min_precision
        # layer -> (its guess, its counts then, the guess's pageable experts), the guesses as masks
        # over the layer's experts (a decode step guesses every layer but the first: numpy's set
        # operations on the experts' numbers took about 15 us of a guess)
        self._open: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._hits: dict[int, tuple[float, float]] = {}  # layer -> (decayed uses, decayed guesses) of pageable experts
        self.top_k = top_k
        self._next = {layers[i].layer: layers[i + 1].layer for i in range(len(layers) - 1)}
        self._by_layer = {experts.layer: (experts, router) for experts, router in zip(layers, routers)}
        # One token's guess through the CPU kernels, from the router's bf16 bits where they hold
        # it exactly (a trained router's, as a GGUF widens to f32): numpy's product of a
        # Qwen3-30B-A3B-shaped float32 router (1 MB) from memory took 70-79 us, the bf16
        # kernel's 22-27 (benchmarks/pregate.py).
        self._one_token = {}
        for experts, router in zip(layers, routers):
            weights = exact_bf16(router)
            self._one_token[experts.layer] = (weights, "bf16" if weights.dtype == np.uint16 else "f32")
        self._installed = []
        for i in range(len(layers) - 1):
            observe = self._observer(layers[i].layer)
            layers[i].observers.append(observe)
            self._installed.append((layers[i], observe))

    def _observer(self, layer: int):  # type: ignore[no-untyped-def]
        def observe(hidden: np.ndarray, idx: np.ndarray) -> None:
            self.guess(self._next[layer], hidden)
        return observe

    def guess(self, layer: int, hidden: np.ndarray) -> None:
        """Guess the experts of MoE layer ``layer`` (a decoder layer index; nothing where it is
        not a MoE layer) for the hidden states ``hidden`` [tokens, hidden] that will reach it,
        page them in and start their copies into its cache slots. ``ExpertSet`` forwards call it
        through their observers; ktc's compiled decode steps between layers
        (``FastDecode.hooks``)."""
        found = self._by_layer.get(layer)
        if found is None:
            return
        nxt, router = found
        if layer in self._nothing_paged and getattr(nxt, "cache", None) is None \
                and getattr(nxt, "offload", None) is None:
            return  # nothing to ask for or to copy: not guessed (nor scored)
        if hidden.shape[0] == 1:
            weights, scheme = self._one_token[layer]
            per_token = top_k(matvec(weights, scheme, hidden[0])[None, :], self.top_k)
        else:
            per_token = pregate(hidden, router, self.top_k)
        guess = np.zeros(router.shape[0], dtype=bool)
        guess[per_token] = True
        self._settle(layer)
        pageable = guess if self.paged is None else guess & self.paged[layer]
        self._open[layer] = (guess, nxt.counts.copy(), pageable)
        if self.keep_guesses:
            self.guesses.append((layer, np.flatnonzero(guess)))
        if self.page and pageable.any():
            if self.precision(layer) >= self.min_precision:
                self.asked += page_in(self.bundle, expert_ranges(self.bundle, layer, np.flatnonzero(pageable)))
            else:
                self.skipped += 1
        cache = getattr(nxt, "cache", None)
        if cache is not None:
            cache.prefetch(np.flatnonzero(guess))
        if getattr(nxt, "offload", None) is not None:  # a prefill forward: its copies a layer ahead
            nxt.prepare_offload(per_token)

    def _score(self, layer: int) -> tuple[int, int]:
        """(experts used, of them named) since the open guess for ``layer``."""
        guess, before, _ = self._open[layer]
        chosen = self._by_layer[layer][0].counts != before
        return int(np.count_nonzero(chosen)), int(np.count_nonzero(chosen & guess))

    def _settle(self, layer: int) -> None:
        opened = self._open.pop(layer, None)
        if opened is None:
            return
        guess, before, pageable = opened
        chosen = self._by_layer[layer][0].counts != before
        used = int(np.count_nonzero(chosen))
        self.used += used
        self.named += int(np.count_nonzero(chosen & guess))
        tries = int(np.count_nonzero(pageable))
        if tries and used:  # a guess the layer did not run after is not scored
            hits, before_tries = self._hits.get(layer, (1.0, 1.0))
            self._hits[layer] = (self.DECAY * hits + int(np.count_nonzero(chosen & pageable)),
                                 self.DECAY * before_tries + tries)

    def precision(self, layer: int) -> float:
        """The decayed share of ``layer``'s guessed pageable experts that it then used (1.0
        before any is scored)."""
        hits, tries = self._hits.get(layer, (1.0, 1.0))
        return hits / tries

    @property
    def accuracy(self) -> float | None:
        """The share of the experts the layers used that the guesses named, the open guesses
        included (None before any use)."""
        scores = [self._score(layer) for layer in self._open]
        used = self.used + sum(u for u, _ in scores)
        return (self.named + sum(n for _, n in scores)) / used if used else None

    def close(self) -> None:
        for experts, observe in self._installed:
            if observe in experts.observers:
                experts.observers.remove(observe)
        self._installed.clear()
