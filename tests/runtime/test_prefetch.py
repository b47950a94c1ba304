"""Experts paged in one layer ahead (runtime/prefetch.py), on a bundle whose pages are evicted
from the page cache (``posix_fadvise(DONTNEED)``), read back by ``mincore``."""

from __future__ import annotations

import json
import mmap
import os
import time

import numpy as np
import pytest

from ktc.compile import compile_bundle
from ktc.demo import write_sparse_checkpoint
from ktc.errors import KtcError
from ktc.formats.bundle import open_bundle
from ktc.runtime.experts import ExpertSet
from ktc.ir import is_input_embedding
from ktc.runtime.prefetch import Prefetcher, _spans, dense_ranges, expert_ranges, page_in, pregate, resident_share

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


# What the kernel's read-ahead for MADV_WILLNEED must have brought in. It is best effort: in a
# whole test run here one page of 245 was still out after 5 s (0.996), alone every page is in.
# Without the prefetcher none is.
PAGED_IN = 0.99


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
        assert wait_resident(bundle, ranges) >= PAGED_IN
        assert resident_share(bundle, others) == 0.0  # only what was asked for


def test_prefetch_pages_in_the_next_layers_guessed_experts_before_it_runs(bundle_path):
    """Layer 0's forward asks for the experts layer 1's router picks for its tokens: they are in
    memory before layer 1 runs (it does not run here at all); without the prefetcher, layer 0's
    forward leaves them on disk."""
    rng = np.random.default_rng(0)
    with open_bundle(bundle_path) as bundle:
        # read through the bundle's map: an interleaved copy (int8's on a VNNI CPU) would read
        # every expert into the process's memory at load
        layers = [ExpertSet(bundle, layer, interleave=False) for layer in (0, 1)]
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
        assert wait_resident(bundle, ranges) >= PAGED_IN
        # scored against what layer 1 then uses: one of its two experts was guessed
        assert prefetcher.accuracy is None  # layer 1 has not run
        outside = [e for e in range(8) if e not in guess]
        layers[1].forward(hidden[:1], np.array([[guess[0], outside[0]]]), weights[:1])
        assert prefetcher.accuracy == 0.5
        prefetcher.close()
        assert layers[0].observers == []
        for experts in layers:
            experts.close()


def test_only_pageable_experts_are_asked_for_and_a_layer_stops_asking_while_its_guesses_go_unused(bundle_path):
    """With ``paged`` (a disk tier's experts on disk), a guess asks for the pages of its
    pageable experts alone; a layer that then uses none of them stops asking (its decayed
    precision under one half) while its guesses are still made and scored, and asks again once
    they are used."""
    rng = np.random.default_rng(1)
    with open_bundle(bundle_path) as bundle:
        layers = [ExpertSet(bundle, layer, interleave=False) for layer in (0, 1)]
        routers = [rng.standard_normal((8, 512)).astype(np.float32) for _ in layers]
        hidden = rng.standard_normal((1, 512)).astype(np.float32)
        guess = np.unique(pregate(hidden, routers[1], 2))
        outside = [e for e in range(8) if e not in guess]
        on_disk = np.ones(8, dtype=bool)
        on_disk[guess[1]] = False  # in RAM: never asked for
        prefetcher = Prefetcher(bundle, layers, routers, top_k=2, paged={0: on_disk, 1: on_disk})
        one = sum(n for _, n in _spans(bundle.file_view().shape[0], expert_ranges(bundle, 1, guess[:1])))
        weights = np.full((1, 2), 0.5, dtype=np.float32)

        def run(used):  # type: ignore[no-untyped-def]
            layers[1].forward(hidden, np.array([used]), weights)

        prefetcher.guess(1, hidden)
        assert (prefetcher.asked, prefetcher.skipped) == (one, 0)  # the first guess asks
        run(outside[:2])
        prefetcher.guess(1, hidden)  # the last one scored: its disk expert unused
        assert prefetcher.precision(1) < 0.5 < prefetcher.precision(0)
        assert (prefetcher.asked, prefetcher.skipped) == (one, 1)  # not asked: scored still
        run([guess[0], outside[0]])
        prefetcher.guess(1, hidden)
        assert prefetcher.precision(1) >= 0.5
        assert (prefetcher.asked, prefetcher.skipped) == (2 * one, 1)
        assert prefetcher.accuracy == 0.25  # of the four experts used, one named (the open guess unused yet)
        prefetcher.close()
        for experts in layers:
            experts.close()


