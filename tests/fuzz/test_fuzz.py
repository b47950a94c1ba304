"""A small run of the mutation fuzzer (``harness.py``; its module docstring says how to run the
long one): every reader and the bundle, through the command line, in this process."""

from __future__ import annotations

import harness


def test_mutated_inputs_are_rejected_cleanly(tmp_path):
    tallies = harness.fuzz(cases=50, warm_up=10, work=str(tmp_path), timeout=60)
    report = harness.report(tallies)
    assert set(tallies) == set(harness.FORMATS)
    for fmt, tally in tallies.items():
        assert tally.cases == 50
        assert tally.crash == 0 and tally.hang == 0, report
        assert tally.rejected > 0, report  # the mutations reach the readers' checks
        # A length or count made huge by a mutation must not turn into an allocation of that
        # size: a gross bound here (the long run's figures are in the README).
        assert tally.max_growth_bytes < 32 * 2**20, report
    assert tallies["bundle"].accepted == 0, report  # every byte of a bundle is checksummed
