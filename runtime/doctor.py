"""``ktc doctor``: what this machine is, what it can do, and what will hurt."""

from __future__ import annotations

import os
import platform
from typing import Any

from .bandwidth import read_bandwidth

_FLAGS = {"avx2": "avx2", "avx512": "avx512f", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
          "amx": "amx_tile"}


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count() or 1,
            "features": {name: flag in flags for name, flag in _FLAGS.items()}}


def _ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def doctor_bandwidth() -> float:
    """The read bandwidth (bytes/s) as ``ktc doctor`` measures it: before, and with
    ``--calibrate`` again after, the calibration."""
    return read_bandwidth(256 * 1024 * 1024, repeat=3)


def diagnose() -> dict[str, Any]:
    from importlib import metadata

    import numba
    import numpy

    try:
        ktc_version = metadata.version("ktc")
    except metadata.PackageNotFoundError:
        ktc_version = "not installed"

    try:
        import torch

        torch_version = torch.__version__
        cuda = [{"name": torch.cuda.get_device_name(i),
                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except ImportError:
        torch_version, cuda = "not installed", []
    bandwidth = doctor_bandwidth()
    cpu = _cpu()
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = "not started"
    from .amx import HAVE_AMX
    from .kernels import AMX_INT8_MIN_TOKENS, AMX_MIN_TOKENS
    from .vnni import HAVE_VNNI

    kernels = ("one-token kernels of the 4-bit schemes, int8 and q8_0 through AVX-512 VNNI" if HAVE_VNNI else
               "float kernels for every scheme (no AVX-512 VNNI, another compile target, or KTC_NO_VNNI=1)")
    if HAVE_AMX:
        kernels += (f"; prefill products of {AMX_MIN_TOKENS['q4_0']} tokens or more (the block schemes; "
                    f"{AMX_MIN_TOKENS['q4_k']} the K-quants, {AMX_MIN_TOKENS['int4_g128']} int4, "
                    f"{AMX_MIN_TOKENS['fp8_e4m3']} fp8_e4m3) through AMX (bf16), int8's from "
                    f"{AMX_INT8_MIN_TOKENS} tokens through AMX's int8 product")
    elif cpu["features"]["amx"] and HAVE_VNNI:
        kernels += "; AMX unused (KTC_NO_AMX=1, no AMX-BF16, or Linux refused the tile state)"
    warnings = []
    if not cpu["features"]["avx512"]:
        warnings.append("no AVX-512: CPU experts run on 256-bit vectors; expect about half the "
                        "throughput of an AVX-512 machine per core")
    if cpu["cores"] < 2 or numba.get_num_threads() < 2:
        warnings.append("one thread: CPU experts cannot reach the memory bandwidth; unset "
                        "NUMBA_NUM_THREADS or give the process more cores")
    ram = _ram()
    if ram and ram < 32 * 2**30:
        warnings.append(f"{ram / 2**30:.0f} GiB of RAM: only small models' CPU experts fit; check with "
                        "ktc plan --ram before compiling")
    if not cuda:
        warnings.append("no CUDA device here: to plan for the GPU that will serve, give its memory "
                        "(ktc plan MODEL --vram 24GiB, or --hardware FILE --vram 24GiB with the "
                        "profile written here, which has no vram_bytes)")
        if torch_version != "not installed" and _nvidia_gpu_present() and _cpu_only_torch():
            warnings.append(f"this machine has an NVIDIA GPU but torch {torch_version} is a CPU-only "
                            "build: install a CUDA build (pip install torch --index-url "
                            "https://download.pytorch.org/whl/cu128; with the Makefile: make TORCH_SPEC= "
                            "setup after installing it)")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    if cuda and triton_version == "not installed":
        warnings.append("Triton is not installed: a decode step's GPU experts go through torch's operations "
                        "(about 30 kernel launches a layer) instead of ktc's two fused kernels; pip install "
                        "triton (CUDA builds of torch bring it)")
    from .cpu_load import other_processes_cores

    busy = other_processes_cores()
    if busy >= 0.5:
        warnings.append(f"other processes keep {busy:.1f} cores busy: the kernels use the others "
                        "(parallel regions wait for their slowest thread), and the bandwidth measured "
                        "above is lower than the machine's; measure on an idle machine")
    from ktc.formats.hardware_profile import HardwareProfile

    profile = HardwareProfile(vram_bytes=max((d["memory_bytes"] for d in cuda), default=0), ram_bytes=ram or 1,
                              cpu_bandwidth=bandwidth, source="ktc doctor")
    written = profile.to_json()
    if not cuda:  # no GPU to measure: the plan must be told the target's VRAM (--vram)
        del written["vram_bytes"]
    return {
        "versions": {"python": platform.python_version(), "ktc": ktc_version, "numpy": numpy.__version__,
                     "torch": torch_version, "numba": numba.__version__, "triton": triton_version},
        "cpu": cpu, "ram_bytes": ram, "cuda": cuda, "read_bandwidth_gbps": bandwidth / 1e9,
        "numba": {"threads": numba.get_num_threads(), "threading_layer": layer},
        "other_processes_cores": busy,
        "kernels": {"vnni": HAVE_VNNI, "amx": HAVE_AMX, "description": kernels},
        "warnings": warnings, "hardware_profile": written,
    }


def _nvidia_gpu_present() -> bool:
    """An NVIDIA driver is loaded (its proc file), or nvidia-smi is on the PATH."""
    import shutil

    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None or "+cpu" in torch.__version__


# How far the read bandwidth may move between the start and the end of a calibration before
# ``ktc doctor --calibrate`` says so. On the Zen 5 machine it switched between about 48 and 83
# GB/s within seconds to minutes, and a layer's fixed cost between 19 and 37-40 us with it: a
# profile calibrated in one phase predicted the other phase's decode up to 78% off
# (benchmarks/predict.py, each round's error from either calibration alone).
UNSTEADY = 0.15


def unsteady_warning(before: float, after: float) -> str | None:
    """The warning for a read bandwidth of ``before`` bytes/s at a calibration's start and
    ``after`` at its end, where they differ by more than ``UNSTEADY``; None otherwise."""
    if before <= 0 or after <= 0 or abs(after / before - 1) <= UNSTEADY:
        return None
    return (f"the read bandwidth moved from {before / 1e9:.1f} to {after / 1e9:.1f} GB/s while the kernels were "
            "measured: the machine's speed changed under the calibration (other work, or the host's own phases), "
            "and the profile holds medians across both; calibrate again when the machine is quiet, and compare two "
            "runs before trusting a prediction within 10%")


def disk_read_bandwidth(folder: str, nbytes: int = 256 * 1024 * 1024, chunk: int = 4 * 1024 * 1024) -> float:
    """The read bandwidth (bytes/s) of the disk under ``folder``: a file of ``nbytes`` written
    there, synced, dropped from the page cache (``posix_fadvise(DONTNEED)``, which drops clean
    pages) and read back in ``chunk``-byte reads, as the disk tier reads an expert; the file is
    removed. On a RAM-backed file system (tmpfs) the pages cannot be dropped: that measures
    memory."""
    import tempfile
    import time

    from ktc.errors import KtcError

    if not os.path.isdir(folder):
        raise KtcError("no such folder", path=folder)
    block = os.urandom(chunk)  # incompressible, in case the file system compresses
    try:
        fd, path = tempfile.mkstemp(prefix=".ktc-disk-", dir=folder)
    except OSError as exc:
        raise KtcError(f"cannot write a test file there: {exc.strerror}", path=folder) from None
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for _ in range(max(nbytes // chunk, 1)):
                f.write(block)
            os.fsync(f.fileno())
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            buffer = bytearray(chunk)
            started = time.perf_counter()
            read = 0
            while (n := f.readinto(buffer)) > 0:
                read += n
            seconds = time.perf_counter() - started
    finally:
        os.unlink(path)
    return read / seconds if seconds > 0 else 0.0

