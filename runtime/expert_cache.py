"""A device expert cache's policy: which of a layer's experts hold its device slots.

Besides the plan's resident experts, a layer may keep a pool of slots filled on demand. This
module decides, token by token, what a use of an expert is (a hit, or a miss that runs on the CPU
for this token) and which misses to upload into which slot; it moves no bytes itself, so the
runtime and the replay benchmark (``benchmarks/stream.py``) share it.

Replacement is frequency with decay, seeded by the profile: each expert's score is its
profile frequency times the decay's horizon plus its uses since, each use counting
``decay ** age`` (age in tokens). A miss is uploaded only when a slot is free or its score
beats the lowest in the pool by ``margin`` plus ``confidence`` times the square root of the two
scores summed (that slot's expert is evicted; the two decayed counts' noise, as of Poisson
counts): an expert used once among hot ones does not push them out, two of about the same
popularity do not swap places on chance, and a drift in routing moves the pool as the new experts'
uses outweigh the old ones' decayed counts. Uploads take time: a slot is usable only once its
upload has landed (the time the caller gives ``LayerCache.uploaded``), and until then a use is
still a miss. A miss never waits for an upload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import ConfigError


@dataclass
class CacheCounters:
    """Uses by outcome, and the uploads and evictions they caused."""

    hits: int = 0
    misses: int = 0
    late: int = 0  # misses whose expert's upload was on its way
    uploads: int = 0
    evictions: int = 0
    bytes_uploaded: int = 0
    prefetched: int = 0  # uploads a guess started (``prefetch``), among ``uploads``
    guessed: int = 0  # experts guessed for a step, and of those the ones the step used
    guess_used: int = 0

    @property
    def uses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0


class LayerCache:
    """One layer's device slots for experts of ``expert_bytes`` bytes each.

    ``resident``: the plan's experts on the device for good (always hits; they take no slot).
    ``slots``: how many more experts the pool holds. ``prior``: the profile's use frequency of
    each of the layer's ``num_experts`` experts (any scale; uniform when None). ``decay``: the
    weight of a use one token older (0 < decay < 1). ``margin``: how many decayed uses a miss
    must score above the pool's lowest to replace it. ``initial``: experts already in the pool at
    the start (the best of the prior by default), as the plan would place them. ``eligible``:
    the experts a slot may hold (every non-resident one by default; a runtime whose slots are of
    one scheme leaves out the experts of another).

    The defaults are the best of those tried in ``benchmarks/stream.py``'s replay (decay 0.98,
    0.99, 0.995; margin 1, 2, 4): with a margin of 1 (decay 0.99) the pool churned on routing
    that did not drift (Qwen3-30B-A3B's scale, half the experts' bytes in VRAM: 0.85x the static
    plan, the uploads' reads slowing the CPU's experts), with 4 0.98-1.00x, and drifting routing
    gained most with the shorter memory. ``confidence`` 1 (the noise term) was added after: in
    the same replay (1,024 tokens, both scales, 10/25/50% of the bytes) it kept every steady
    case at 1.000x the static plan (0.980-1.000x without it) for a smaller drifting gain (worst
    case 1.086x against 1.100x; 0.7, 0.8, margins 0-3 and decay 0.97 left a steady case below
    1.0x, 2 cut the drifting gains further)."""

    def __init__(self, num_experts: int, slots: int, expert_bytes: int, *, resident: tuple[int, ...] = (),
                 prior: np.ndarray | None = None, decay: float = 0.98, margin: float = 4.0,
                 initial: tuple[int, ...] | None = None, eligible: tuple[int, ...] | None = None,
                 confidence: float = 1.0) -> None:
        if slots < 0 or num_experts < 1 or expert_bytes < 0:
            raise ConfigError(f"a layer cache needs experts (got {num_experts}), slots >= 0 (got {slots}) "
                              f"and expert bytes >= 0 (got {expert_bytes})")
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"the cache's decay must be between 0 and 1, not {decay}")
        self.num_experts = num_experts
        self.slots = slots
        self.expert_bytes = expert_bytes
        self.decay = decay
        self.margin = margin
        self.confidence = confidence
        self.resident = frozenset(int(e) for e in resident)
        if any(not 0 <= e < num_experts for e in self.resident):
            raise ConfigError(f"resident experts {sorted(self.resident)} outside 0-{num_experts - 1}")
        self.eligible = (frozenset(range(num_experts)) if eligible is None
                         else frozenset(int(e) for e in eligible)) - self.resident
        freq = np.ones(num_experts) if prior is None else np.asarray(prior, dtype=np.float64).reshape(-1)
        if freq.shape != (num_experts,) or not np.all(np.isfinite(freq)) or (freq < 0).any():
            raise ConfigError(f"the prior must hold {num_experts} finite frequencies >= 0")
        total = freq.sum()
        freq = freq / total if total > 0 else np.full(num_experts, 1.0 / num_experts)
        # The prior counts as this many tokens of uses (the decay's horizon), at the time 0.
        self._score = freq / (1.0 - decay)
        self._stamp = np.zeros(num_experts, dtype=np.int64)  # the token each score was last brought to
        self.now = 0
        self.pool: dict[int, float] = {}  # expert -> the time its upload is done
        if initial is None:
            order = [int(e) for e in np.argsort(-freq, kind="stable") if int(e) in self.eligible]
            initial = tuple(order[:slots])
        if len(initial) > slots or any(e not in self.eligible for e in initial):
            raise ConfigError(f"the initial pool {initial} does not fit {slots} slots beside the residents")
        for e in initial:
            self.pool[int(e)] = 0.0
        self.counters = CacheCounters()
        self.started: list[tuple[int, int | None]] = []  # the last step's uploads: (expert, evicted)
        self._guess: frozenset[int] = frozenset()  # the last ``prefetch``'s experts, for the next step

    @property
    def device_bytes(self) -> int:
        """The pool's bytes on the device (the residents' are the plan's)."""
        return self.slots * self.expert_bytes

    def score(self, expert: int) -> float:
        """The expert's decayed use count at the current token."""
        return float(self._score[expert] * self.decay ** (self.now - self._stamp[expert]))

    def _scores(self, experts: Any) -> np.ndarray:
        """``score`` of each of ``experts``."""
        index = np.asarray(experts, dtype=np.int64)
        return self._score[index] * self.decay ** (self.now - self._stamp[index]).astype(np.float64)

    def step(self, experts: np.ndarray, at: float = 0.0) -> tuple[list[int], list[int]]:
        """One token's uses of ``experts`` (distinct) at time ``at`` (seconds): returns (the
        experts that hit, the experts that miss and run on the CPU this token). The misses this
        step starts uploading are ``self.started`` (each with the expert it evicts, or None);
        each stays a miss until ``uploaded`` gives the time it lands."""
        self.now += 1
        index = np.asarray(experts, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self.num_experts):
            bad = int(index[(index < 0) | (index >= self.num_experts)][0])
            raise ConfigError(f"expert {bad} outside 0-{self.num_experts - 1}")
        # every used expert's score brought to this token and counted once more, in one
        # operation (an expert a time, each a numpy scalar operation, a step of 8 experts with 13
        # slots took 27 us against 25; the replay's figures are the same to the last digit)
        self._score[index] = self._scores(index) + 1.0
        self._stamp[index] = self.now
        chosen = index.tolist()
        hits, misses = [], []
        for e in chosen:
            ready = self.pool.get(e)
            if e in self.resident or (ready is not None and ready <= at):
                hits.append(e)
            else:
                misses.append(e)
                self.counters.late += ready is not None
        self.counters.hits += len(hits)
        self.counters.misses += len(misses)
        used = set(chosen)
        if self._guess:
            self.counters.guessed += len(self._guess)
            self.counters.guess_used += len(self._guess & used)
            self._guess = frozenset()
        self.started = self._admit(misses, used)
        return hits, misses

    def prefetch(self, experts: np.ndarray) -> list[tuple[int, int | None]]:
        """A guess (pre-gating) at the next step's ``experts``: the ones not pooled are admitted
        as a miss of that step would be, scored as if used once more, and start uploading now,
        a layer ahead (returned as ``started`` is; the guessed experts already pooled are not
        evicted for them). The next ``step`` counts how many of the guess it used."""
        guess = frozenset(int(e) for e in experts)
        self._guess = guess
        changed = list(guess)
        saved = self._score[changed].copy(), self._stamp[changed].copy()
        for e in changed:  # as the next step will score them
            self._score[e] = self.score(e) + 1.0
            self._stamp[e] = self.now
        try:
            started = self._admit([e for e in sorted(guess) if e not in self.resident], set(guess))
        finally:  # the uses themselves are counted by the step that makes them
            self._score[changed], self._stamp[changed] = saved
        self.counters.prefetched += len(started)
        return started

    def _admit(self, misses: list[int], used: set[int]) -> list[tuple[int, int | None]]:
        # Each miss not already on its way in, best score first, takes a free slot or the
        # lowest-scored pooled expert's when it scores ``margin`` higher (never one this token
        # uses).
        # Scores do not change inside one admission and the candidates only shrink (an admitted
        # expert is used this token), so the victims come in one sorted order: the pool's scores
        # are computed once (a score a comparison cost a decode step 0.16 ms of Python on a
        # device with 13 slots a layer).
        started: list[tuple[int, int | None]] = []
        waiting = [m for m in misses if m not in self.pool and m in self.eligible]
        if not waiting:
            return started
        wanted = self._scores(waiting)
        candidates = np.array([p for p in self.pool if p not in used], dtype=np.int64)
        scores = self._scores(candidates)
        order = np.lexsort((candidates, scores))  # the lowest score first, then the lowest number
        at = 0
        for i in np.argsort(-wanted, kind="stable").tolist():
            e = waiting[i]
            if len(self.pool) < self.slots:
                started.append((e, None))
            else:
                if at == len(order):
                    break
                victim = int(candidates[order[at]])
                low, high = float(scores[order[at]]), float(wanted[i])
                if low + self.margin + self.confidence * math.sqrt(low + high) >= high:
                    continue
                at += 1
                del self.pool[victim]
                self.counters.evictions += 1
                started.append((e, victim))
            self.pool[e] = float("inf")  # on its way: a miss until ``uploaded`` says when it lands
            self.counters.uploads += 1
            self.counters.bytes_uploaded += self.expert_bytes
        return started

    def uploaded(self, expert: int, at: float) -> None:
        """The upload of ``expert`` is done at time ``at``: later uses hit."""
        if expert in self.pool:
            self.pool[expert] = at


