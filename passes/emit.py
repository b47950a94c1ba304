"""Write a bundle: stream every block's bytes into a temporary file beside the output, checksum
them, write the manifest and header, and rename the finished file into place.

Experts are built one at a time (or in ``jobs`` worker processes, a bounded number in flight),
large non-expert tensors in row chunks, so peak memory is a few experts whatever the model's size.
Blocks are pure functions of their sources and options: the bytes do not depend on ``jobs``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktc.errors import KtcError
from ktc.formats.bundle import HEADER_SIZE, PAGE, BundleHeader, align, manifest_json
from ktc.formats.dequant import to_float32, to_float32_rows
from ktc.formats.quantize import convert, dequantize, quantize

from .layout import BlockJob, BundleLayout, TensorJob

CHUNK_BYTES = 64 * 1024 * 1024  # non-expert tensors are converted this many source bytes at a time
ZSTD_LEVEL = 3


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
    sha256: str
    errors: list[ExpertError] = field(default_factory=list)


def _matrix_payload(job: TensorJob) -> np.ndarray:
    """One expert tensor's bytes: each source converted to the scheme and stacked by rows."""
    if len(job.shape) == 1:  # float32 biases
        return np.concatenate([to_float32(s).reshape(-1) for s in job.sources]).astype(np.float32).view(np.uint8)
    parts = [convert(s, job.scheme) for s in job.sources]
    return np.ascontiguousarray(np.concatenate(parts, axis=0)).reshape(-1)


def build_expert(block: BlockJob, compress: bool = False, report_error: bool = False
                 ) -> tuple[bytes, int, ExpertError | None]:
    """The stored bytes of one expert block (zstd-compressed when asked and smaller), the
    uncompressed length, and optionally its quantization error. Runs in worker processes."""
    buf = bytearray(block.length)
    sq_err = sq_ref = 0.0
    max_err = 0.0
    for job in block.tensors:
        payload = _matrix_payload(job)
        if payload.size != job.nbytes:
            raise KtcError(f"internal size mismatch for {job.name}: {payload.size} != {job.nbytes}")
        buf[job.offset: job.offset + job.nbytes] = payload.tobytes()
        if report_error and len(job.shape) == 2:
            exact = np.concatenate([to_float32(s) for s in job.sources], axis=0)
            back = dequantize(payload.reshape(job.shape[0], -1), job.scheme, job.shape[1])
            diff = back - exact
            sq_err += float(np.sum(diff.astype(np.float64) ** 2))
            sq_ref += float(np.sum(exact.astype(np.float64) ** 2))
            max_err = max(max_err, float(np.max(np.abs(diff))) if diff.size else 0.0)
    error = None
    if report_error:
        rel = (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0
        error = ExpertError(block.layer or 0, block.expert or 0, rel, max_err)
    raw = bytes(buf)
    if compress:
        import zstandard

        frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False,
                                         write_content_size=True).compress(raw)
        if len(frame) < len(raw):
            return frame, len(raw), error
    return raw, len(raw), error


