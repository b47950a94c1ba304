"""ktc's q4_k, q5_k and q6_k quantizers against llama.cpp's own, on the same float weights.

llama-quantize quantizes every tensor with ``ggml_quantize_chunk``; this calls that function in
llama.cpp's built ``libggml-base`` (found beside ``llama-quantize`` on the PATH, or in the
``--llamacpp`` build) on Gaussian weights and one expert matrix at Mixtral-8x7B's shape, and
prints, per type, both relative RMS errors (decoded by the ``gguf`` package), the fraction of
blocks whose bytes are identical, and the quantizing time of each (one run each, after a warm-up
call; the error comparison is the point here, not the speed).

    python benchmarks/kquant_bytes.py [--llamacpp ~/.cache/llama.cpp]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import time

import numpy as np


def find_library(llamacpp: str) -> str | None:
    quantize = shutil.which("llama-quantize")
    folders = ([os.path.dirname(os.path.realpath(quantize))] if quantize else []) + [
        os.path.join(llamacpp, "build", "bin")]
    for folder in folders:
        for name in ("libggml-base.so", "libggml-base.dylib"):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def ggml_quantizer(path: str):  # type: ignore[no-untyped-def]
    from gguf import GGML_QUANT_SIZES

    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]

    def quantize(x: np.ndarray, qtype) -> np.ndarray:  # type: ignore[no-untyped-def]
        rows, cols = x.shape
        block, size = GGML_QUANT_SIZES[qtype]
        out = np.zeros((rows, cols // block * size), np.uint8)
        lib.ggml_quantize_init(int(qtype))
        written = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        assert written == out.size
        return out

    return quantize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"))
    args = parser.parse_args()
    from gguf import GGMLQuantizationType

    from ktc.formats.quantize import dequantize, quantize

    library = find_library(args.llamacpp)
    if library is None:
        print("llama.cpp's libggml-base is not built: run ../shared/tools/build-llamacpp.sh")
        return 1
    theirs = ggml_quantizer(library)
    weights = {"gaussian 64x4096": np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32),
               "mixtral w1 14336x4096": (np.random.default_rng(1).standard_normal((14336, 4096)) * 0.02
                                         ).astype(np.float32)}
    print(f"llama.cpp: {library}")
    for label, x in weights.items():
        for name in ("q4_k", "q5_k", "q6_k"):
            qtype = GGMLQuantizationType[name.upper()]
            quantize(x[:1], name)  # compiled before timing
            t0 = time.perf_counter()
            ours = quantize(x, name)
            t1 = time.perf_counter()
            ref = theirs(x, qtype)
            t2 = time.perf_counter()
            block = ours.shape[1] // (x.shape[1] // 256)
            same = float((ours.reshape(-1, block) == ref.reshape(-1, block)).all(axis=1).mean())

            def error(raw: np.ndarray) -> float:
                return float(np.sqrt(np.mean((dequantize(raw, name, x.shape[1]) - x) ** 2) / np.mean(x ** 2)))

            print(f"{label:<22} {name}: RMS error ktc {error(ours):.5f}, llama.cpp {error(ref):.5f} "
                  f"(ktc/llama.cpp {error(ours) / error(ref):.4f}); identical blocks {100 * same:.2f}%; "
                  f"quantizing ktc {t1 - t0:.2f} s, llama.cpp {t2 - t1:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
