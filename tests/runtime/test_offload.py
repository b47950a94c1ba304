"""Prefill offload's cost model (runtime/offload.py): which CPU experts a forward copies."""

from __future__ import annotations

import pytest

from ktc.errors import ConfigError
from ktc.runtime.offload import PrefillOffload

MB = 1_000_000


def test_nothing_moves_before_the_cpu_is_measured_or_for_few_tokens():
    offload = PrefillOffload(pcie_bandwidth=25e9, cpu_bandwidth=50e9, budget_bytes=10**12)
    work = [(e, "q4_0", 100, 50 * MB) for e in range(4)]
    assert offload.choose(work, 512) == []  # q4_0's CPU time not measured yet
    offload.observe("q4_0", token_uses=400, nbytes=200 * MB, seconds=0.044)  # 4 ms reading, 0.1 ms a token
    assert offload.seconds_per_token["q4_0"] == pytest.approx(1e-4)
    assert offload.choose(work, 31) == []  # below llama.cpp's 32 tokens
    assert offload.choose(work, 512) != []


def test_copies_balance_the_link_against_the_cpu():
    """Copies run beside the CPU's experts: the choice moves the experts with the most tokens a
    byte while the longer of the two shrinks, and stops there."""
    offload = PrefillOffload(pcie_bandwidth=25e9, cpu_bandwidth=50e9, budget_bytes=10**12)
    offload.seconds_per_token["q4_0"] = 1e-4
    # 8 experts of 50 MB (2 ms over the link, 1 ms read by the CPU): 300 tokens each is 31 ms on
    # the CPU; 10 tokens 2 ms
    work = [(e, "q4_0", 300 if e < 4 else 10, 50 * MB) for e in range(8)]
    chosen = offload.choose(work, 512)
    assert chosen == [0, 1, 2, 3]  # 8 ms of copies beside 8 ms of CPU, where one more copy is longer
    assert offload.counters.experts == 4 and offload.counters.bytes_uploaded == 200 * MB
    offload.budget_bytes = 120 * MB
    assert offload.choose(work, 512) == [0, 1]  # what fits the device memory left
    slow = PrefillOffload(pcie_bandwidth=1e9, cpu_bandwidth=50e9, budget_bytes=10**12)
    slow.seconds_per_token["q4_0"] = 1e-4
    # 50 ms a copy: two (100 ms) beside the CPU's 70 ms, where the CPU alone took 132
    assert slow.choose(work, 512) == [0, 1]


def test_copies_made_a_layer_ahead_share_the_budget():
    """With copies a layer ahead, a forward's own take at most half the budget and those made
    ahead a quarter (a forward holds both beside the next layer's made ahead); they are counted
    apart."""
    offload = PrefillOffload(pcie_bandwidth=25e9, cpu_bandwidth=50e9, budget_bytes=240 * MB)
    offload.seconds_per_token["q4_0"] = 1e-4
    offload.lookahead = True
    work = [(e, "q4_0", 300, 50 * MB) for e in range(8)]
    assert offload.choose(work, 512) == [0, 1]  # 100 MB of 120
    assert offload.choose(work, 512, ahead=True) == [0]  # 50 MB of 60
    counters = offload.counters
    assert (counters.forwards, counters.experts, counters.ahead, counters.bytes_uploaded) == (1, 2, 1, 150 * MB)


def test_bad_settings_are_refused():
    for kwargs in (dict(pcie_bandwidth=0, cpu_bandwidth=1, budget_bytes=0),
                   dict(pcie_bandwidth=1, cpu_bandwidth=1, budget_bytes=-1),
                   dict(pcie_bandwidth=1, cpu_bandwidth=1, budget_bytes=0, min_tokens=0)):
        with pytest.raises(ConfigError):
            PrefillOffload(**kwargs)


def test_the_copies_own_rate_replaces_the_profiles_once_measured():
    """A link the profile calls fast but whose copies measure slow: after the first measured
    copy the choice uses the measured rate, and moves nothing where copies lose."""
    offload = PrefillOffload(pcie_bandwidth=25e9, cpu_bandwidth=50e9, budget_bytes=10**12)
    offload.seconds_per_token["q4_0"] = 1e-4
    work = [(e, "q4_0", 300 if e < 4 else 10, 50 * MB) for e in range(8)]
    assert offload.choose(work, 512) == [0, 1, 2, 3]
    offload.observe_copy(100 * MB, 0.5)  # 0.2 GB/s: 250 ms a copy, against 31 ms on the CPU
    assert offload.copy_bandwidth == pytest.approx(0.2e9) and offload.counters.copies_measured == 1
    assert offload.choose(work, 512) == []
    offload.observe_copy(100 * MB, 0.002)  # a faster copy moves the average by the smoothing
    assert offload.copy_bandwidth == pytest.approx(0.2e9 + 0.3 * (50e9 - 0.2e9))
    offload.observe_copy(0, 1.0)  # nothing copied: no measurement
    assert offload.counters.copies_measured == 2
