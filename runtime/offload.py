"""Prefill offload: a forward of many tokens copies the CPU experts it uses to the device and
computes them there, where the copy is faster than the CPU's work (llama.cpp does the same for
batches of 32 tokens or more, copying every expert the batch uses).

The choice is per expert, by a cost model: a CPU expert used by ``n`` tokens costs its bytes over
the CPU's read bandwidth plus ``n`` times the seconds one token takes through it beyond that
read; a copied one costs its bytes over the copies' rate (the device's own product is left
out: at prefill sizes it is two orders faster than either). That rate is the profile's PCIe
bandwidth until the first copy, then measured: on an H200 machine whose page-locked copies ran
at 55 GB/s, copies from the bundle's map through a contiguous stack, beside the CPU's experts,
ran several times slower, and a 512-token prompt's offload at Qwen3-30B-A3B's shape took twice
the CPU's time. The CPU's experts and the copies
run at the same time, so experts move to the device, the most tokens per byte first, while that
shortens the longer of the two. The seconds a token takes on the CPU are measured, not assumed:
every CPU forward of several tokens updates them per scheme (a moving average), and until the
first such forward of a scheme has run nothing of it is copied. The copies of one forward take
at most ``budget_bytes`` of device memory and are freed when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ktc.errors import ConfigError


# llama.cpp's threshold for the same copies: the fewest tokens a forward needs where nothing
# better is known (``ktc.streaming`` plans one from the CPU's measured prefill rate)
LLAMA_CPP_MIN_TOKENS = 32


@dataclass
class OffloadCounters:
    forwards: int = 0  # forwards of at least ``min_tokens`` tokens with CPU experts
    offloaded: int = 0  # of those, the ones that copied experts to the device
    experts: int = 0  # experts copied (one per forward that copied it)
    bytes_uploaded: int = 0
    measured: int = 0  # CPU forwards that updated the estimate
    ahead: int = 0  # experts copied a layer ahead (pre-gating's guess: ``ExpertSet.prepare_offload``)
    ahead_used: int = 0  # of those, the ones their layer's forward then chose
    copies_measured: int = 0  # copies that updated the copy rate


class PrefillOffload:
    """The offload choice of a model's MoE layers (one instance shared by all of them).

    ``pcie_bandwidth`` and ``cpu_bandwidth`` in bytes/s (the plan's hardware profile's),
    ``budget_bytes`` the device memory a forward's copies may take, ``min_tokens`` the fewest
    tokens a forward must have for any copy (llama.cpp's 32), ``smoothing`` the weight of each
    new measurement of the CPU's seconds per token."""

    def __init__(self, pcie_bandwidth: float, cpu_bandwidth: float, budget_bytes: int, *, min_tokens: int = LLAMA_CPP_MIN_TOKENS,
                 smoothing: float = 0.3) -> None:
        if not (pcie_bandwidth > 0 and cpu_bandwidth > 0) or budget_bytes < 0 or min_tokens < 1:
            raise ConfigError("prefill offload needs positive bandwidths, a budget >= 0 and min_tokens >= 1")
        self.pcie_bandwidth = float(pcie_bandwidth)
        self.cpu_bandwidth = float(cpu_bandwidth)
        self.budget_bytes = int(budget_bytes)
        self.min_tokens = min_tokens
        self.smoothing = smoothing
        self.seconds_per_token: dict[str, float] = {}  # scheme -> CPU seconds a token through one expert
        # bytes/s the copies reach, from the host's map to the device: the profile's PCIe rate
        # until the first copy is measured (``observe_copy``), then the copies' own (a moving
        # average: the host copies into a contiguous stack first, and shares the memory with the
        # CPU's experts meanwhile)
        self.copy_bandwidth = self.pcie_bandwidth
        self.lookahead = False  # copies are also made a layer ahead (set by the model that makes them)
        self.counters = OffloadCounters()

    def cpu_seconds(self, scheme: str, tokens: int, nbytes: int) -> float | None:
        """The CPU's predicted time for one expert of ``nbytes`` through ``tokens`` tokens (None
        before the scheme has been measured)."""
        per_token = self.seconds_per_token.get(scheme)
        return None if per_token is None else nbytes / self.cpu_bandwidth + tokens * per_token

    def choose(self, work: list[tuple[int, str, int, int]], tokens: int, *, ahead: bool = False) -> list[int]:
        """Of ``work`` (expert, scheme, its tokens, its bytes) in a forward of ``tokens`` tokens,
        the experts to copy to the device; ``ahead``: for the next layer's guessed forward (counted
        apart). Where copies are made a layer ahead (``lookahead``), two layers' copies coexist:
        a forward's own then take half the budget, those made ahead a quarter."""
        if tokens < self.min_tokens or not work:
            return []
        if not ahead:
            self.counters.forwards += 1
        costs = []
        for e, scheme, n, nbytes in work:
            cpu = self.cpu_seconds(scheme, n, nbytes)
            if cpu is None:
                return []  # this scheme's CPU time is measured by this forward first
            costs.append((e, cpu, nbytes))
        cpu_left = sum(c for _, c, _ in costs)
        copying, used, chosen = 0.0, 0, []
        # with copies a layer ahead, a forward holds its own copies (a half), the ones made ahead
        # for it (a quarter) and the next layer's made ahead meanwhile (a quarter)
        budget = self.budget_bytes // (4 if ahead else 2) if self.lookahead else self.budget_bytes
        for e, cpu, nbytes in sorted(costs, key=lambda c: -c[1] / max(c[2], 1)):
            copy = nbytes / self.copy_bandwidth
            if used + nbytes > budget:
                continue
            if max(cpu_left - cpu, copying + copy) < max(cpu_left, copying):
                cpu_left -= cpu
                copying += copy
                used += nbytes
                chosen.append(e)
        if chosen:
            self.counters.bytes_uploaded += used
            if ahead:
                self.counters.ahead += len(chosen)
            else:
                self.counters.offloaded += 1
                self.counters.experts += len(chosen)
        return chosen

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        """Copies of ``nbytes`` to the device took ``seconds`` (until on the device)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = None if self.counters.copies_measured == 0 else self.copy_bandwidth
        self.copy_bandwidth = rate if old is None else old + self.smoothing * (rate - old)
        self.counters.copies_measured += 1

    def observe(self, scheme: str, token_uses: int, nbytes: int, seconds: float) -> None:
        """A CPU forward of ``scheme``'s experts: ``token_uses`` tokens through experts (summed
        over them) of ``nbytes`` bytes in all took ``seconds``."""
        if token_uses < 2 or seconds <= 0:
            return
        per_token = max(seconds - nbytes / self.cpu_bandwidth, 0.0) / token_uses
        old = self.seconds_per_token.get(scheme)
        self.seconds_per_token[scheme] = per_token if old is None else old + self.smoothing * (per_token - old)
        self.counters.measured += 1