@dataclass
class Replay:
    """What ``replay_trace`` found: seconds in the experts, uses on the device, all uses, uploads,
    and the seconds each layer took."""

    seconds: float
    hits: int
    uses: int
    uploaded: int  # experts
    layer_seconds: np.ndarray


def replay_trace(routes: np.ndarray, caches: list[LayerCache] | None, resident: list[frozenset[int]],
                 device_seconds: np.ndarray, cpu_seconds: np.ndarray, sync_seconds: np.ndarray,
                 upload_seconds: float, cpu_bandwidth: float, pcie_bandwidth: float,
                 device_step_seconds: float = 0.0) -> Replay:
    """A routing trace ([tokens, layers, k] experts) through ``caches`` (one a layer; None: the
    static ``resident`` sets alone), timed as the planner does: per layer and token the experts
    on the device (resident or a slot that hit) at ``device_seconds[layer, expert]``, the others
    at ``cpu_seconds``, the slower of the two sides, plus ``sync_seconds[layer]`` where the CPU
    has any and ``device_step_seconds`` where the device has any. Uploads cross PCIe one after another (``upload_seconds`` each), land when done,
    and while one is under way the CPU's experts read at ``cpu_bandwidth - pcie_bandwidth`` (the
    copies read the same host memory; at least a tenth of it). The planner's split between
    residents and slots (``ktc.streaming``) and ``benchmarks/stream.py`` replay through this."""
    slowed = cpu_bandwidth / max(cpu_bandwidth - pcie_bandwidth, 0.1 * cpu_bandwidth)
    clock, link_free, hits, uses, uploaded = 0.0, 0.0, 0, 0, 0
    device_rows, cpu_rows, syncs = device_seconds.tolist(), cpu_seconds.tolist(), np.asarray(sync_seconds).tolist()
    per_layer = [0.0] * len(syncs)
    for token in routes:
        for li, experts in enumerate(token):
            if caches is not None:
                cache = caches[li]
                on_device, on_cpu = cache.step(experts, clock)
                for e, _ in cache.started:
                    link_free = max(link_free, clock) + upload_seconds
                    cache.uploaded(e, link_free)
                    uploaded += 1
            else:
                on_device = [e for e in experts.tolist() if e in resident[li]]
                on_cpu = [e for e in experts.tolist() if e not in resident[li]]
            hits += len(on_device)
            uses += len(experts)
            cpu = sum(cpu_rows[li][e] for e in on_cpu) * (slowed if link_free > clock else 1.0)
            spent = max(sum(device_rows[li][e] for e in on_device), cpu) + (syncs[li] if on_cpu else 0.0) \
                + (device_step_seconds if on_device else 0.0)
            clock += spent
            per_layer[li] += spent
    return Replay(clock, hits, uses, uploaded, np.array(per_layer))
