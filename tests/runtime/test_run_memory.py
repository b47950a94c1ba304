"""Memory as planned: a whole model on a device holds the plan's non-expert weights, device
experts and KV cache (tested on torch's CPU device; a gpu-marked test checks CUDA's allocator),
refuses requests beyond the KV capacity before running, and releases everything on close."""

from __future__ import annotations

import gc

import pytest
import torch

import model_factory as mf
from conftest import fd_and_map_counts
from ktc.compile import compile_bundle
from ktc.errors import KtcError
from ktc.runtime.generate import Sampling, generate
from ktc.runtime.hf import from_bundle

PLAN = dict(vram="16MiB", ram="1GiB", reserve=0, max_tokens=2048)


@pytest.fixture(scope="module")
def planned_bundle(demo_model, tmp_path_factory):
    """The demo model planned for a 16 MiB GPU: some experts on the device, some on the CPU."""
    path = str(tmp_path_factory.mktemp("planned") / "demo.ktb")
    compile_bundle(demo_model, path, plan_kwargs=PLAN)
    return path


def test_device_holds_what_the_plan_counted(planned_bundle):
    with from_bundle(planned_bundle, device="cpu") as km:
        plan, held = km.plan_device_bytes, km.device_bytes
        # 2 (K, V) x 4 layers x 2 KV heads x 64 dims x 2 bytes (bf16) per token, 2048 tokens
        assert held["kv_cache"] == plan["kv_cache"] == 2 * 4 * 2 * 64 * 2 * 2048
        assert 0 < held["experts"] <= plan["experts"] and held["experts"] >= 0.95 * plan["experts"]
        assert 0.95 * plan["non_expert"] <= held["non_expert"] <= plan["non_expert"]
        assert abs(km.device_total - km.plan_device_total) <= 0.05 * km.plan_device_total
        # The tensors on the device are the ones counted: weights, experts, cache.
        on_device = sum(t.numel() * t.element_size() for t in km.cache.layers[0].__dict__.values()
                        if isinstance(t, torch.Tensor) and t.dim() == 4)
        assert on_device * len(km.cache.layers) == held["kv_cache"]
        ids = km.tokenizer("A Mixture-of-Experts model")["input_ids"]
        run = generate(km, ids, max_new_tokens=4, sampling=Sampling(temperature=0), stop_at_eos=False)
        assert len(run.generated_tokens) == 4


def test_request_beyond_the_kv_capacity_is_refused_before_running(planned_bundle):
    with from_bundle(planned_bundle) as km:
        calls = []
        km.model.register_forward_pre_hook(lambda *a: calls.append(1))
        with pytest.raises(KtcError) as info:
            generate(km, [5] * 2000, max_new_tokens=100)
        message = str(info.value)
        assert "2100" in message and "2048" in message and "--max-tokens" in message
        assert calls == []  # nothing ran
        with pytest.raises(KtcError, match="2048"):
            km.generate(torch.tensor([[5] * 2040]), max_new_tokens=9)


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "q4_0", "int4_g128", "mxfp4", "bf16"])
def test_cpu_experts_take_no_device_memory(scheme, demo_model, tmp_path):
    path = str(tmp_path / "cpu.ktb")
    compile_bundle(demo_model, path, cpu_scheme=scheme)
    with from_bundle(path, device="cpu") as km:
        assert km.device_bytes["experts"] == 0
        assert all(e.device_bytes == 0 and not e.gpu_experts for e in km.experts)


def test_hundred_open_close_cycles_leave_no_descriptor_or_map(planned_bundle):
    from_bundle(planned_bundle).close()  # imports and caches first
    gc.collect()  # what earlier tests left for the collector is not this test's
    before = fd_and_map_counts()
    for _ in range(100):
        km = from_bundle(planned_bundle)
        km.close()
    assert fd_and_map_counts() == before  # close() itself released everything: no collection here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_is_the_plans(planned_bundle):
    """On CUDA the allocator holds, after loading, what the plan counted (within 5%), and a
    generation stays within the plan's total with its workspace."""
    torch.cuda.synchronize()
    mf.warm_cuda()
    before = torch.cuda.memory_allocated()
    with from_bundle(planned_bundle, device="cuda") as km:
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        assert abs(grown - km.plan_device_total) <= 0.05 * km.plan_device_total
        torch.cuda.reset_peak_memory_stats()
        ids = km.tokenizer("A Mixture-of-Experts model")["input_ids"]
        generate(km, ids, max_new_tokens=8, sampling=Sampling(temperature=0), stop_at_eos=False)
        vram = km.bundle.manifest["plan"]["memory"]["vram"]
        planned_peak = km.plan_device_total + vram["workspace"]
        assert torch.cuda.max_memory_allocated() - before <= 1.05 * planned_peak
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
