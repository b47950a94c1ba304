"""Opening and closing each reader many times leaves no descriptor or map behind."""

from __future__ import annotations

import gc

import pytest

from conftest import fd_and_map_counts
from ktc.formats.checkpoint import open_checkpoint


@pytest.mark.parametrize("fmt", ["safetensors", "pytorch", "gguf"])
def test_open_close_200_times(tiny_models, fmt):
    path = tiny_models["qwen3_moe"][fmt]

    def cycle():
        with open_checkpoint(path) as ckpt:
            name = next(iter(ckpt.tensors))
            float(ckpt.tensors[name].load().ravel()[0])  # map some bytes too

    cycle()  # first use imports modules and warms caches
    gc.collect()
    before = fd_and_map_counts()
    for _ in range(200):
        cycle()
    gc.collect()
    assert fd_and_map_counts() == before
