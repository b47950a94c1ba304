"""The sampler: greedy, top-k, top-p, seeds (``runtime.generate.sample``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ktc.errors import KtcError  # noqa: E402
from ktc.runtime.generate import Sampling, sample  # noqa: E402


def _logits(probs: list[float], vocab: int = 1000) -> torch.Tensor:
    """Logits of a vocabulary whose first tokens, shuffled to ids 7, 500, 3, ..., have ``probs``
    and whose other tokens are all but impossible."""
    logits = torch.full((vocab,), -60.0)
    for token, p in zip(_IDS, probs):
        logits[token] = float(torch.log(torch.tensor(p)))
    return logits


_IDS = (7, 500, 3, 999, 42)


def _draws(logits: torch.Tensor, sampling: Sampling, n: int = 400) -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return [sample(logits, sampling, generator) for _ in range(n)]


def test_greedy_takes_the_largest() -> None:
    assert sample(_logits([0.2, 0.5, 0.3]), Sampling(temperature=0), torch.Generator()) == 500


def test_top_k_draws_only_among_the_k_most_likely() -> None:
    drawn = set(_draws(_logits([0.3, 0.25, 0.2, 0.15, 0.1]), Sampling(temperature=1.0, top_k=2, top_p=1.0)))
    assert drawn == {7, 500}


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass() -> None:
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=0, top_p=0.7))) == {7, 500}
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=0, top_p=0.4))) == {7}  # the first always stays
    # top-k first, then top-p among those k
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=3, top_p=0.9))) == {7, 500, 3}


def test_draws_follow_the_probabilities() -> None:
    drawn = _draws(_logits([0.75, 0.25]), Sampling(temperature=1.0, top_k=40, top_p=1.0), n=2000)
    assert 0.70 < drawn.count(7) / len(drawn) < 0.80
    assert set(drawn) == {7, 500}


def test_no_limits_draws_from_every_token() -> None:
    logits = torch.zeros(6)
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=0, top_p=1.0))) == set(range(6))


def test_a_seed_repeats_the_draws() -> None:
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(temperature=0.8, top_k=40, top_p=0.95)
    assert _draws(logits, sampling, n=50) == _draws(logits, sampling, n=50)


def test_bad_settings_are_refused() -> None:
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(KtcError):
            Sampling(**bad)
