from __future__ import annotations

import os

import pytest

import model_factory as mf

# The fused device kernels (runtime/triton_experts.py) run on torch's CPU device in Triton's
# interpreter, which must be chosen before Triton is first imported (its own library's functions
# are made interpreted or compiled then): on a machine without CUDA, for the whole run.
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_xdist_auto_num_workers(config):  # type: ignore[no-untyped-def]
    """``-n auto`` (``make test``): a worker a core, at most four. Each worker compiles the
    kernels its tests need that the cache (shared: ``ktc._cache_saves_take_turns``) does not hold yet,
    and builds its own session fixtures; measured with two only."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Every family as safetensors, .bin (same tensors), fused .bin and GGUF; built once."""
    root = tmp_path_factory.mktemp("tiny")
    models = {}
    for family in mf.FAMILIES:
        model = mf.build_hf_model(family)
        st = mf.write_safetensors(model, str(root / family / "safetensors"))
        models[family] = {
            "safetensors": st,
            "pytorch": mf.write_pytorch_from_safetensors(st, str(root / family / "pytorch")),
            "gguf": mf.write_gguf(st, str(root / family / "model.gguf"), family=family),
        }
        if family != "gpt_oss":  # gpt-oss is already fused in memory and on disk
            models[family]["pytorch_fused"] = mf.write_pytorch_fused(model, st, str(root / family / "fused"))
    return models


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    from ktc.demo import write_demo_model

    return write_demo_model(str(tmp_path_factory.mktemp("demo")))


def fd_and_map_counts() -> tuple[int, int]:
    """Open descriptors, and maps of data files (bundles, checkpoints). Anonymous maps and
    shared libraries are left out: the allocator and lazily loaded libraries change those
    without anything leaking (one full run counted 729 maps against 728)."""
    with open("/proc/self/maps") as f:
        fields = [line.split(maxsplit=5) for line in f]
    maps = sum(1 for parts in fields if len(parts) == 6 and parts[5].startswith("/")
               and ".so" not in os.path.basename(parts[5]))
    return len(os.listdir("/proc/self/fd")), maps
