"""Write a bundle: stream every block's bytes into a temporary file beside the output, checksum
them, write the manifest and header, and rename the finished file into place.

Experts are built one at a time (or in ``jobs`` worker processes, a bounded number in flight),
large non-expert tensors in row chunks, so peak memory is a few experts whatever the model's size.
Blocks are pure functions of their sources and options: the bytes do not depend on ``jobs``.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import queue
import re
import signal
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ktc.errors import InternalError, KtcError, mark_written, signals_held
from ktc.formats.bundle import HEADER_SIZE, PAGE, BundleHeader, align, manifest_json, new_block_hasher
from ktc.formats.dequant import to_float32, to_float32_rows
from ktc.formats.quantize import check_finite, convert, dequantize, quantize
from ktc.formats.schemes import get_scheme
from ktc.ir import ModelIR

from .base import Pass, PassContext
from .layout import BlockJob, BundleLayout, TensorJob

CHUNK_BYTES = 64 * 1024 * 1024  # non-expert tensors are converted this many source bytes at a time
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class BuildOptions:
    """How expert blocks are built (sent to the worker processes with each block)."""

    compress: bool = False  # zstd, where it makes the block smaller
    report_error: bool = False  # measure each expert's quantization error
    allow_nonfinite: bool = False  # accept NaN/Inf weights instead of refusing the tensor


@dataclass(frozen=True)
class ExpertError:
    layer: int
    expert: int
    rel_rmse: float
    max_abs_error: float


@dataclass
class EmitResult:
    path: str
    file_bytes: int
    source_bytes: int
    errors: list[ExpertError] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        """The whole file's sha256 (read back on request: it is not needed to write the file)."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as r:
            for chunk in iter(lambda: r.read(16 * 1024 * 1024), b""):
                digest.update(chunk)
        return digest.hexdigest()


def _fill_tensor(buf: np.ndarray, job: TensorJob, finite: bool) -> None:
    """Write one expert tensor into its place in ``buf``: each source converted to the scheme,
    stacked by rows (gate then up for ``gate_up``)."""
    at = job.offset
    per_source = job.nbytes // len(job.sources)
    for source in job.sources:
        if len(job.shape) == 1:  # float32 biases
            values = to_float32(source).reshape(-1).astype(np.float32)
            if finite:
                check_finite(values, source.name)
            part = values.view(np.uint8)
            buf[at: at + part.size] = part
        else:  # quantized straight into the expert's buffer where the scheme allows
            part = convert(source, job.scheme, out=buf[at: at + per_source], finite=finite).reshape(-1)
        at += part.size
    if at - job.offset != job.nbytes:
        raise KtcError(f"internal size mismatch for {job.name}: {at - job.offset} != {job.nbytes}")


def build_expert(block: BlockJob, options: BuildOptions = BuildOptions()
                 ) -> tuple[bytes | np.ndarray, int, ExpertError | None]:
    """The stored bytes of one expert block (zstd-compressed when asked and smaller), the
    uncompressed length, and optionally its quantization error. Runs in worker processes."""
    buf = np.empty(block.length, dtype=np.uint8)
    end = 0
    for job in block.tensors:  # zero only the padding: every other byte is written below
        buf[end:job.offset] = 0
        end = job.offset + job.nbytes
    buf[end:] = 0
    sq_err = sq_ref = 0.0
    max_err = 0.0
    report_error = options.report_error
    for job in block.tensors:
        _fill_tensor(buf, job, not options.allow_nonfinite)
        if report_error and len(job.shape) == 2:
            exact = np.concatenate([to_float32(s) for s in job.sources], axis=0)
            back = dequantize(buf[job.offset: job.offset + job.nbytes].reshape(job.shape[0], -1),
                              job.scheme, job.shape[1])
            diff = back - exact
            sq_err += float(np.sum(diff.astype(np.float64) ** 2))
            sq_ref += float(np.sum(exact.astype(np.float64) ** 2))
            max_err = max(max_err, float(np.max(np.abs(diff))) if diff.size else 0.0)
    error = None
    if report_error:
        if not (math.isfinite(sq_err) and math.isfinite(sq_ref)):
            rel = max_err = math.nan  # NaN/Inf weights (--allow-nonfinite): not measurable
        else:
            rel = (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0
        error = ExpertError(block.layer or 0, block.expert or 0, rel, max_err)
    if options.compress:
        import zstandard

        frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False,
                                         write_content_size=True).compress(buf.data)
        if len(frame) < buf.size:
            return frame, buf.size, error
    return buf, buf.size, error


