"""Experts paged in one layer ahead (runtime/prefetch.py), on a bundle whose pages are evicted
from the page cache (``posix_fadvise(DONTNEED)``), read back by ``mincore``."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from ktc.compile import compile_bundle
from ktc.demo import write_sparse_checkpoint
from ktc.formats.bundle import open_bundle
from ktc.runtime.experts import ExpertSet
from ktc.runtime.prefetch import Prefetcher, expert_ranges, page_in, resident_share

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore")

# Experts of 0.4 MB (int8): gate/up and down each over 30 pages of their own
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
          "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8,
          "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 256}


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    write_sparse_checkpoint(CONFIG, str(root / "src"), dtype="F32")
    path = str(root / "m.ktb")
    compile_bundle(str(root / "src"), path, cpu_scheme="int8")
    return path


def evicted(path: str) -> None:
    """Drops the file's pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_resident(bundle, ranges, seconds: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    """The resident share once it reaches 1, or when ``seconds`` have passed (the reads that
    MADV_WILLNEED starts run in the background)."""
    until = time.monotonic() + seconds
    share = resident_share(bundle, ranges)
    while share < 1.0 and time.monotonic() < until:
        time.sleep(0.01)
        share = resident_share(bundle, ranges)
    return share


def test_page_in_makes_evicted_experts_resident(bundle_path):
    with open_bundle(bundle_path) as bundle:
        ranges = expert_ranges(bundle, 1, [2, 5])
        assert len(ranges) == 4 and all(n > 30 * mmap.PAGESIZE for _, n in ranges)
        evicted(bundle_path)
        if resident_share(bundle, ranges) > 0.0:
            pytest.skip("this file system keeps the file's pages after POSIX_FADV_DONTNEED")
        others = expert_ranges(bundle, 1, [3])
        assert page_in(bundle, ranges) >= sum(n for _, n in ranges)
        assert wait_resident(bundle, ranges) == 1.0
        assert resident_share(bundle, others) == 0.0  # only what was asked for


def test_prefetch_pages_in_the_next_layers_guessed_experts_before_it_runs(bundle_path):
    """Layer 0's forward asks for the experts layer 1's router picks for its tokens: they are in
    memory before layer 1 runs (it does not run here at all); without the prefetcher, layer 0's
    forward leaves them on disk."""
    rng = np.random.default_rng(0)
    with open_bundle(bundle_path) as bundle:
        layers = [ExpertSet(bundle, layer) for layer in (0, 1)]
        routers = [rng.standard_normal((8, 512)).astype(np.float32) for _ in layers]
        hidden = rng.standard_normal((3, 512)).astype(np.float32)
        idx = np.array([[0, 1], [1, 2], [0, 2]])
        weights = np.full((3, 2), 0.5, dtype=np.float32)
        guess = np.unique(np.argsort(-(hidden @ routers[1].T), axis=1, kind="stable")[:, :2])
        ranges = expert_ranges(bundle, 1, guess)
        size = bundle.file_view().shape[0]
        bundle.advise(mmap.MADV_RANDOM, 0, size // mmap.PAGESIZE * mmap.PAGESIZE)  # no readahead past a fault
        evicted(bundle_path)
        if resident_share(bundle, ranges) > 0.0:
            pytest.skip("this file system keeps the file's pages after POSIX_FADV_DONTNEED")
        layers[0].forward(hidden, idx, weights)  # no prefetcher
        time.sleep(0.2)
        assert resident_share(bundle, ranges) == 0.0
        prefetcher = Prefetcher(bundle, layers, routers, top_k=2)
        layers[0].forward(hidden, idx, weights)
        assert [layer for layer, _ in prefetcher.guesses] == [1]
        np.testing.assert_array_equal(prefetcher.guesses[0][1], guess)
        assert prefetcher.asked >= sum(n for _, n in ranges)
        assert wait_resident(bundle, ranges) == 1.0
        prefetcher.close()
        assert layers[0].observers == []
        for experts in layers:
            experts.close()
