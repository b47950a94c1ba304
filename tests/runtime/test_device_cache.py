"""Device expert cache slots (``ExpertSet(cache_slots=...)``) on torch's CPU device: the same
code runs on CUDA, where the copies also go through a page-locked buffer on a side stream."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.errors import KtcError
from ktc.formats.bundle import open_bundle
from ktc.runtime import device_cache
from ktc.runtime import experts as experts_module
from ktc.runtime.expert_cache import LayerCache
from ktc.runtime.experts import ExpertSet
from ktc.runtime.generate import Sampling, generate
from ktc.runtime.hf import from_bundle

VOCAB = 40


def _resident(e: int) -> bool:
    return e % 4 == 0


@pytest.fixture(scope="module")
def cached_bundle(tmp_path_factory):
    """A runnable tiny Qwen3-MoE whose experts 0 and 4 of each layer are on the device, the
    others on the CPU, all bf16 (the CPU kernels and torch then differ by rounding alone)."""
    tmp = tmp_path_factory.mktemp("cache")
    folder = str(tmp / "src")
    mf.write_safetensors(mf.build_hf_model("qwen3_moe").eval(), folder)
    mf.write_char_tokenizer(folder, VOCAB)
    return mf.compile_with_placement(folder, tmp, lambda e: "gpu:bf16" if _resident(e) else "cpu:bf16")


def _routes(rng: np.random.Generator, tokens: int, shift: int) -> np.ndarray:
    """Zipf-skewed top-k choices (distinct per token), the hottest expert ``shift``."""
    p = 1.0 / np.arange(1, mf.EXPERTS + 1) ** 1.5
    p /= p.sum()
    order = (np.arange(mf.EXPERTS) + shift) % mf.EXPERTS
    return np.stack([order[rng.choice(mf.EXPERTS, mf.TOP_K, replace=False, p=p)] for _ in range(tokens)])


def _device_tensors(experts: ExpertSet) -> list[torch.Tensor]:
    stacks = list(experts._device_weights.values()) + [experts.cache.weights]
    return [t for s in stacks for t in (s.gate_up, s.down, s.gate_up_bias, s.down_bias) if t is not None]


def test_slots_follow_the_policy_and_the_device_holds_what_was_planned(cached_bundle):
    """Forward after forward (one token and several): every use is a hit or a miss, the slots
    hold exactly the bytes of the experts the policy put there, the evictions are the policy's
    own (a ``LayerCache`` stepped alone on the same routing), the device memory is the
    residents' and the slots' and never grows, and the output is the CPU kernels'."""
    rng = np.random.default_rng(0)
    with open_bundle(cached_bundle) as bundle:
        experts = ExpertSet(bundle, 1, device="cpu", cache_slots=2)
        on_cpu = ExpertSet(bundle, 1)
        cache = experts.cache
        resident = tuple(e for e in range(mf.EXPERTS) if _resident(e))
        assert experts.gpu_experts == resident and cache.policy.slots == 2
        reference = LayerCache(mf.EXPERTS, 2, cache.policy.expert_bytes, resident=resident,
                               eligible=tuple(e for e in range(mf.EXPERTS) if not _resident(e)))
        assert cache.policy.expert_bytes == 3 * mf.HIDDEN * 32 * 2  # gate, up, down of 32 x HIDDEN, bf16
        planned = experts.device_bytes + 2 * cache.policy.expert_bytes
        pointers = [t.data_ptr() for t in _device_tensors(experts)]
        uses = 0
        for step in range(240):  # the hot experts move every 60 forwards
            tokens = 1 if step % 3 else int(rng.integers(2, 6))
            idx = _routes(rng, tokens, 1 + 3 * (step // 60))
            weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
            hidden = rng.standard_normal((tokens, mf.HIDDEN)).astype(np.float32)
            got = experts.forward(hidden, idx, weights)
            want = on_cpu.forward(hidden, idx, weights)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            reference.step(np.unique(idx))
            assert cache.policy.started == reference.started  # the same admissions and evictions
            cache.wait()  # the copies land before the next forward, as the reference's do
            for e, _ in reference.started:
                reference.uploaded(e, 0.0)
            uses += len(np.unique(idx))
            counters = cache.counters
            assert counters.hits + counters.misses == uses
            assert counters == reference.counters
            assert sum(t.numel() * t.element_size() for t in _device_tensors(experts)) == planned
            assert [t.data_ptr() for t in _device_tensors(experts)] == pointers
            assert set(cache.slot_of) == set(cache.policy.pool) and not set(cache.slot_of) & set(resident)
            for e, slot in cache.slot_of.items():
                for part in ("gate_up", "down"):
                    held = getattr(cache.weights, part)[slot].numpy()
                    stored = bundle.tensor(f"layers.1.experts.{e}.{part}").view(np.uint8).reshape(held.shape)
                    np.testing.assert_array_equal(held, stored)
        assert counters.hits > counters.misses > 0 and counters.evictions > 0
        assert counters.bytes_uploaded == counters.uploads * cache.policy.expert_bytes
        experts.close()
        on_cpu.close()


def test_a_miss_runs_on_the_cpu_while_its_copy_is_held(cached_bundle, monkeypatch):
    """A copy that does not finish never holds the model up: the expert runs on the CPU (a late
    miss while its copy is on its way) and from its slot once the copy has landed."""
    release = threading.Event()
    copy = device_cache.DeviceSlots._copy

    def held_copy(self, expert, slot):  # type: ignore[no-untyped-def]
        assert release.wait(timeout=60)
        copy(self, expert, slot)

    with open_bundle(cached_bundle) as bundle:
        experts = ExpertSet(bundle, 2, device="cpu", cache_slots=2)
        on_cpu = ExpertSet(bundle, 2)
        monkeypatch.setattr(device_cache.DeviceSlots, "_copy", held_copy)
        cache = experts.cache
        cold = [e for e in range(mf.EXPERTS) if not _resident(e) and e not in cache.slot_of]
        idx = np.array([[cold[0], 0]])
        weights = np.array([[0.7, 0.3]], dtype=np.float32)
        hidden = np.random.default_rng(1).standard_normal((1, mf.HIDDEN)).astype(np.float32)
        want = on_cpu.forward(hidden, idx, weights)
        # The pool is full of the prior's best: a few uses of the cold expert outscore them.
        for _ in range(16):
            np.testing.assert_allclose(experts.forward(hidden, idx, weights), want, rtol=1e-5, atol=1e-6)
            if cold[0] in cache.policy.pool:
                break
        assert cold[0] in cache.policy.pool and cache.counters.misses >= 1 and cache.counters.late == 0
        np.testing.assert_allclose(experts.forward(hidden, idx, weights), want, rtol=1e-5, atol=1e-6)
        assert cache.counters.late == 1  # on its way, held: this use ran on the CPU
        release.set()
        cache.wait()
        hits = cache.counters.hits
        np.testing.assert_allclose(experts.forward(hidden, idx, weights), want, rtol=1e-5, atol=1e-6)
        assert cache.counters.hits == hits + 2  # the resident and the landed slot
        experts.close()
        on_cpu.close()


def test_greedy_generation_with_a_cache_is_the_static_plans(cached_bundle):
    """A whole model with two cache slots per layer generates the static plan's greedy tokens,
    with the same logits up to f32 rounding (a cached expert runs in torch, not the CPU kernels)."""
    ids = list(range(3, 15))
    with from_bundle(cached_bundle, device="cpu", cache_slots=0, prefill_offload=False) as static:
        want = generate(static, ids, max_new_tokens=12, sampling=Sampling(temperature=0), stop_at_eos=False)
        with torch.inference_mode():
            want_logits = static.model(input_ids=torch.tensor([ids + want.generated_tokens])).logits
    with from_bundle(cached_bundle, device="cpu", cache_slots=2) as cached:
        assert cached.device_bytes["expert_cache"] == 2 * len(cached.experts) * 3 * mf.HIDDEN * 32 * 2
        got = generate(cached, ids, max_new_tokens=12, sampling=Sampling(temperature=0), stop_at_eos=False)
        for e in cached.experts:
            e.cache.wait()
        with torch.inference_mode():
            got_logits = cached.model(input_ids=torch.tensor([ids + got.generated_tokens])).logits
        counters = [e.cache.counters for e in cached.experts]
    assert got.generated_tokens == want.generated_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert sum(c.hits for c in counters) > 0 and sum(c.misses for c in counters) > 0


def test_the_profile_fills_the_slots_at_load(cached_bundle, tmp_path):
    """With an activation profile the slots start with each layer's most used CPU experts (the
    plan's residents left out); without one, uniform."""
    from ktc.cli import _bundle_profile
    from ktc.formats.activation_profile import ActivationProfile

    with open_bundle(cached_bundle) as bundle:
        layers = tuple(int(i["layer"]) for i in bundle.manifest["model"]["moe_layers"])
        counts = np.tile(np.arange(mf.EXPERTS, dtype=np.float64), (len(layers), 1))  # the last ones hottest
        ActivationProfile(layers, counts, "test").save(str(tmp_path / "profile.json"))
        prior = _bundle_profile(bundle, str(tmp_path / "profile.json"))
    with from_bundle(cached_bundle, device="cpu", cache_slots=2, cache_prior=prior) as km:
        assert all(set(e.cache.slot_of) == {6, 7} for e in km.experts)  # 4, 5 ... cooler; 0, 4 resident
    with from_bundle(cached_bundle, device="cpu", cache_slots=2) as km:
        assert all(set(e.cache.slot_of) == {1, 2} for e in km.experts)


def test_slots_beyond_the_plans_free_vram_are_refused(demo_model, tmp_path):
    path = str(tmp_path / "tight.ktb")
    compile_bundle(demo_model, path, plan_kwargs=dict(vram="16MiB", ram="1GiB", reserve=0, max_tokens=2048))
    with pytest.raises(KtcError, match="VRAM budget free") as info:
        from_bundle(path, device="cpu", cache_slots=1)
    assert "--cache-slots" in info.value.hint
    with pytest.raises(KtcError, match="need a device"):
        from_bundle(path, cache_slots=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slots_take_their_bytes_and_copies_land(cached_bundle):
    """On CUDA: the slots take their bytes once, the copies (page-locked staging, side stream)
    land and are then read, and the output stays close to the CPU kernels' (bf16 products)."""
    rng = np.random.default_rng(2)
    with open_bundle(cached_bundle) as bundle:
        mf.warm_cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        experts = ExpertSet(bundle, 1, device="cuda", cache_slots=2)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        held = experts.device_bytes + experts.cache.nbytes
        assert held <= grown <= held + 512 * len(_device_tensors(experts))
        on_cpu = ExpertSet(bundle, 1)
        for step in range(120):
            idx = _routes(rng, 1, 1 + 3 * (step // 40))
            weights = np.full(idx.shape, 0.5, dtype=np.float32)
            hidden = rng.standard_normal((1, mf.HIDDEN)).astype(np.float32)
            got, want = experts.forward(hidden, idx, weights), on_cpu.forward(hidden, idx, weights)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
        experts.cache.wait()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before == grown
        assert experts.cache.counters.uploads > 0 and experts.cache.counters.hits > 0
        for e, slot in experts.cache.slot_of.items():
            stored = bundle.tensor(f"layers.1.experts.{e}.down").view(np.uint8)
            assert np.array_equal(experts.cache.weights.down[slot].cpu().numpy().ravel(), stored.ravel())
        experts.close()
        on_cpu.close()


def test_pre_gating_copies_the_next_layers_guess_before_it_runs(cached_bundle):
    """With the prefetcher, a layer's forward starts copying into the next layer's slots the
    experts its router picks for this layer's input, as the next layer's own miss would have
    (the same admission), one layer earlier: that use is a hit where without the guess it is a
    miss."""
    import copy

    from ktc.runtime.prefetch import Prefetcher, pregate

    hidden = np.random.default_rng(4).standard_normal((1, mf.HIDDEN)).astype(np.float32)
    half = np.full((1, 2), 0.5, dtype=np.float32)
    with open_bundle(cached_bundle) as bundle:
        routers = [np.asarray(bundle.tensor(f"layers.{layer}.router"), dtype=np.float32) for layer in (0, 1)]
        guess = pregate(hidden, routers[1], mf.TOP_K)[0]
        cold = [e for e in guess.tolist() if not _resident(e)][0]
        prior = np.ones(mf.EXPERTS)
        prior[cold] = 0.0  # the slots start with other experts
        first = ExpertSet(bundle, 0, device="cpu", cache_slots=2)
        with_guess, without = (ExpertSet(bundle, 1, device="cpu", cache_slots=2, cache_prior=prior) for _ in "ab")
        prefetcher = Prefetcher(bundle, [first, with_guess], routers, mf.TOP_K, page=False)
        idx = np.array([[cold, 0]])
        for _ in range(100):  # uses of the cold expert (misses) until one more would admit it
            if copy.deepcopy(with_guess.cache.policy).prefetch(guess):
                break
            for layer in (with_guess, without):
                layer.forward(hidden, idx, half)
        assert cold not in with_guess.cache.slot_of and with_guess.cache.counters.misses > 0
        first.forward(hidden, np.array([[1, 2]]), half)  # guesses layer 1's experts
        assert cold in with_guess.cache.slot_of and with_guess.cache.counters.prefetched == 1
        with_guess.cache.wait()
        before = [(layer.cache.counters.hits, layer.cache.counters.misses) for layer in (with_guess, without)]
        for layer in (with_guess, without):
            layer.forward(hidden, idx, half)
        after = [(layer.cache.counters.hits, layer.cache.counters.misses) for layer in (with_guess, without)]
        assert after[0] == (before[0][0] + 2, before[0][1])  # the guessed expert and the resident hit
        assert after[1] == (before[1][0] + 1, before[1][1] + 1)  # admitted now, too late for this use
        assert with_guess.cache.counters.guessed == len(set(guess.tolist()))
        assert with_guess.cache.counters.guess_used == len({cold, 0} & set(guess.tolist()))
        prefetcher.close()
        for layer in (first, with_guess, without):
            layer.close()


def _prefill(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    idx = np.stack([rng.choice(mf.EXPERTS, mf.TOP_K, replace=False) for _ in range(tokens)])
    weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    return rng.standard_normal((tokens, mf.HIDDEN)).astype(np.float32), idx, weights


def test_prefill_offload_copies_what_the_cost_model_chooses_and_frees_it(cached_bundle):
    """A forward of many tokens: nothing is copied before the CPU's time a token has been
    measured; then the experts whose copy beats the CPU (a fast link here) run on the device,
    within the budget, with the CPU kernels' output, and their copies go with the forward. Few
    tokens, or a slow link, copy nothing."""
    import gc
    import weakref

    from ktc.runtime.offload import PrefillOffload

    rng = np.random.default_rng(5)
    with open_bundle(cached_bundle) as bundle:
        on_cpu = ExpertSet(bundle, 1)
        expert_bytes = 3 * mf.HIDDEN * 32 * 2
        offload = PrefillOffload(pcie_bandwidth=1e15, cpu_bandwidth=1e12, budget_bytes=3 * expert_bytes + 1)
        experts = ExpertSet(bundle, 1, device="cpu", offload=offload)
        copies = []
        real_upload = experts_module.upload

        def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
            stack = real_upload(*args, **kwargs)
            copies.append((weakref.ref(stack.gate_up), stack.gate_up.shape[0]))
            return stack

        experts_module.upload = watched
        try:
            for step in range(3):
                # the copies' measured rate (to torch's CPU device here, timed beside whatever else
                # runs) set back to the fast link's before each forward, so that what is copied
                # depends on the budget, not on two timings' race (5 experts, not 6, on a busy machine)
                offload.copy_bandwidth = offload.pcie_bandwidth
                hidden, idx, weights = _prefill(rng, 40)
                got = experts.forward(hidden, idx, weights)
                want = on_cpu.forward(hidden, idx, weights)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
                if step == 0:  # the first forward measures the CPU
                    assert copies == [] and offload.counters.measured == 1 and "bf16" in offload.seconds_per_token
            assert offload.counters.offloaded == 2 and offload.counters.experts == 6  # 3 fit the budget
            assert sum(n for _, n in copies) == 6 and offload.counters.bytes_uploaded == 6 * expert_bytes
            gc.collect()
            assert all(ref() is None for ref, _ in copies) and experts._offloaded == {}
            experts.forward(*_prefill(rng, 8))  # too few tokens
            offload.copy_bandwidth = 1.0  # copies measured as taking forever
            experts.forward(*_prefill(rng, 40))
            assert offload.counters.experts == 6 and len(copies) == 2
        finally:
            experts_module.upload = real_upload
        experts.close()
        on_cpu.close()


def test_prefill_offload_copies_while_the_cpu_computes(cached_bundle):
    """The offload's copies are made while the worker thread runs the forward's other CPU
    experts (the cost model has the two side by side): the CPU work waits for a copy to start
    and would time out if the copies came after it."""
    from ktc.runtime.offload import PrefillOffload

    rng = np.random.default_rng(6)
    with open_bundle(cached_bundle) as bundle:
        expert_bytes = 3 * mf.HIDDEN * 32 * 2
        offload = PrefillOffload(pcie_bandwidth=1e15, cpu_bandwidth=1e12, budget_bytes=2 * expert_bytes + 1)
        offload.seconds_per_token["bf16"] = 1.0  # measured as slow: copies pay
        experts = ExpertSet(bundle, 1, device="cpu", offload=offload)
        on_cpu = ExpertSet(bundle, 1)
        copying = threading.Event()
        seen = []
        real_upload, real_run = experts_module.upload, experts._run_cpu_timed

        def upload(*args, **kwargs):  # type: ignore[no-untyped-def]
            copying.set()
            return real_upload(*args, **kwargs)

        def run(*args):  # type: ignore[no-untyped-def]
            seen.append(copying.wait(timeout=5.0))
            return real_run(*args)

        experts_module.upload = upload
        experts._run_cpu_timed = run
        try:
            hidden, idx, weights = _prefill(rng, 40)
            got = experts.forward(hidden, idx, weights)
        finally:
            experts_module.upload = real_upload
        want = on_cpu.forward(hidden, idx, weights)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert seen == [True] and offload.counters.experts == 2
        experts.close()
        on_cpu.close()


def test_a_whole_model_with_prefill_offload_generates_the_static_plans_tokens(cached_bundle):
    ids = [3 + i % 30 for i in range(70)]
    with from_bundle(cached_bundle, device="cpu", cache_slots=0, prefill_offload=False) as static:
        want = generate(static, ids, max_new_tokens=6, sampling=Sampling(temperature=0), stop_at_eos=False)
    with from_bundle(cached_bundle, device="cpu", prefill_offload=True) as km:
        assert km.offload is not None and km.offload.budget_bytes > 0
        km.offload.seconds_per_token["bf16"] = 1.0  # as if measured on a very slow CPU: every expert goes
        got = generate(km, ids, max_new_tokens=6, sampling=Sampling(temperature=0), stop_at_eos=False)
        # the prompt's one forward a layer, but the last, which computes its last row alone
        counters = km.offload.counters
        assert counters.offloaded == len(km.experts) - 1
        # double buffered: each layer after the first had copies started while the layer before
        # ran (pre-gating's guess), its forward took the ones it chose without copying them again,
        # and the copies held at once kept within the budget (a forward's own half of it, those
        # made ahead a quarter)
        assert km.offload.lookahead and counters.ahead > 0 and 0 < counters.ahead_used <= counters.ahead
        expert_bytes = 3 * mf.HIDDEN * 32 * 2
        assert counters.bytes_uploaded == (counters.experts + counters.ahead - counters.ahead_used) * expert_bytes
        assert counters.experts <= (len(km.experts) - 1) * (km.offload.budget_bytes // 2 // expert_bytes)
        assert counters.ahead <= (len(km.experts) - 1) * (km.offload.budget_bytes // 4 // expert_bytes)
        assert all(e._prepared is None for e in km.experts)  # nothing held past a forward
    assert got.generated_tokens == want.generated_tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_whole_model_with_slots_and_the_offload_on_the_device(cached_bundle, device):
    """The whole model on ``device`` with two cache slots a layer and the prefill offload (every
    CPU expert worth a copy: as if measured on a very slow CPU): the static plan's greedy tokens
    and logits close to its (on CUDA the slots' and copies' products are bf16 on the device, the
    static plan's CPU kernels' are not: rounding apart), the offload's copies freed after each
    forward, the device holding afterwards what it held before the generation."""
    ids = [3 + i % 30 for i in range(70)]
    greedy = Sampling(temperature=0)
    with from_bundle(cached_bundle, device=device, cache_slots=0, prefill_offload=False) as static:
        want = generate(static, ids, max_new_tokens=8, sampling=greedy, stop_at_eos=False)
        with torch.inference_mode():
            seq = torch.tensor([ids + want.generated_tokens], device=device)
            want_logits = static.model(input_ids=seq).logits.float().cpu()
    with from_bundle(cached_bundle, device=device, cache_slots=2, prefill_offload=True) as km:
        km.offload.seconds_per_token["bf16"] = 1.0
        if device == "cuda":
            torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() if device == "cuda" else 0
        got = generate(km, ids, max_new_tokens=8, sampling=greedy, stop_at_eos=False)
        for e in km.experts:
            e.cache.wait()
        with torch.inference_mode():
            seq = torch.tensor([ids + got.generated_tokens], device=device)
            got_logits = km.model(input_ids=seq).logits.float().cpu()
            del seq
        if device == "cuda":
            torch.cuda.synchronize()
            # the offload's copies went with their forwards (the KV cache and slots were there
            # before; a buffer of the first forward's may have gone)
            assert torch.cuda.memory_allocated() <= held
        counters = [e.cache.counters for e in km.experts]
        assert km.offload.counters.offloaded > 0 and all(e._offloaded == {} and e._prepared is None for e in km.experts)
    assert sum(c.hits for c in counters) > 0 and sum(c.misses for c in counters) > 0
    assert got.generated_tokens == want.generated_tokens
    diff = torch.linalg.norm(got_logits - want_logits) / torch.linalg.norm(want_logits)
    assert diff < (2e-2 if device == "cuda" else 1e-5)