def _dense_chunks(job: TensorJob) -> Iterator[bytes]:
    """A non-expert tensor's bytes in row chunks of about ``CHUNK_BYTES`` source bytes."""
    (ref,) = job.sources
    if len(job.shape) == 1 or len(ref.shape) == 1:
        values = to_float32(ref).reshape(1, -1)
        yield quantize(values, job.scheme).tobytes()
        return
    rows = ref.shape[0]
    per_row = max(ref.nbytes // max(rows, 1), 1)
    step = max(1, CHUNK_BYTES // per_row)
    if ref.scale_block is not None:
        step = max(ref.scale_block[0], step // ref.scale_block[0] * ref.scale_block[0])
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if ref.scale is None and ref.dtype.lower() == job.scheme and len(ref.shape) == 2:
            from ktc.ir import Slice

            yield np.ascontiguousarray(ref.with_view(Slice(0, start, stop)).load()).tobytes()
            continue
        values = to_float32_rows(ref, start, stop).reshape(stop - start, -1)
        yield quantize(values, job.scheme).tobytes()


class _Writer:
    """Sequential writes with a running sha256, turning OS errors into clear ``KtcError``s."""

    def __init__(self, f: Any, path: str) -> None:
        self.f = f
        self.path = path
        self.pos = f.tell()

    def write(self, data: bytes | memoryview, digest: Any | None = None) -> None:
        try:
            self.f.write(data)
        except OSError as exc:
            raise _os_error(exc, self.path) from None
        if digest is not None:
            digest.update(data)
        self.pos += len(data)


def _os_error(exc: OSError, path: str) -> KtcError:
    if exc.errno == errno.ENOSPC:
        return KtcError("the disk is full", path=path, hint="free space or write the bundle elsewhere")
    return KtcError(f"cannot write: {exc.strerror or exc}", path=path)


def _block_entry(block: BlockJob, offset: int, length: int, sha: str, stored: int | None,
                 raw_length: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": block.kind, "name": block.name, "segment": block.segment,
                             "offset": offset, "length": length, "sha256": sha,
                             "tensors": [t.name for t in block.tensors]}
    if block.kind == "expert":
        entry.update({"layer": block.layer, "expert": block.expert, "device": block.device,
                      "scheme": block.scheme})
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
        blocks.append(_block_entry(block, big, big, "0" * 64, big if compressed else None,
                                   big if compressed else None))
        tensors += _tensor_entries(block, i, None if compressed else big)
    segments = [{"name": n, "offset": big, "length": big} for n in ("device", "host")]
    return len(_manifest(base, blocks, tensors, segments))


def emit_bundle(layout: BundleLayout, out_path: str, manifest_base: dict[str, Any], *,
                jobs: int = 1, compress: bool = False, report_error: bool = False,
                progress: Callable[[int], None] | None = None) -> EmitResult:
    """Write the bundle to ``out_path`` atomically (see the module docstring)."""
    out_path = os.path.abspath(out_path)
    folder = os.path.dirname(out_path)
    if not os.path.isdir(folder):
        raise KtcError("the output folder does not exist", path=folder)
    if not os.access(folder, os.W_OK):
        raise KtcError("the output folder is not writable", path=folder)
    region = align(HEADER_SIZE + _skeleton_length(manifest_base, layout, compress), PAGE)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out_path)}.", suffix=".tmp")
    except OSError as exc:
        raise _os_error(exc, folder) from None
    try:
        with os.fdopen(fd, "wb") as f:
            result = _write(f, tmp, layout, manifest_base, region, jobs, compress, report_error, progress)
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise _os_error(exc, tmp) from None
        os.replace(tmp, out_path)
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


def _write(f: Any, tmp: str, layout: BundleLayout, base: dict[str, Any], region: int, jobs: int,
           compress: bool, report_error: bool, progress: Callable[[int], None] | None) -> EmitResult:
    writer = _Writer(f, tmp)
    writer.write(bytes(region))
    blocks: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    errors: list[ExpertError] = []
    experts = [b for b in layout.blocks if b.kind == "expert"]
    results = _expert_results(experts, jobs, compress, report_error)
    segments: dict[str, list[int]] = {}
    source_bytes = 0
    for index, block in enumerate(layout.blocks):
        start = writer.pos
        digest = hashlib.sha256()
        stored = raw_length = None
        if block.kind == "expert":
            payload, raw_length, error = next(results)
            if error is not None:
                errors.append(error)
            if len(payload) != raw_length:
                stored = len(payload)
            writer.write(payload, digest)
            used = len(payload)
        else:
            (job,) = block.tensors
            used = 0
            for chunk in _dense_chunks(job):
                writer.write(chunk, digest)
                used += len(chunk)
            if used != job.nbytes:
                raise KtcError(f"internal size mismatch for {job.name}: {used} != {job.nbytes}")
        # A compressed expert still starts on a page, so every expert stays randomly accessible.
        length = block.length if stored is None else align(used, PAGE)
        writer.write(bytes(length - used), digest)
        blocks.append(_block_entry(block, start, length, digest.hexdigest(), stored, raw_length))
        tensors += _tensor_entries(block, index, None if stored is not None else start)
        seg = segments.setdefault(block.segment, [start, start])
        seg[1] = writer.pos
        source_bytes += block.source_bytes
        if progress is not None:
            progress(block.source_bytes)
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
    return EmitResult(tmp, writer.pos, source_bytes, _file_sha256(f, tmp), errors)


def _file_sha256(f: Any, path: str) -> str:
    f.flush()
    digest = hashlib.sha256()
    with open(path, "rb") as r:
        for chunk in iter(lambda: r.read(16 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _expert_results(experts: list[BlockJob], jobs: int, compress: bool,
                    report_error: bool) -> Iterator[tuple[bytes, int, ExpertError | None]]:
    """Expert payloads in order: built here, or by ``jobs`` worker processes with at most
    ``2 * jobs`` results in flight (bounded memory)."""
    if jobs <= 1 or len(experts) <= 1:
        for block in experts:
            yield build_expert(block, compress, report_error)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending: deque = deque()
        it = iter(experts)
        for block in it:
            pending.append(pool.submit(build_expert, block, compress, report_error))
            if len(pending) >= 2 * jobs:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(build_expert, nxt, compress, report_error))
            yield result