def test_a_disk_tier_bundle_pins_its_ram_experts_and_prefetches_the_rest(demo_model, tmp_path):
    """A plan with experts on disk compiles (through a plan file, as ktc plan -o writes it) and
    runs: the CPU experts and the weights every step reads read in (MADV_WILLNEED; with mlock,
    locked where the OS allows, else read in and the refusal said) and resident, the pre-gating
    prefetcher on (off where only the first MoE layer has disk experts), the text the same as
    with every expert in RAM."""
    from ktc.api import plan
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle

    tight = plan(demo_model, vram="16MiB", ram="3MiB", reserve=0, disk_bandwidth="2GB/s")
    data = tight.to_json()
    (tmp_path / "plan.json").write_text(json.dumps(data))
    on_disk = str(tmp_path / "disk.ktb")
    compile_bundle(demo_model, on_disk, plan_path=str(tmp_path / "plan.json"))
    for layer, row in data["placement"].items():  # the same placement with the disk experts in RAM
        data["placement"][layer] = [p.replace("disk:", "cpu:") for p in row]
    data["hardware"]["ram_bytes"] = 2**30
    (tmp_path / "ram.json").write_text(json.dumps(data))
    in_ram = str(tmp_path / "ram.ktb")
    compile_bundle(demo_model, in_ram, plan_path=str(tmp_path / "ram.json"))
    greedy = Sampling(temperature=0)
    with from_bundle(in_ram) as km:
        assert km.pinning is None and km.prefetcher is None
        want = generate(km, list(range(5, 25)), max_new_tokens=6, sampling=greedy, stop_at_eos=False)
    with from_bundle(on_disk, mlock=True) as km:
        method, pinned, why = km.pinning
        assert method in ("mlock", "willneed") and (method == "mlock") == (why == "")
    with from_bundle(on_disk) as km:
        assert km.pinning[0] == "willneed" and km.pinning[2] == ""
        placement = km.bundle.manifest["plan"]["placement"]
        in_memory = [r for layer, row in placement.items()
                     for r in expert_ranges(km.bundle, int(layer), [e for e, p in enumerate(row) if p.startswith("cpu:")])]
        dense = dense_ranges(km.bundle)
        assert km.pinning[1] >= sum(n for _, n in in_memory + dense) > sum(n for _, n in in_memory) > 0
        assert resident_share(km.bundle, in_memory + dense) == 1.0
        assert not any(is_input_embedding(name) and (t.offset, t.nbytes) in dense for name, t in km.bundle.tensors.items())
        assert km.prefetcher is not None
        got = generate(km, list(range(5, 25)), max_new_tokens=6, sampling=greedy, stop_at_eos=False)
        assert km.prefetcher.asked > 0
    assert got.generated_tokens == want.generated_tokens
    with pytest.raises(KtcError, match="keeps experts on disk"):  # ktc run --no-mmap: RAM cannot hold them
        from_bundle(on_disk, mapped=False)
    # disk experts in the first MoE layer alone, which no layer guesses: no prefetcher (its hooks
    # would split the compiled decode step for nothing), the RAM set read in all the same
    first = json.loads((tmp_path / "plan.json").read_text())
    layers = sorted(first["placement"], key=int)
    for layer in layers[1:]:
        first["placement"][layer] = [p.replace("disk:", "cpu:") for p in first["placement"][layer]]
    first["placement"][layers[0]] = [p.replace("cpu:", "disk:") for p in first["placement"][layers[0]]]
    first["hardware"]["ram_bytes"] = 2**30
    (tmp_path / "first.json").write_text(json.dumps(first))
    first_only = str(tmp_path / "first.ktb")
    compile_bundle(demo_model, first_only, plan_path=str(tmp_path / "first.json"))
    with from_bundle(first_only) as km:
        assert km.pinning is not None and km.prefetcher is None
        alone = generate(km, list(range(5, 25)), max_new_tokens=6, sampling=greedy, stop_at_eos=False)
    assert alone.generated_tokens == want.generated_tokens


def test_the_disk_read_bandwidth_is_measured_where_asked(tmp_path):
    from ktc.errors import KtcError
    from ktc.runtime.doctor import disk_read_bandwidth

    assert disk_read_bandwidth(str(tmp_path), nbytes=8 * 1024 * 1024) > 0
    assert list(tmp_path.iterdir()) == []  # the test file is gone
    with pytest.raises(KtcError, match="no such folder"):
        disk_read_bandwidth(str(tmp_path / "missing"))


def test_ktcs_compiled_decode_steps_guess_between_layers(demo_model, tmp_path):
    """Where ktc's CPU decode steps route inside one compiled call a layer (q8_0 experts on a
    VNNI CPU), the prefetcher guesses between layers (``FastDecode.hooks``): the decode steps
    page experts in too, and the text is the one without prefetch."""
    from ktc.runtime import vnni
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle

    if not vnni.HAVE_VNNI:
        pytest.skip("the one-call decode step needs AVX-512 VNNI")
    path = str(tmp_path / "q8.ktb")
    compile_bundle(demo_model, path, cpu_scheme="q8_0")
    greedy = Sampling(temperature=0)
    with from_bundle(path) as km:
        want = generate(km, list(range(5, 15)), max_new_tokens=6, sampling=greedy, stop_at_eos=False)
    with from_bundle(path, prefetch=True) as km:
        assert km.fast is not None and km.fast.hooks == [km.prefetcher.guess]
        km.prefetcher.keep_guesses = True
        got = generate(km, list(range(5, 15)), max_new_tokens=6, sampling=greedy, stop_at_eos=False)
        layers = [e.layer for e in km.experts]
        # the prompt's forward guesses each layer but the first once (the experts' observers),
        # then each of the 5 decode steps (the first token came from the prompt's logits) again,
        # between layers
        assert km.fast.steps == 5
        per_layer = {layer: sum(1 for g, _ in km.prefetcher.guesses if g == layer) for layer in layers}
        assert per_layer == {layer: 0 if layer == layers[0] else 6 for layer in layers}
    assert got.generated_tokens == want.generated_tokens