def _dense_chunks(job: TensorJob, finite: bool = True) -> Iterator[bytes]:
    """A non-expert tensor's bytes in row chunks of about ``CHUNK_BYTES`` source bytes; with
    ``finite``, a tensor holding NaN or Inf is refused."""
    (ref,) = job.sources
    if len(job.shape) == 1 or len(ref.shape) == 1:
        values = to_float32(ref).reshape(1, -1)
        if finite:
            check_finite(values, ref.name)
        yield quantize(values, job.scheme).tobytes()
        return
    rows = ref.shape[0]
    per_row = max(ref.nbytes // max(rows, 1), 1)
    step = max(1, CHUNK_BYTES // per_row)
    if ref.scale_block is not None:
        step = max(ref.scale_block[0], step // ref.scale_block[0] * ref.scale_block[0])
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        scheme = get_scheme(job.scheme)
        if ref.scale is not None and ref.dtype in scheme.scaled_sources and scheme.from_scaled is not None:
            yield scheme.from_scaled(ref, start, stop, finite).tobytes()  # FP8 with block scales: exact
            continue
        if ref.scale is None and ref.dtype in scheme.sources and len(ref.shape) == 2:
            from ktc.ir import Slice

            raw = np.ascontiguousarray(ref.with_view(Slice(0, start, stop)).load())
            if finite:
                check_finite(raw, ref.name, ref.dtype)
            yield raw.tobytes()
            continue
        values = to_float32_rows(ref, start, stop).reshape(stop - start, -1)
        if finite:
            check_finite(values, ref.name)
        yield quantize(values, job.scheme).tobytes()


class _Writer:
    """Writes at increasing offsets with running checksums, done by a background thread so that
    writing and hashing one block overlap with building the next (file writes and xxh3 release
    the GIL). Regions that worker processes write themselves are skipped. OS errors become
    clear ``KtcError``s, raised in the caller's thread."""

    def __init__(self, f: Any, path: str) -> None:
        self.f = f
        self.fd = f.fileno()
        self.path = path
        self.pos = f.tell()
        self._error: OSError | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._run, name="ktc-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # keep draining so the producer never blocks
            data, at, digest = item
            try:
                _pwrite_all(self.fd, data, at)
            except OSError as exc:
                self._error = exc
                continue
            if digest is not None:
                digest.update(data)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise _os_error(self._error, self.path) from None

    def write(self, data: bytes | memoryview, digest: Any | None = None) -> None:
        """Queue ``data`` (which must not change afterwards) for writing and hashing."""
        self._raise_pending()
        self._queue.put((data, self.pos, digest))
        self.pos += len(data)

    def skip(self, n: int) -> None:
        """Leave ``n`` bytes to another writer (a worker process writes them)."""
        self._raise_pending()
        self.pos += n

    def close(self) -> None:
        """Wait for every queued write; raise the first error any of them met."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_pending()


def _pwrite_all(fd: int, data: bytes | memoryview | np.ndarray, at: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, at)
        view = view[n:]
        at += n


def _os_error(exc: OSError, path: str) -> KtcError:
    if exc.errno == errno.ENOSPC:
        return KtcError("the disk is full", path=path, hint="free space or write the bundle elsewhere")
    return KtcError(f"cannot write: {exc.strerror or exc}", path=path)


def _block_entry(block: BlockJob, offset: int, length: int, sha: str, stored: int | None,
                 raw_length: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": block.kind, "name": block.name, "segment": block.segment,
                             "offset": offset, "length": length, "xxh3_128": sha,
                             "tensors": [t.name for t in block.tensors]}
    if block.kind == "expert":
        entry.update({"layer": block.layer, "expert": block.expert, "device": block.device,
                      "scheme": block.scheme})
    if block.kind == "file":
        entry["size"] = len(block.payload or b"")
    if stored is not None:
        entry.update({"compression": "zstd", "compressed_length": stored, "raw_length": raw_length})
    return entry


def _tensor_entries(block: BlockJob, index: int, offset: int | None) -> list[dict[str, Any]]:
    out = []
    for t in block.tensors:
        entry: dict[str, Any] = {"name": t.name, "role": t.role, "segment": block.segment, "block": index,
                                 "offset": None if offset is None else offset + t.offset,
                                 "offset_in_block": t.offset, "nbytes": t.nbytes, "shape": list(t.shape),
                                 "scheme": t.scheme, "layout": t.layout}
        if t.layer is not None:
            entry["layer"] = t.layer
        if t.expert is not None:
            entry["expert"] = t.expert
        if t.source is not None:
            entry["source"] = t.source
        out.append(entry)
    return out


def _manifest(base: dict[str, Any], blocks: list[dict[str, Any]], tensors: list[dict[str, Any]],
              segments: list[dict[str, Any]]) -> bytes:
    return manifest_json({**base, "segments": segments, "blocks": blocks, "tensors": tensors})


def _skeleton_length(base: dict[str, Any], layout: BundleLayout, compress: bool) -> int:
    """An upper bound on the manifest's length: every number at its largest possible value."""
    big = 10 ** 18  # wider than any offset or length a real file has
    blocks, tensors = [], []
    for i, block in enumerate(layout.blocks):
        compressed = compress and block.kind == "expert"
        blocks.append(_block_entry(block, big, big, "0" * 32, big if compressed else None,
                                   big if compressed else None))
        tensors += _tensor_entries(block, i, None if compressed else big)
    segments = [{"name": n, "offset": big, "length": big} for n in ("device", "host")]
    return len(_manifest(base, blocks, tensors, segments))


def emit_bundle(layout: BundleLayout, out_path: str, manifest_base: dict[str, Any], *,
                jobs: int = 1, options: BuildOptions = BuildOptions(),
                progress: Callable[[int], None] | None = None) -> EmitResult:
    """Write the bundle to ``out_path`` atomically (see the module docstring)."""
    out_path = os.path.abspath(out_path)
    folder = os.path.dirname(out_path)
    if not os.path.isdir(folder):
        raise KtcError("the output folder does not exist", path=folder)
    if not os.access(folder, os.W_OK):
        raise KtcError("the output folder is not writable", path=folder)
    region = align(HEADER_SIZE + _skeleton_length(manifest_base, layout, options.compress), PAGE)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=temporary_prefix(out_path), suffix=".tmp")
    except OSError as exc:
        raise _os_error(exc, folder) from None
    try:
        # mkstemp makes the file private (0600); a bundle gets the permissions any new file gets.
        os.fchmod(fd, new_file_mode())
        # Sizing the file first made the writes 10x faster than appending here. ftruncate
        # leaves it sparse: a killed compile's file holds only what was written. Compressed
        # bundles are cut to their real size at the end.
        os.ftruncate(fd, region + sum(b.length for b in layout.blocks))
        with os.fdopen(fd, "r+b") as f:
            result = _write(f, tmp, layout, manifest_base, region, jobs, options, progress)
            f.truncate(result.file_bytes)
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise _os_error(exc, tmp) from None
        # the rename and its record as one step: a stop that landed between them left a whole
        # bundle in place that the command then said it had not written
        with signals_held():
            os.replace(tmp, out_path)
            mark_written(out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable
        dir_fd = os.open(folder, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
    except OSError:
        pass
    result.path = out_path
    return result


# A temporary bundle is ``.NAME.ktc-PID-XXXXXXXX.tmp`` beside the output: the writer's pid
# lets a later compile tell a stale file (writer gone: killed, power lost) from one being written.
_TEMPORARY = re.compile(r"^\..+\.ktc-(\d+)-[A-Za-z0-9_]+\.tmp$")


def temporary_prefix(out_path: str) -> str:
    return f".{os.path.basename(out_path)}.ktc-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(folder: str) -> list[tuple[str, int]]:
    """Remove the temporary bundles in ``folder`` whose writer process is gone; returns
    (path, bytes) of each one removed. A file whose pid is alive is kept, even when the pid
    was reused by another program: keeping a stale file is the safe mistake. The pid is this
    machine's: a folder that compiles on other machines (or in other pid namespaces) write into
    at the same time could lose a live writer's file, which that writer then reports as an
    error when it renames."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _TEMPORARY.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            size = os.stat(path).st_blocks * 512
            os.unlink(path)
        except OSError:
            continue
        removed.append((path, size))
    return removed


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (for files made with
    ``mkstemp``, which are private: 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write(f: Any, tmp: str, layout: BundleLayout, base: dict[str, Any], region: int, jobs: int,
           options: BuildOptions, progress: Callable[[int], None] | None) -> EmitResult:
    writer = _Writer(f, tmp)
    blocks: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    errors: list[ExpertError] = []
    digests: list[Any] = []
    segments: dict[str, list[int]] = {}
    experts = [b for b in layout.blocks if b.kind == "expert"]
    # With worker processes and no compression every expert's offset is known before it is
    # built: the workers write their experts into the file themselves and send back only
    # checksums (shipping every expert's bytes back through a pipe cost more than it saved).
    direct = jobs > 1 and not options.compress and len(experts) > 1
    offsets = {}
    if direct:
        at = region
        for block in layout.blocks:
            offsets[id(block)] = at
            at += block.length
    results = _expert_results(experts, jobs, options,
                              (tmp, [offsets[id(b)] for b in experts]) if direct else None)
    try:
        writer.write(bytes(region))
        for index, block in enumerate(layout.blocks):
            start = writer.pos
            digest = new_block_hasher()
            stored = raw_length = None
            checksum = ""
            if block.kind == "expert" and direct:  # written by a worker, padding included
                try:
                    checksum, raw_length, error = next(results)
                except OSError as exc:  # the worker's write failed (a full disk, ...)
                    raise _os_error(exc, tmp) from None
                if error is not None:
                    errors.append(error)
                writer.skip(block.length)
                used = block.length
                digest = None
            elif block.kind == "expert":
                payload, raw_length, error = next(results)
                if error is not None:
                    errors.append(error)
                view = memoryview(payload).cast("B")
                if len(view) != raw_length:
                    stored = len(view)
                writer.write(view, digest)
                used = len(view)
            elif block.kind == "file":
                used = len(block.payload or b"")
                writer.write(block.payload or b"", digest)
            else:
                (job,) = block.tensors
                used = 0
                for chunk in _dense_chunks(job, not options.allow_nonfinite):
                    writer.write(chunk, digest)
                    used += len(chunk)
                if used != job.nbytes:
                    raise KtcError(f"internal size mismatch for {job.name}: {used} != {job.nbytes}")
            # A compressed expert still starts on a page, so every expert stays randomly accessible.
            length = block.length if stored is None else align(used, PAGE)
            if length > used:
                writer.write(bytes(length - used), digest)
            blocks.append(_block_entry(block, start, length, checksum, stored, raw_length))
            digests.append(digest)
            tensors += _tensor_entries(block, index, None if stored is not None else start)
            seg = segments.setdefault(block.segment, [start, start])
            seg[1] = writer.pos
            if progress is not None:
                progress(block.source_bytes)
    finally:
        results.close()  # stops worker processes early when something failed
        writer.close()
    for entry, digest in zip(blocks, digests):
        if digest is not None:
            entry["xxh3_128"] = digest.hexdigest()
    seg_list = []
    cursor = region
    for name in ("device", "host"):
        start, end = segments.get(name, [cursor, cursor])
        seg_list.append({"name": name, "offset": start, "length": end - start})
        cursor = end
    manifest = _manifest(base, blocks, tensors, seg_list)
    if HEADER_SIZE + len(manifest) > region:
        raise KtcError("internal error: the manifest outgrew its reserved space")
    manifest_region = manifest + bytes(region - HEADER_SIZE - len(manifest))
    header = BundleHeader(HEADER_SIZE, len(manifest), region, writer.pos,
                          hashlib.sha256(manifest_region).digest())
    try:
        f.seek(0)
        f.write(header.to_bytes())
        f.write(manifest_region)
        f.seek(0, os.SEEK_END)
    except OSError as exc:
        raise _os_error(exc, tmp) from None
    return EmitResult(tmp, writer.pos, sum(b.source_bytes for b in layout.blocks), errors)


def _expert_results(experts: list[BlockJob], jobs: int, options: BuildOptions,
                    direct: tuple[str, list[int]] | None = None) -> Iterator[tuple[Any, int, ExpertError | None]]:
    """Expert results in order: built here, or by ``jobs`` worker processes with at most
    ``2 * jobs`` in flight (bounded memory). A result is (payload, length, error), or with
    ``direct`` = (file, offsets) the workers write each expert at its offset and a result is
    (xxh3-128 hex digest, length, error)."""
    if jobs <= 1 or len(experts) <= 1:
        for block in experts:
            yield build_expert(block, options)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def submit(pool: Any, i: int) -> Any:
        if direct is None:
            return pool.submit(build_expert, experts[i], options)
        return pool.submit(_build_and_write, experts[i], options, direct[0], direct[1][i])

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    # Not a with-block: its exit waits for the pool's manager thread, and a signal that arrives
    # while the first submit starts that thread leaves it created but not started, which the
    # wait then turns into a RuntimeError in place of the Ctrl-C or SIGTERM.
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),))
    pending: deque = deque()
    try:
        with signals_held():  # the workers start here (see ktc.errors.signals_held)
            pending.extend(submit(pool, i) for i in range(min(2 * jobs, len(experts))))
        following = len(pending)
        while pending:
            result = pending.popleft().result()
            if following < len(experts):
                pending.append(submit(pool, following))
                following += 1
            yield result
    except BaseException:
        # A failure, SIGTERM or Ctrl-C: stop the workers now instead of letting them finish
        # the experts in flight into a file that is about to be removed.
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _stop_workers(pool: Any) -> None:
    # The workers are taken before the shutdown: it drops the pool's reference to them, and
    # the exit then waited for the experts in flight (and, on a loaded machine, for workers
    # still importing) instead of stopping them. Python 3.14's terminate_workers does the same.
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    # Then wait for the pool's manager thread, which closes its wake-up pipe as it ends: Python
    # 3.11's exit handler writes to that pipe unless it is closed, and the two raced (a SIGTERM'd
    # compile printed "OSError: Bad file descriptor" from threading's shutdown; CPython
    # gh-125451, fixed in later versions with a lock).
    if manager is not None and manager.is_alive():
        manager.join(timeout=10)


_worker_files: dict[str, int] = {}  # a worker's descriptor of the file it writes experts into


def _build_and_write(block: BlockJob, options: BuildOptions, path: str, offset: int
                     ) -> tuple[str, int, ExpertError | None]:
    """In a worker: build one expert, write it at ``offset`` of ``path``, return its checksum."""
    buf, length, error = build_expert(block, options)
    if path not in _worker_files:
        _worker_files[path] = os.open(path, os.O_WRONLY)
    _pwrite_all(_worker_files[path], buf, offset)
    digest = new_block_hasher()
    digest.update(memoryview(buf))
    return digest.hexdigest(), length, error


def _worker_init(parent: int) -> None:
    _die_with_parent(parent)
    # Each worker is one of ``jobs`` processes: one Numba thread each keeps them from
    # oversubscribing the cores.
    import numba

    numba.set_num_threads(1)


def _die_with_parent(parent: int) -> None:
    """Have the kernel send this worker SIGKILL the moment its parent dies (Linux's
    ``PR_SET_PDEATHSIG``): a parent killed by SIGKILL (the OOM killer, a CI timeout) cannot tell
    its workers, and they would go on writing into a file nobody will rename. The signal follows
    the parent's thread that started the worker: the pool starts its workers from the thread that
    submits, which is the thread that writes the bundle. Elsewhere the workers finish their
    current expert and then fail on the closed pool."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


class Emit(Pass):
    """Write the laid-out bundle to ``out`` (see ``emit_bundle``); ``manifest_base(ir)`` gives
    the manifest's model, plan and provenance sections."""

    name: ClassVar[str] = "emit"
    requires: ClassVar[frozenset[str]] = frozenset({"layout"})
    produces: ClassVar[frozenset[str]] = frozenset({"bundle"})

    def __init__(self, out: str, manifest_base: Callable[[ModelIR], dict[str, Any]], *, jobs: int = 1,
                 options: BuildOptions = BuildOptions(), progress: bool = False) -> None:
        self.out, self.manifest_base = out, manifest_base
        self.jobs, self.options, self.progress = jobs, options, progress
        self.result: EmitResult | None = None

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        if ir is None or not isinstance(ir.layout, BundleLayout):
            raise InternalError("emit needs an IR with a layout")
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(b.source_bytes for b in ir.layout.blocks), unit="B", unit_scale=True,
                       unit_divisor=1024, desc="compiling", disable=None, leave=False)
        try:
            self.result = emit_bundle(ir.layout, self.out, self.manifest_base(ir), jobs=self.jobs,
                                      options=self.options,
                                      progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        return ir

    def verify(self, ir: ModelIR) -> None:
        if self.result is None or os.path.getsize(self.result.path) != self.result.file_bytes:
            raise InternalError("emit left no bundle of the size it wrote")
