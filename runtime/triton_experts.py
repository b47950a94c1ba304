"""One token through a device stack's experts in two Triton kernels, the weights read at their
bundle scheme.

The torch path (``device.batched_matmul``) decodes a stack's selected matrices to floats with a
dozen elementwise operations, then multiplies: on an H200 a Qwen3-30B-A3B-shaped q4_0 layer's
one-token step took about 30 kernel launches and 0.28 ms of GPU time, most of it those passes
(README, "The device path on an H200 machine"). Here a token's experts of one stack take two
kernels (``triton_kernels``): ``gate_up``, gate and up rows decoded in registers and multiplied
with x, the activation applied as each pair of them is done; then ``down``, every selected
expert's down rows times its activation, weighted and added to the layer's output in the
experts' order (a program owns a span of output rows, so the sum is the same whatever the GPU's
scheduling). Written by hand: torch's products need the decoded matrix, and no library at hand
reads ggml's blocks on a GPU.

Schemes: f32, f16, bf16, int8, q8_0, q4_0, mxfp4, q4_k, q5_k, q6_k and int4 g32/g64/g128 (gate/up
and down may differ: llama.cpp's Q4_K_M); the others keep the torch path (``supported``). Triton
ships with CUDA builds of torch. Off a GPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1`` before Triton is imported, and ``KTC_DEVICE_KERNELS=triton``), which the
tests use on torch's CPU device.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

# kind codes of the matrices the kernels read, by the registry's scheme names
KINDS = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "q8_0": 4, "q4_0": 5, "mxfp4": 6, "q4_k": 7, "q5_k": 8, "q6_k": 9,
         "int4_g32": 10, "int4_g64": 11, "int4_g128": 12}
# rows a program, and values a step of its loop over a row (a multiple of 32: whole ggml blocks).
# Chosen for a GPU decode step (a token, a few experts): hundreds of programs, each row's bytes
# read in runs of hundreds.
BLOCK_ROWS = 8
BLOCK_VALUES = 512

_failed: set[tuple[int, int]] = set()  # (gate/up kind, down kind) whose kernels did not build


def enabled(device: Any) -> bool:
    """Whether a stack on ``device`` takes these kernels: on CUDA with Triton importable, unless
    ``KTC_DEVICE_KERNELS=torch``; on another device only with ``KTC_DEVICE_KERNELS=triton`` (and
    Triton's interpreter on: the tests)."""
    choice = os.environ.get("KTC_DEVICE_KERNELS", "")
    if choice == "torch" or (device.type != "cuda" and choice != "triton"):
        return False
    return _kernels() is not None


def supported(gate_up_scheme: str, down_scheme: str) -> bool:
    """Whether the kernels read matrices of these schemes (and built for them where tried)."""
    kinds = (KINDS.get(gate_up_scheme), KINDS.get(down_scheme))
    return None not in kinds and kinds not in _failed


def token(stack: Any, gate_up_scheme: str, down_scheme: str, index: Any, weights: Any, x: Any, out: Any,
          hidden: int, inter: int, clamped: bool, limit: float, alpha: float) -> bool:
    """Add sum over i of weights[i] * expert index[i](x) into ``out`` [hidden] (float32) for the
    experts ``index`` (their places in the stack, int64 or float32, on the device) of ``stack``
    (``device.DeviceExperts``), x float32 [hidden]. SiLU(gate) * up, or with ``clamped``
    gpt-oss's clamped SwiGLU (``limit``, ``alpha``). False, with ``out`` untouched, where the
    kernels did not build for these schemes (warned once; the caller takes the torch path)."""
    import torch

    kernels = _kernels()
    gu_kind, dn_kind = KINDS[gate_up_scheme], KINDS[down_scheme]
    n = index.shape[0]
    a = torch.empty((n, inter), dtype=torch.float32, device=x.device)
    gu_bias, dn_bias = stack.gate_up_bias, stack.down_bias
    gu = _typed(stack.gate_up, gu_kind)
    dn = _typed(stack.down, dn_kind)
    try:
        kernels["gate_up"][(n, _cdiv(inter, BLOCK_ROWS))](
            gu, index, x, a, gu_bias if gu_bias is not None else a, hidden, inter, gu.shape[2],
            gu.shape[1] * gu.shape[2], float(limit), float(alpha), KIND=gu_kind, CLAMPED=clamped,
            HAS_BIAS=gu_bias is not None, BLOCK_R=BLOCK_ROWS, BLOCK_K=BLOCK_VALUES)
        kernels["down"][(_cdiv(hidden, BLOCK_ROWS),)](
            dn, index, weights, a, out, dn_bias if dn_bias is not None else a, n, hidden, inter, dn.shape[2],
            dn.shape[1] * dn.shape[2], KIND=dn_kind, HAS_BIAS=dn_bias is not None,
            BLOCK_R=BLOCK_ROWS, BLOCK_K=BLOCK_VALUES)
    except Exception as err:  # a Triton that cannot build them here: the torch path instead
        _failed.add((gu_kind, dn_kind))
        warnings.warn(f"ktc: the fused device kernels for {gate_up_scheme}/{down_scheme} did not build ({err}); "
                      "decoding with torch instead", RuntimeWarning, stacklevel=2)
        return False
    return True


def warm(stack: Any, gate_up_scheme: str, down_scheme: str, hidden: int, clamped: bool) -> None:
    """Build the kernels for ``stack`` (its schemes, biases and activation) by running them once
    on its first expert into a scratch output: Triton compiles a kernel at its first launch
    (seconds each, once per machine: it keeps them on disk), which would otherwise fall in the
    first decode steps. Where they do not build, ``token`` has warned and ``supported`` says so."""
    import torch

    device = stack.gate_up.device
    token(stack, gate_up_scheme, down_scheme, torch.zeros(1, dtype=torch.float32, device=device),
          torch.zeros(1, dtype=torch.float32, device=device), torch.zeros(hidden, dtype=torch.float32, device=device),
          torch.zeros(hidden, dtype=torch.float32, device=device), hidden, stack.gate_up.shape[1] // 2, clamped, 7.0,
          1.702)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _typed(raw: Any, kind: int) -> Any:
    """The stack's bytes [n, rows, row_bytes] as the kernels read them: plain types as their
    values, the others as bytes."""
    import torch

    if kind <= 2:
        return raw.view((torch.float32, torch.float16, torch.bfloat16)[kind])
    return raw


_KERNELS: dict[str, Any] | None = None
_TRIED = False


def _kernels() -> dict[str, Any] | None:
    """The two jitted kernels, imported on first use (None where Triton cannot be imported)."""
    global _KERNELS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            from . import triton_kernels
        except ImportError:
            _KERNELS = None
        else:
            _KERNELS = {"gate_up": triton_kernels.gate_up, "down": triton_kernels.down}
    return _KERNELS
