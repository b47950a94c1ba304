"""What the decode cost model assumes, measured on this machine through ktc's own kernels.

``scheme_bandwidths`` reads weights the way a decode step does (one token through a layer's
chosen experts in one call, ``kernels.experts_token``; one token through a matrix,
``kernels.matvec``) in every CPU scheme, over more bytes than the last-level cache holds, at two
sizes of call each, and fits a call's time as a fixed part plus its bytes over a rate: what the
cost model charges a call of the scheme.
The weights are valid blocks of each scheme (quantized Gaussian rows, or for schemes ktc only
passes through, random codes under finite scales) tiled to size: a kernel's speed depends on
the layout, not on the values.

Rounds are interleaved over the schemes and each figure is the median of its rounds: the read
bandwidth of a shared machine drifts within seconds, and one scheme measured after another
would carry the drift into their ratio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np

from ktc.formats.kernel_args import read_only
from ktc.formats.quantize import quantize
from ktc.formats.schemes import SCHEMES, get_scheme

from . import interleave as interleaving
from . import kernels, rows, vnni

# One layer's chosen experts (k, hidden, intermediate): Qwen3-30B-A3B's 8 small ones and
# Mixtral-8x7B's 2 large ones. A call's time is fitted as a fixed part (its parallel regions'
# start and join, the activations' quantization, the rows' ramp: 50-400 us here, most for the
# K-quants) plus its bytes over a rate: many small experts pay the fixed part, large ones barely.
EXPERT_SHAPES = ((8, 2048, 768), (2, 4096, 14336))
MATRIX_COLS = 4096
# Rows of these lengths are read at a rate each (the hidden sizes of the models ktc's figures
# come from: Qwen3-30B-A3B's 2048, Mixtral-8x7B's 4096, DeepSeek-V3's 7168). The rate moves with
# the row's length, and not in one direction: q8_0 from memory here, 128 MiB a call, medians of
# 3 interleaved rounds, 1024-2048 columns 31 GB/s, 4096 29, 6144-7168 26-27, 8192-16384 28-29. One
# rate at 4096 columns and a cost a row fitted from rows of 1024 (which usually came out
# negative under the drift, and so zero) predicted Qwen3-30B-A3B's lm_head (151936 x 2048) 6-10%
# slow and a DeepSeek-V3-shaped one (129280 x 7168) 8-10% fast; a rate at each length, 1% slow
# and 11-13% fast (7168 was not among the lengths then).
MATRIX_ROW_LENGTHS = (1024, 2048, 4096, 7168)
# Matrix calls (rows, columns): as many bytes as Qwen3-30B-A3B's attention projections (the
# fixed part of a call, fitted with the rate at MATRIX_COLS columns), and CALL_BYTES (lm_head's
# size) in rows of each of MATRIX_ROW_LENGTHS.
MATRIX_CALLS = ((2048, MATRIX_COLS), *((None, cols) for cols in MATRIX_ROW_LENGTHS))
CALL_BYTES = 128 * 1024 * 1024  # the bytes of a large matrix call (lm_head's size)
# Bytes a measurement cycles over at least: four large calls, sixteen times a 32 MiB L3. A cache
# keeps part of what it was read through even when that is a few times its size: on the Zen 5
# machine (32 MiB L3) q8_0 rows of 2048 read 55.3 GB/s in calls that re-read one 128 MiB, 52.9
# cycling over two, 51.4-51.8 over four to eight, and 49.4-50.4 through a 330 MB lm_head (a
# bundle's, and a probe of its size; medians of 7 interleaved rounds): with one 128 MiB call
# cycled over, lm_head came out 5-20% faster than measured in every case of
# benchmarks/predict.py.
WORKING_SET = 4 * CALL_BYTES
_HALF_SCALE = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)


def last_level_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of the largest cache the OS reports for a CPU (sysfs), 0 where it reports none."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for path in glob.glob(os.path.join(cpu, "index*", "size")):
        try:
            with open(path) as f:
                text = f.read().strip()  # e.g. "491520K"
        except OSError:
            continue
        number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
        if number.isdigit():
            largest = max(largest, int(number) * unit)
    return largest


def probe_bytes() -> int:
    """Bytes a measurement cycles over: ``WORKING_SET``, or twice the last-level cache where that
    is larger, so that every call reads from memory as a decode step's weights do. With 128 MiB
    on a CPU whose L3 holds 480 MiB, matrices read 13-18% faster than from memory (q8_0 33-34
    against 28-29 GB/s), and `lm_head` took 12-27% longer than predicted in every case; with
    one 128 MiB on a 32 MiB L3, 10% faster (``WORKING_SET``'s note)."""
    wanted = max(WORKING_SET, 2 * last_level_cache_bytes())
    try:  # a few schemes' probes are held at once (``scheme_bandwidths``): a sixteenth of free RAM each at most
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return wanted
    return max(WORKING_SET, min(wanted, free // 16))


def mapped_copy(array: np.ndarray, folder: str) -> np.ndarray:
    """``array``'s bytes (uint8) read through a file's map, as ``ktc run`` reads a bundle: written
    to a file in ``folder``, its cached pages dropped and read afresh from its start (as a first run
    after reading the bundle finds them), then mapped read-only; the file is unlinked at once (the
    map keeps it). A file's cached pages can read slower than the process's own memory, by where
    the page cache put them (docs/runtime.md: 19.5-20.6 against 27-33 GB/s on one machine); on
    the Zen 5 machine the two measured alike (matrix rates 52-64 GB/s either way, three
    interleaved pairs)."""
    import mmap
    import tempfile

    with tempfile.NamedTemporaryFile(dir=folder, prefix="ktc-probe-", delete=False) as f:
        path = f.name
        f.write(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
        f.flush()
        os.fsync(f.fileno())  # written back, so that its pages can be dropped
    try:
        read_afresh(path)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    finally:
        os.unlink(path)
    return np.frombuffer(mapped, dtype=np.uint8)


def read_afresh(path: str) -> None:
    """The whole file at ``path`` in the page cache, read afresh from its start: its cached pages
    (those no process maps) dropped first, then read in order, as a first run after reading the
    file finds them (where the page cache puts them sets how fast a map reads: docs/runtime.md)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, 64 << 20):
            pass
    finally:
        os.close(fd)


def cpu_schemes() -> tuple[str, ...]:
    """Every scheme with a CPU kernel that a decode step can read."""
    return tuple(name for name, s in SCHEMES.items() if "cpu" in s.devices and _has_kernel(name))


def _has_kernel(name: str) -> bool:
    try:
        kernels.cpu_kernels(name)
    except KeyError:
        return rows.kind(name) is not None
    return True


def scheme_rows(name: str, rows_: int, cols: int, seed: int = 0) -> np.ndarray:
    """``rows_`` valid rows [rows_, row_bytes] (uint8) of scheme ``name``: a 64-row block made
    once (quantized Gaussian values; random codes with finite scales where ktc has no
    quantizer) and tiled."""
    scheme = get_scheme(name)
    rng = np.random.default_rng(seed)
    block = min(64, rows_)
    if scheme.quantize is not None:
        made = quantize(rng.standard_normal((block, cols), dtype=np.float32) * 0.02, scheme)
        made = np.ascontiguousarray(made).view(np.uint8).reshape(block, -1)
    else:
        made = rng.integers(0, 256, (block, scheme.matrix_bytes(1, cols)), dtype=np.uint8)
        blocks = made[:, : cols // scheme.block_elems * scheme.block_bytes].reshape(block, -1, scheme.block_bytes)
        for at in scheme.half_scales:
            blocks[:, :, at:at + 2] = _HALF_SCALE
        for at in scheme.e8m0_scales:
            blocks[:, :, at] = 120
    reps = -(-rows_ // block)
    return np.ascontiguousarray(np.tile(made, (reps, 1))[:rows_])


def interleaved(scheme: str, interleave: bool = True) -> bool:
    """Whether ``ktc run`` (without ``--no-interleave``: ``interleave``) reads matrices of
    ``scheme`` from copies with their rows interleaved on this CPU (``runtime.interleave``; those
    whose shape allows it, ``interleave.fits``): what the probes then read too."""
    return interleave and vnni.HAVE_VNNI and scheme in interleaving.SCHEMES


class _ExpertsProbe:
    """Copies of one layer's chosen experts in ``scheme``, laid out as a bundle lays them out
    (gate/up then down, each at its byte offset in one file), enough copies to exceed the
    cache; ``run()`` sends one token through the next copy. ``shared``: another probe's file of
    the scheme, read as this one's experts where it holds enough bytes (whole blocks either way:
    a scheme's probes then hold one working set, not one each). With ``interleave``, the
    matrices of a scheme that ``ktc run`` interleaves (``interleaved``; int8 experts as q8_0's)
    are read interleaved, as its copies are (in the process's memory, not mapped), through the
    same one-token call."""

    def __init__(self, scheme: str, shape: tuple[int, int, int], working_set: int = WORKING_SET,
                 shared: np.ndarray | None = None, mapped: str | None = None, interleave: bool = False):
        k, hidden, inter = shape
        # ``ktc run`` reads int8 experts from copies in q8_0's layout (``interleave.COPIES``): the
        # probe reads such copies, its rate over int8's bytes
        stored = scheme
        if scheme in interleaving.COPIES and interleaved(interleaving.copy_scheme(scheme), interleave):
            scheme = interleaving.copy_scheme(scheme)
        # (gate/up, down) read interleaved, as ``ExpertSet`` reads them (rows that do not fill
        # whole units too, their copy's last unit filled out): a shared file's bytes are whole
        # groups either way
        copied = interleaved(scheme, interleave)
        which = (copied and interleaving.fits(2 * inter, hidden, scheme, tail=True),
                 copied and interleaving.fits(hidden, inter, scheme, tail=True))
        gate_up_bytes, per_expert, copies = self._layout(scheme, shape, working_set, which)
        self.bytes_per_call = k * self._layout(stored, shape, working_set)[1]
        if shared is not None and shared.nbytes >= k * copies * per_expert:
            self.file = shared
        else:
            gate_up = scheme_rows(scheme, 2 * inter, hidden)
            down = scheme_rows(scheme, hidden, inter, seed=1)
            if which[0]:
                gate_up = interleaving.repack(gate_up, scheme)
            if which[1]:
                down = interleaving.repack(down, scheme)
            self.file = np.tile(np.concatenate([gate_up.reshape(-1), down.reshape(-1)]), k * copies)
            if mapped is not None and not any(which):
                self.file = mapped_copy(self.file, mapped)
        # where a matrix is read interleaved: the one-token call's kinds and bytes a row (tables),
        # and its file, the file's float32 view and the value tables (made once, not each call)
        self.tables = None
        if any(which):
            row_bytes = self._row_bytes
            self.tables = tuple(np.full(k, code, dtype=np.int64) for code in (
                rows.INTERLEAVED[scheme] if which[0] else rows.kind(scheme), row_bytes(scheme, hidden, which[0]),
                rows.INTERLEAVED[scheme] if which[1] else rows.kind(scheme), row_bytes(scheme, inter, which[1])))
            self.file = read_only(self.file[: self.file.nbytes // 4 * 4])
            self._call = (self.file, self.file.view(np.float32), *vnni._tables())
        starts = np.arange(k * copies, dtype=np.int64).reshape(copies, k) * per_expert
        self.offsets = [(s, s + gate_up_bytes) for s in starts]
        self.scheme, self.hidden, self.inter = scheme, hidden, inter
        self.x = np.random.default_rng(2).standard_normal(hidden).astype(np.float32)
        self.weights = np.full(k, 1.0 / k, dtype=np.float32)
        self.at = 0

    @staticmethod
    def _row_bytes(scheme: str, cols: int, copied: bool) -> int:
        """Bytes of a row of ``cols`` values, stored or in the interleaved copy (``copied``)."""
        stored = get_scheme(scheme).matrix_bytes(1, cols)
        return interleaving.copy_row_bytes(scheme, stored) if copied else stored

    @staticmethod
    def _layout(scheme: str, shape: tuple[int, int, int], working_set: int,
                which: tuple[bool, bool] = (False, False)) -> tuple[int, int, int]:
        """(an expert's gate/up bytes, its bytes, the copies of the k experts cycled over), its
        matrices stored or interleaved (``which``: gate/up, down)."""
        k, hidden, inter = shape
        gate_up = 2 * inter * _ExpertsProbe._row_bytes(scheme, hidden, which[0])
        per_expert = gate_up + hidden * _ExpertsProbe._row_bytes(scheme, inter, which[1])
        return gate_up, per_expert, max(2, -(-working_set // (k * per_expert)))

    @staticmethod
    def bytes_needed(scheme: str, shape: tuple[int, int, int], working_set: int) -> int:
        """The bytes of a probe's file."""
        _, per_expert, copies = _ExpertsProbe._layout(scheme, shape, working_set)
        return shape[0] * copies * per_expert

    def run(self) -> None:
        gu, dn = self.offsets[self.at]
        self.at = (self.at + 1) % len(self.offsets)
        if self.tables is None:
            kernels.experts_token(self.file, self.scheme, gu, dn, self.hidden, self.inter, self.x, self.weights)
            return
        gu_kinds, gu_rows, dn_kinds, dn_rows = self.tables
        rows.experts_token(*self._call, gu_kinds, gu, gu_rows, dn_kinds, dn, dn_rows, self.x, self.weights,
                           self.inter, False, np.float32(7.0), np.float32(1.702), rows._NO_BIAS, False, rows._NO_BIAS,
                           False, vnni.stamps())


class _MatrixProbe:
    """A matrix of ``cols`` columns in ``scheme``, larger than the cache; ``run()`` multiplies
    ``rows`` of it (the next ones each call; by default as many as ``CALL_BYTES`` hold) by
    one vector (a projection, or ``lm_head``, in a decode step). ``shared``: the bytes of another
    probe of the scheme (``scheme_rows`` at ``MATRIX_COLS``) to read as this one's rows, instead
    of its own: a scheme's probes then hold one working set, not one each (twice a 480 MiB L3).
    With ``interleave``, a scheme that ``ktc run`` interleaves (``interleaved``) is read from an
    interleaved copy in the process's memory (not mapped), as its matrices are, in whole groups."""

    def __init__(self, scheme: str, working_set: int = WORKING_SET, rows: int | None = None,
                 cols: int = MATRIX_COLS, shared: np.ndarray | None = None, mapped: str | None = None,
                 interleave: bool = False):
        row_bytes = get_scheme(scheme).matrix_bytes(1, cols)
        copied = interleaved(scheme, interleave)
        if shared is not None and shared.nbytes >= max(64, 2 * (rows or 0)) * row_bytes:
            # whole blocks either way: a row of ``cols`` is the next ``row_bytes`` bytes (for
            # int8, whose rows end in a scale, a scale read from codes: one multiply a row)
            flat = shared.reshape(-1)
            raw = flat[: flat.nbytes // row_bytes * row_bytes].reshape(-1, row_bytes)
        else:
            count = max(64, working_set // row_bytes, 2 * (rows or 0))
            raw = scheme_rows(scheme, -(-count // 16) * 16 if copied else count, cols)
            if copied and interleaving.fits(raw.shape[0], cols, scheme):
                raw = read_only(interleaving.repack(raw, scheme))
            elif mapped is not None:
                raw = mapped_copy(raw, mapped).reshape(raw.shape)
        self.raw = raw
        plain = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}.get(scheme)
        if plain is not None:  # the plain schemes' kernels take their own dtype
            raw = raw.view(plain)
        if rows is None:  # lm_head's size: ``CALL_BYTES`` a call (the next ones of the whole)
            rows = max(1, min(raw.shape[0], min(CALL_BYTES, working_set // 4) // row_bytes))
            if copied and rows > 16:
                rows -= rows % 16  # whole groups
        self.interleaved = copied and interleaving.fits(rows, cols, scheme)
        self.parts = [raw[at:at + rows] for at in range(0, raw.shape[0] - rows + 1, rows)]
        self.scales = [kernels.int8_row_scales(part, cols) if scheme == "int8" else None
                       for part in self.parts]
        self.bytes_per_call = int(self.parts[0].nbytes)
        self.rows_per_call = rows
        self.scheme = scheme
        self.x = np.random.default_rng(3).standard_normal(cols).astype(np.float32)
        self.out = np.empty(rows, dtype=np.float32)
        self.at = 0

    def run(self) -> None:
        at = self.at
        self.at = (at + 1) % len(self.parts)
        if self.interleaved:
            interleaving.matvec(self.parts[at], self.scheme, self.x, self.out)
        else:
            kernels.matvec(self.parts[at], self.scheme, self.x, self.out, self.scales[at])


def _median_seconds(probes: dict[Any, Any], rounds: int, calls: int) -> dict[Any, float]:
    """Seconds a call of each probe: per round, ``calls`` calls after one warm call, timed
    together; the median over interleaved rounds."""
    times: dict[Any, list[float]] = {name: [] for name in probes}
    for name, probe in probes.items():  # compile and fault the pages in, outside the timing
        probe.run()
    for _ in range(rounds):
        for name, probe in probes.items():
            probe.run()
            started = time.perf_counter()
            for _ in range(calls):
                probe.run()
            times[name].append((time.perf_counter() - started) / calls)
    return {name: float(np.median(t)) for name, t in times.items()}


def scheme_bandwidths(schemes: Iterable[str] | None = None, *, rounds: int = 5, calls: int = 8,
                      working_set: int | None = None, shapes: tuple[tuple[int, int, int], ...] = EXPERT_SHAPES,
                      matrix_calls: tuple[tuple[int | None, int], ...] = MATRIX_CALLS,
                      progress: Callable[[str], None] | None = None,
                      mapped: str | None = None, kept: dict[Any, Any] | None = None,
                      interleave: bool = True) -> dict[str, dict[str, float]]:
    """``{"experts": {scheme: bytes/s}, "experts_call_seconds": {scheme: s}, "experts_call_bytes":
    {scheme: bytes}, and the same three of "matrix"}``: what the one-token kernels reach on this
    machine (see the module's docstring) through the fused experts call (fitted over calls at
    ``shapes``) and a matrix-vector product (over ``matrix_calls``: the first the smaller call,
    then larger ones at ``MATRIX_COLS`` columns and at other row lengths, each of whose rates is
    ``"matrix@COLS"``): the rate, the fixed part of a call, and the bytes of the smaller call
    (where the fixed part was measured).
    Schemes whose experts the fused call cannot take on this CPU are measured as a matrix only.
    ``mapped``: a folder where the weights are read through a file's map (``mapped_copy``), as
    ``ktc run`` reads a bundle; None: from the process's own memory (``ktc run --no-mmap``).
    ``kept``: probes made by an earlier call with the same arguments, by key, measured again
    instead of made again (making them, hundreds of MiB a scheme written and read afresh, takes
    most of a call); those made here are added to it (its holder keeps their memory).
    ``interleave``: the schemes ``ktc run`` reads from interleaved copies on this CPU
    (``interleaved``) are measured so, from the process's memory (``mapped`` applies to the
    others); False measures the stored layout, as ``ktc run --no-interleave`` reads it."""
    names = tuple(cpu_schemes() if schemes is None else schemes)
    working_set = working_set or probe_bytes()
    result: dict[str, dict[str, float]] = {f"{path}{part}": {} for path in ("experts", "matrix")
                                           for part in ("", "_call_seconds", "_call_bytes")}
    fused = tuple(n for n in names if _fused(n))
    # A few schemes at a time: each holds its working set while the rounds interleave.
    for start in range(0, len(fused), 3):
        group = fused[start:start + 3]
        if progress:
            progress(f"experts: {', '.join(group)}")
        probes = {}
        for n in group:  # the call that cycles over the most bytes first: the others read its file
            shared = None
            for i in sorted(range(len(shapes)), key=lambda i: -_ExpertsProbe.bytes_needed(n, shapes[i], working_set)):
                probes[n, i] = _kept(kept, ("experts", n, i),
                                     lambda: _ExpertsProbe(n, shapes[i], working_set, shared, mapped, interleave))
                shared = probes[n, i].file if shared is None else shared
        seconds = _median_seconds(probes, rounds, calls)
        for n in group:
            _fit(result, "experts", n, probes[n, 0].bytes_per_call, seconds[n, 0], probes[n, 1].bytes_per_call,
                 seconds[n, 1])
        del probes
    for start in range(0, len(names), 3):
        group = names[start:start + 3]
        if progress:
            progress(f"matrices: {', '.join(group)}")
        probes = {}
        for n in group:
            shared = None
            for i, (call_rows, cols) in enumerate(matrix_calls):
                probes[n, i] = _kept(kept, ("matrix", n, i),
                                     lambda: _MatrixProbe(n, working_set, call_rows, cols, shared, mapped, interleave))
                if cols == MATRIX_COLS and shared is None:
                    shared = probes[n, i].raw
        seconds = _median_seconds(probes, rounds, calls)
        for n in group:
            _fit_lengths(result, n, [(cols, probes[n, i].bytes_per_call, seconds[n, i])
                                     for i, (_, cols) in enumerate(matrix_calls)])
        del probes
    return result


def _kept(kept: dict[Any, Any] | None, key: Any, make: Callable[[], Any]) -> Any:
    """``kept[key]``, made by ``make`` and put there first where it is not there (``make()`` alone
    without ``kept``)."""
    if kept is None:
        return make()
    if key not in kept:
        kept[key] = make()
    return kept[key]


def _fit(result: dict[str, dict[str, float]], path: str, name: str, b0: float, t0: float, b1: float,
         t1: float) -> None:
    """A call's time as a fixed part plus bytes over a rate, through a call of ``b0`` bytes
    (``t0`` seconds) and a larger one, into ``result[path]``, ``result[path + "_call_seconds"]``
    and ``result[path + "_call_bytes"]``."""
    slope = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
    if not 0 < slope <= t1 / b1:  # no fixed part measurable under the drift: the larger call's rate
        slope = t1 / b1
    result[path][name] = 1.0 / slope
    result[path + "_call_seconds"][name] = max(t0 - b0 * slope, 0.0)
    result[path + "_call_bytes"][name] = float(b0)


def _fit_lengths(result: dict[str, dict[str, float]], name: str, calls: list[tuple[int, int, float]]) -> None:
    """A matrix call's time as a fixed part plus bytes over a rate that depends on the rows'
    length, from calls (columns, bytes, seconds): the first the smallest, whose fixed part is
    fitted with the rate of the larger call at ``MATRIX_COLS`` columns (``_fit``:
    ``result["matrix"]``), and each larger call's rate, that fixed part taken off, into
    ``result["matrix@COLS"]``."""
    (_, b0, t0), *larger = calls
    b1, t1 = next((b, t) for cols, b, t in larger if cols == MATRIX_COLS)
    _fit(result, "matrix", name, b0, t0, b1, t1)
    fixed = result["matrix_call_seconds"][name]
    for cols, b, t in larger:
        result.setdefault(f"matrix@{cols}", {})[name] = b / (t - fixed) if t > fixed else b / t


def _fused(name: str) -> bool:
    """Whether one token through a layer's experts in ``name`` takes the fused call here."""
    return (vnni.HAVE_VNNI and name in vnni.FUSED) or name == "int8"


def prefill_ops(scheme: str = "q8_0", *, tokens: int = 64, rows_: int = 2048, cols: int = 2048,
                rounds: int = 5, calls: int = 4) -> float:
    """Ops a second (a multiply-add counts two) of ktc's batched CPU product (``lanes.matmul``, or
    ``amx.matmul`` on a CPU with AMX from ``kernels.AMX_MIN_TOKENS``: what a prompt's experts run
    through) of ``tokens`` tokens and a ``rows_`` x ``cols`` matrix of ``scheme``, the median over
    rounds; 0.0 where this CPU has no batched kernel for it (no VNNI: the products then decode to
    bf16 for torch, whose rate the planner does not model)."""
    from . import lanes

    if not lanes.fits(scheme, cols):
        return 0.0
    raw = scheme_rows(scheme, rows_, cols)
    x = np.random.default_rng(0).standard_normal((tokens, cols), dtype=np.float32)
    multiply = kernels.cpu_kernels(scheme).in_place[1]  # type: ignore[index]  # lanes' schemes have one
    probe = SimpleNamespace(run=lambda: multiply(x, raw, scheme))  # what ``_median_seconds`` calls
    seconds = _median_seconds({"prefill": probe}, rounds, calls)["prefill"]
    return 2.0 * tokens * rows_ * cols / seconds


def device_bandwidths(device: Any, *, nbytes: int = 512 * 1024 * 1024, rounds: int = 5) -> dict[str, float]:
    """``{"gpu_bandwidth": bytes/s, "pcie_bandwidth": bytes/s}`` on a torch ``device``: a bf16
    matrix of ``nbytes`` times one vector there (a decode step's read of device weights), and
    ``nbytes`` copied from page-locked host memory to it (an upload); medians of interleaved
    rounds. On a CUDA device the host memory is pinned and each figure waits for the device."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)
    cols = 4096
    weight = torch.empty((nbytes // (2 * cols), cols), dtype=torch.bfloat16, device=device).normal_()
    x = torch.randn(cols, dtype=torch.bfloat16, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times: dict[str, list[float]] = {"gpu_bandwidth": [], "pcie_bandwidth": []}

    def timed(run: Callable[[], Any]) -> float:
        sync()
        started = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - started

    for _ in range(rounds + 1):  # the first round warms up (kernels, allocator, page faults)
        read = timed(lambda: torch.mv(weight, x))
        copy = timed(lambda: target.copy_(host, non_blocking=cuda))
        times["gpu_bandwidth"].append(weight.numel() * 2 / read)
        times["pcie_bandwidth"].append(nbytes / copy)
    return {name: float(np.median(values[1:])) for name, values in times.items()}
