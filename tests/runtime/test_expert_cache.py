"""The device expert cache's policy (runtime/expert_cache.py): its accounting and its choices."""

from __future__ import annotations

import numpy as np
import pytest

from ktc.errors import ConfigError
from ktc.runtime.expert_cache import LayerCache


def replay(cache: LayerCache, routes: np.ndarray, upload_seconds: float,  # type: ignore[no-untyped-def]
           token_seconds: float):
    """Steps through ``routes`` [tokens, k], uploads one after another; yields each step's
    (experts, hits, misses)."""
    clock, link_free = 0.0, 0.0
    for experts in routes:
        hits, misses = cache.step(experts, clock)
        for e, _ in cache.started:
            link_free = max(link_free, clock) + upload_seconds
            cache.uploaded(e, link_free)
        yield experts, hits, misses
        clock += token_seconds


def zipf_routes(experts: int, k: int, tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1)
    keys = np.log(weights)[None, :] + rng.gumbel(size=(tokens, experts))
    return rng.permutation(experts)[np.argsort(-keys, axis=1)[:, :k]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accounting(seed):
    """Every use is a hit or a miss; the pool never holds more experts than its slots (its device
    bytes stay the planned ones); uploads and evictions are counted as they happen."""
    routes = zipf_routes(32, 4, 400, seed)
    cache = LayerCache(32, 6, 1000, resident=(3,), prior=np.random.default_rng(seed).random(32))
    uploads = 0
    for experts, hits, misses in replay(cache, routes, upload_seconds=0.5, token_seconds=1.0):
        assert len(cache.pool) <= cache.slots and 3 not in cache.pool
        assert sorted(hits + misses) == sorted(experts.tolist()) and not set(hits) & set(misses)
        assert (3 in experts) <= (3 in hits)
        uploads += len(cache.started)
        assert sum(victim is not None for _, victim in cache.started) <= len(cache.started)
    c = cache.counters
    assert c.hits + c.misses == c.uses == routes.size
    assert c.uploads == uploads and c.bytes_uploaded == 1000 * uploads
    assert c.evictions <= c.uploads and c.uploads <= cache.slots + c.evictions
    assert cache.device_bytes == 6 * 1000


def test_a_miss_does_not_wait_for_its_upload():
    """A use of an expert whose upload has not landed is a miss (it runs on the CPU); once the
    upload is done, the next use hits."""
    cache = LayerCache(8, 1, 10, prior=np.ones(8), initial=(), margin=0.0)
    hits, misses = cache.step(np.array([5]), at=0.0)
    assert (hits, misses) == ([], [5]) and cache.started == [(5, None)]
    cache.uploaded(5, at=2.0)
    assert cache.step(np.array([5]), at=1.0) == ([], [5])  # still on its way
    assert cache.started == []  # not uploaded twice
    assert cache.step(np.array([5]), at=2.5) == ([5], [])


def test_residents_always_hit_and_are_never_evicted():
    cache = LayerCache(8, 2, 10, resident=(0, 1), prior=np.ones(8), margin=0.0)
    assert set(cache.pool).isdisjoint({0, 1})
    for t in range(50):
        hits, _ = cache.step(np.array([0, 1, 2 + t % 6]), at=float(t))
        assert {0, 1} <= set(hits)
        for e, _ in cache.started:
            cache.uploaded(e, float(t))
        assert set(cache.pool).isdisjoint({0, 1})


def test_eviction_takes_the_lowest_score_not_used_now():
    """A miss that scores above the pool's lowest by the margin replaces that expert (never one
    the same token uses); one that does not is not uploaded."""
    prior = np.array([8.0, 4.0, 2.0, 1.0, 0.0, 0.0])
    cache = LayerCache(6, 3, 1, prior=prior, decay=0.9, margin=1.0)
    assert set(cache.pool) == {0, 1, 2}
    scores = {e: cache.score(e) for e in range(6)}
    assert scores[0] > scores[1] > scores[2] > scores[3]
    # expert 4 scores 1 after this use, far below expert 2's: no upload
    cache.step(np.array([4]), at=0.0)
    assert cache.started == [] and set(cache.pool) == {0, 1, 2}
    # used again and again, expert 4 overtakes the lowest (expert 2) by the margin
    while not cache.started:
        low = min(cache.pool, key=cache.score)
        cache.step(np.array([4]), at=0.0)
    assert cache.started == [(4, low)] and low == 2
    assert cache.counters.evictions == 1
    # the lowest-scored pooled expert is kept when this token uses it: expert 5 outscores
    # expert 0 but not expert 1, so nothing is uploaded
    cache = LayerCache(6, 2, 1, prior=np.array([0.0, 100.0, 0, 0, 0, 0.5]), decay=0.9, margin=0.0, initial=(0, 1))
    cache.step(np.array([5, 0]), at=0.0)
    assert cache.score(5) > cache.score(0) and cache.score(1) > cache.score(5)
    assert cache.started == [] and set(cache.pool) == {0, 1}


def test_drift_moves_the_pool():
    """After routing changes to other experts, the pool comes to hold them."""
    cache = LayerCache(16, 4, 1, prior=np.r_[np.ones(4), np.zeros(12)])
    assert set(cache.pool) == {0, 1, 2, 3}
    new = np.array([12, 13, 14, 15])
    for _, hits, misses in replay(cache, np.tile(new, (400, 1)), 0.1, 1.0):
        pass
    assert set(cache.pool) == set(new.tolist()) and set(hits) == set(new.tolist()) and misses == []


@pytest.mark.parametrize("kwargs", [dict(slots=-1), dict(decay=1.0), dict(decay=0.0), dict(resident=(9,)),
                                    dict(prior=np.ones(3)), dict(prior=np.full(8, np.nan)),
                                    dict(initial=(0, 1, 2)), dict(resident=(0,), initial=(0,))])
def test_bad_settings_are_refused(kwargs):
    args = dict(num_experts=8, slots=2, expert_bytes=1) | kwargs
    with pytest.raises(ConfigError):
        LayerCache(args.pop("num_experts"), args.pop("slots"), args.pop("expert_bytes"), **args)


@pytest.mark.parametrize("experts", [[1, 8], [-1, 2]])
def test_an_expert_outside_the_layer_is_refused_before_anything_counts(experts):
    cache = LayerCache(8, 2, 1)
    scores = cache._score.copy()
    with pytest.raises(ConfigError, match=f"expert {[e for e in experts if not 0 <= e < 8][0]} outside 0-7"):
        cache.step(np.array(experts))
    assert cache.counters.uses == 0 and (cache._score == scores).all()


def test_a_guess_starts_uploads_a_step_early_and_leaves_the_scores_alone():
    """``prefetch`` admits a guessed expert as that step's miss would be (a free slot, or a
    margin over the pool's lowest not guessed), so its upload can land before the step; the
    scores stay those of the uses, and the step counts how much of the guess it used."""
    prior = np.array([8.0, 4.0, 2.0, 1.0, 1.0, 1.0])
    guessed = LayerCache(6, 2, 10, prior=prior, margin=0.5)
    plain = LayerCache(6, 2, 10, prior=prior, margin=0.5)
    assert set(guessed.pool) == {0, 1}
    for cache in (guessed, plain):
        for _ in range(30):  # expert 5 becomes hot, 1 cools
            cache.step(np.array([0, 5]))
            for e, _ in cache.started:
                cache.uploaded(e, 0.0)
    assert set(guessed.pool) == set(plain.pool) == {0, 5}
    assert guessed.prefetch(np.array([0, 2])) == []  # 2 is cold: no margin over 5's score
    np.testing.assert_array_equal(guessed._score, plain._score)
    assert guessed.prefetch(np.array([5, 0])) == []  # pooled already
    for _ in range(40):  # 2 heats up, 5 cools, but each use of 2 is a miss
        plain.step(np.array([0, 2]))
        guessed.step(np.array([0, 2]))
        if 2 in plain.pool:
            break
    assert 2 in plain.pool and 2 in guessed.pool  # both admitted at the same use (never uploaded here)
    fresh = LayerCache(6, 2, 10, prior=prior, margin=0.5, initial=(0,))
    started = fresh.prefetch(np.array([3, 0]))
    assert started == [(3, None)] and fresh.counters.prefetched == 1 and fresh.counters.uses == 0
    fresh.uploaded(3, 0.0)
    hits, misses = fresh.step(np.array([3, 4]))
    assert hits == [3] and misses == [4]  # landed before its step: a hit
    assert (fresh.counters.guessed, fresh.counters.guess_used) == (2, 1)
