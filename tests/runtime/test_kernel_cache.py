"""Compiled kernels load from Numba's cache in a second process and give the first one's results.

Numba caches each compiled function with what it calls compiled in, and checks only its own
file for changes. ``MoELayer``'s one-token call (which ``ktc run``'s decode steps take) calls the
parallel kernels of ``runtime.vnni`` from ``runtime.moe``: once, a second process crashed loading
it from the cache where the first, which compiled it, had run. This runs the one-token and batched
paths twice, each in a fresh process with the same, at first empty, cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.runtime import vnni

SCRIPT = """
import json
import sys
import numpy as np
from ktc.formats.bundle import open_bundle
from ktc.runtime.moe import MoELayer

rng = np.random.default_rng(0)
for path in sys.argv[1:]:
    with open_bundle(path) as bundle:
        layer = MoELayer(bundle, 0)
        layer.router = rng.standard_normal(layer.router.shape).astype(np.float32)
        hidden = rng.standard_normal((1, layer.hidden_size)).astype(np.float32)
        out = layer.forward(hidden)  # one token: the compiled routing and experts call
        batch = layer.forward(np.repeat(hidden, 3, axis=0))  # three tokens: the batched path
        print(json.dumps([out[0, :4].tolist(), batch[0, :4].tolist()]))
        del layer, out, batch
"""


@pytest.mark.slow  # two processes that import ktc, one compiling the MoE layer's kernels: about 40 s
@pytest.mark.skipif(not vnni.HAVE_VNNI, reason="the one-call path needs AVX-512 VNNI")
def test_cached_kernels_run_in_a_second_process(tmp_path):
    source = mf.write_safetensors(mf.build_hf_model("qwen3_moe"), str(tmp_path / "m"))
    paths = []
    for scheme in ("int8", "q4_0"):
        paths.append(str(tmp_path / f"{scheme}.ktb"))
        compile_bundle(source, paths[-1], cpu_scheme=scheme)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    runs = [subprocess.run([sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True,
                           timeout=900) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert any(os.scandir(tmp_path / "numba-cache"))  # the second process had a cache to load
    first, second = (np.array([json.loads(line) for line in run.stdout.splitlines()]) for run in runs)
    assert first.shape == (len(paths), 2, 4)
    assert np.all(np.isfinite(first)) and np.all(np.abs(first) > 0)
    np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-8)  # the same products
