"""The ``.ktb`` bundle: header, manifest, segments (docs/bundle-format.md is the specification).

This module is the one reader the verifier, ``ktc inspect`` and the runtime share: it validates
the header and the manifest (every offset and length inside the file, blocks that tile the data
without overlap) before anything is mapped, and maps tensors zero-copy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktc.errors import BundleError

from .schemes import EXPERT_ALIGN, get_scheme

MAGIC = b"KTCBNDL\x00"
FORMAT_MAJOR = 2
FORMAT_MINOR = 0
# Version 2.0 added file blocks (tokenizer files), the manifest's "run" section and each
# non-expert tensor's "source" name; version 1 bundles still open (for bench, inspect, verify)
# but cannot run a whole model.
OLDEST_MAJOR = 1
HEADER_SIZE = 128
PAGE = EXPERT_ALIGN
# magic, major, minor, header size, manifest offset, manifest length, data offset, file size,
# manifest-region sha256, reserved; the header's own sha256 follows at byte 96.
_HEADER = struct.Struct("<8sHHIQQQQ32s16s")
assert _HEADER.size == 96


@dataclass(frozen=True)
class BundleHeader:
    """The fixed 128 bytes at the start of every bundle."""

    manifest_offset: int
    manifest_length: int
    data_offset: int
    file_size: int
    manifest_sha256: bytes
    major: int = FORMAT_MAJOR
    minor: int = FORMAT_MINOR

    def to_bytes(self) -> bytes:
        body = _HEADER.pack(MAGIC, self.major, self.minor, HEADER_SIZE, self.manifest_offset,
                            self.manifest_length, self.data_offset, self.file_size,
                            self.manifest_sha256, bytes(16))
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str = "<bundle>") -> BundleHeader:
        if len(raw) < HEADER_SIZE:
            raise BundleError(f"file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header",
                              path=path, hint="the file is truncated or not a ktc bundle")
        magic, major, minor, size, m_off, m_len, d_off, f_size, m_sha, reserved = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            kind = checkpoint_kind(raw)
            if kind:
                raise BundleError(f"is a {kind} checkpoint, not a ktc bundle", path=path,
                                  hint=f"compile it first: ktc compile {path} -o model.ktb (--vram SIZE to "
                                       "put experts on the GPU)")
            raise BundleError(f"bad magic {magic!r}; not a ktc bundle", path=path)
        if major > FORMAT_MAJOR:
            raise BundleError(f"bundle format version {major}.{minor} is newer than this ktc reads "
                              f"({FORMAT_MAJOR}.x)", path=path, hint="upgrade ktc to read it")
        if major < OLDEST_MAJOR:
            raise BundleError(f"bundle format version {major}.{minor} is not valid", path=path)
        if hashlib.sha256(raw[:96]).digest() != raw[96:128]:
            raise BundleError("header checksum does not match: the header is damaged", path=path)
        if size != HEADER_SIZE or reserved != bytes(16):
            raise BundleError("header size or reserved bytes are not as the format defines them", path=path)
        return cls(m_off, m_len, d_off, f_size, m_sha, major, minor)


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def block_checksum(data: bytes | memoryview) -> str:
    """The checksum of a block: xxh3-128 (about 20 GB/s here, against 1.8 GB/s for sha256;
    blocks guard against damage, and the manifest that lists them is covered by sha256)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def new_block_hasher():  # type: ignore[no-untyped-def]
    import xxhash

    return xxhash.xxh3_128()


def manifest_json(manifest: dict[str, Any]) -> bytes:
    """The canonical bytes of a manifest: sorted keys, no spaces, ASCII."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class BundleTensor:
    name: str
    role: str
    segment: str
    block: int
    offset: int | None  # absolute in the file; None when its expert is compressed
    offset_in_block: int
    nbytes: int
    shape: tuple[int, ...]
    scheme: str
    layout: str
    layer: int | None = None
    expert: int | None = None
    source: str | None = None  # the checkpoint's name of a non-expert tensor (format 2)


@dataclass(frozen=True)
class BundleBlock:
    """A checksummed range: one expert, one non-expert tensor, or one file, with its padding."""

    index: int
    kind: str  # "expert", "tensor" or "file"
    name: str
    segment: str
    offset: int
    length: int
    checksum: str  # xxh3-128 of the block's stored bytes, 32 hex digits
    compression: str | None = None
    compressed_length: int | None = None  # bytes of the compressed frame at the block's start
    raw_length: int | None = None  # decompressed length when compressed
    tensors: tuple[str, ...] = ()
    size: int | None = None  # a file block's file length (the rest is padding)


@dataclass
class Bundle:
    """An opened bundle: validated header and manifest; tensors mapped on request."""

    path: str
    header: BundleHeader
    manifest: dict[str, Any]
    blocks: tuple[BundleBlock, ...]
    tensors: dict[str, BundleTensor]
    _file: Any = None
    _map: mmap.mmap | None = None
    _views: list[Any] = field(default_factory=list)
    # read into memory instead of mapped (``open_bundle(mapped=False)``)
    in_memory: bool = False

    @functools.cached_property
    def by_source(self) -> dict[str, str]:
        """Each tensor's name by the checkpoint's name of it (its ``source``; else its own name),
        made once."""
        return {t.source or t.name: t.name for t in self.tensors.values()}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Bundle:
        """Open and validate a bundle (see ``open_bundle``); use it as a context manager."""
        return open_bundle(path)

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the bundle's map. Arrays read from the bundle are views of that map, not
        copies: while one of them lives, the map stays (it closes when the last goes; a map
        made by Python before 3.13 also holds a duplicate of the file's descriptor until then).
        Reading such an array after ``close()`` stays valid. Copy (``np.array(x)``) what you
        keep for long after closing the bundle."""
        self._views.clear()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # arrays still use the map; it closes when they are gone
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _mapped(self) -> mmap.mmap:
        if self._map is None and self.in_memory:
            self._map = _read_into_memory(self.path, self.header.file_size)
        if self._map is None:
            self._file = open(self.path, "rb")
            # Python 3.13's trackfd=False keeps mmap from holding a duplicate descriptor.
            extra = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ, **extra)
            self._file.close()  # the map keeps what it needs; no descriptor stays open
            self._file = None
        return self._map

    def advise(self, advice: int, start: int, length: int) -> None:
        """``madvise`` on ``length`` bytes of the map from ``start`` (a multiple of the page
        size): ``mmap.MADV_WILLNEED`` to start reading them, ``MADV_RANDOM`` against readahead."""
        self._mapped().madvise(advice, start, length)

    def release(self, name: str) -> None:
        """Drop this process's mapping of a stored tensor's whole pages (``MADV_DONTNEED``): for
        a tensor the runtime has copied and no longer reads, so the map's pages leave the
        process's resident memory and the kernel may reclaim them. Nothing is lost: a page
        touched again is read again from the file. Nothing happens for a bundle read into memory
        or a compressed tensor (their bytes are the process's own)."""
        t = self.tensors[name]
        if self.in_memory or self.blocks[t.block].compression or t.offset is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if end > start:
            self._mapped().madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def segments(self) -> list[dict[str, Any]]:
        return self.manifest["segments"]

    @property
    def format_major(self) -> int:
        return self.header.major

    @property
    def run_info(self) -> dict[str, Any] | None:
        """The manifest's "run" section (format 2): the model's config, its generation config,
        the KV capacity and workload the bundle was planned for; None in older bundles."""
        run = self.manifest.get("run")
        return run if isinstance(run, dict) else None

    def file_names(self) -> tuple[str, ...]:
        """Names of the files the bundle carries (tokenizer files), in bundle order."""
        return tuple(b.name for b in self.blocks if b.kind == "file")

    def file_bytes(self, name: str) -> bytes:
        """The content of a file the bundle carries (``KeyError`` when it has none of that name)."""
        for block in self.blocks:
            if block.kind == "file" and block.name == name:
                return bytes(memoryview(self._mapped())[block.offset: block.offset + (block.size or 0)])
        raise KeyError(name)

    def file_view(self) -> np.ndarray:
        """The whole bundle as one zero-copy uint8 array (kernels address tensors by offset)."""
        return _read_only(np.frombuffer(self._mapped(), np.uint8))

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of one tensor (decompressing its expert when it is compressed)."""
        t = self.tensors[name]
        block = self.blocks[t.block]
        if block.compression:
            raw = self.block_payload(block)
            return np.frombuffer(raw, np.uint8, t.nbytes, t.offset_in_block)
        assert t.offset is not None
        return _read_only(np.frombuffer(self._mapped(), np.uint8, t.nbytes, t.offset))

    def tensor(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor shaped [rows, row_bytes] (or as stored for plain types)."""
        t = self.tensors[name]
        raw = self.tensor_bytes(name)
        scheme = get_scheme(t.scheme)
        if scheme.block_elems == 1 and scheme.row_extra_bytes == 0:
            dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[scheme.name]
            return raw.view(dtype).reshape(t.shape)
        rows = t.shape[0] if len(t.shape) > 1 else 1
        return raw.reshape(rows, -1)

    def tensor_float32(self, name: str) -> np.ndarray:
        """A stored tensor's values as float32 (a zero-copy view when it is stored as f32)."""
        from .quantize import dequantize  # the codecs, which opening a bundle does not need

        t = self.tensors[name]
        raw = self.tensor(name)
        if t.scheme == "f32":
            return np.asarray(raw, dtype=np.float32)
        rows = t.shape[0] if len(t.shape) > 1 else 1
        return dequantize(raw.view(np.uint8).reshape(rows, -1), t.scheme, t.shape[-1]).reshape(t.shape)

    def block_payload(self, block: BundleBlock) -> bytes | memoryview:
        data = memoryview(self._mapped())[block.offset: block.offset + block.length]
        if block.compression == "zstd":
            import zstandard

            frame = bytes(data[: block.compressed_length])
            return zstandard.ZstdDecompressor().decompress(frame, max_output_size=block.raw_length or 0)
        return data

    def verify(self) -> list[str]:
        """Recompute every checksum and check every padding byte; returns the problems found,
        each naming the damaged block's tensors (empty when the bundle is sound)."""
        problems: list[str] = []
        with open(self.path, "rb") as f:
            f.seek(self.header.manifest_offset)
            region = f.read(self.header.data_offset - self.header.manifest_offset)
            if hashlib.sha256(region).digest() != self.header.manifest_sha256:
                problems.append("manifest region checksum does not match")
            for block in self.blocks:
                f.seek(block.offset)
                data = f.read(block.length)
                if block_checksum(data) != block.checksum:
                    problems.append(f"{block.kind} '{block.name}' is damaged (checksum mismatch at "
                                    f"{block.offset}+{block.length}; tensors: {', '.join(block.tensors)})")
                    continue
                problems += self._check_padding(block, data)
        return problems

    def _check_padding(self, block: BundleBlock, data: bytes) -> list[str]:
        if block.kind == "file":
            return [] if not any(data[block.size or 0:]) else [f"file '{block.name}': padding is not zero"]
        if block.compression:
            used = block.compressed_length or 0
            return [] if not any(data[used:]) else [f"{block.kind} '{block.name}': padding is not zero"]
        end = 0
        view = memoryview(data)
        for name in block.tensors:
            t = self.tensors[name]
            if any(view[end:t.offset_in_block]):
                return [f"{block.kind} '{block.name}': padding before '{name}' is not zero"]
            end = t.offset_in_block + t.nbytes
        return [] if not any(view[end:]) else [f"{block.kind} '{block.name}': trailing padding is not zero"]


def _int(value: Any, what: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BundleError(f"manifest: {what} is {value!r}, not a non-negative integer", path=path)
    return value


def is_bundle_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that starts as a bundle does (its magic bytes)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _read_only(view: np.ndarray) -> np.ndarray:
    view.flags.writeable = False  # a map is read-only already; a bundle read into memory is not
    return view


def anonymous_memory(size: int) -> mmap.mmap:
    """``size`` bytes of this process's own memory (a private anonymous map: zeros, each page
    given at its first touch), advised for huge pages before any is touched (``MADV_HUGEPAGE``,
    where Linux has transparent huge pages; without them the advice is refused and the map kept).
    Asked for here rather than left to numpy, which advises its arrays of 4 MB or more only by
    default (``NUMPY_MADVISE_HUGEPAGE=0`` turns that off) and from a 16-byte header's offset."""
    buffer = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    return buffer


def _read_into_memory(path: str, size: int) -> mmap.mmap:
    """The whole file at ``path`` in anonymous memory, in huge pages where Linux gives them
    (``MADV_HUGEPAGE``, asked before the pages are touched). A file's cached pages can read slower
    than the same bytes there: on a 2-core Xeon VM a one-layer Qwen3-30B-A3B-shaped Q8_0 model's
    ``lm_head`` read at 25.7 GB/s through the map and 30.1 from a copy, and its decode ran 1.24x
    as fast read into memory, other one-layer models 0.99-1.06x in the same rounds (1.11-1.16x
    in an earlier pair of runs: it depends on where the file's pages lie; docs/runtime.md)."""
    buffer = anonymous_memory(size)
    try:
        with open(path, "rb", buffering=0) as f, memoryview(buffer) as view:
            at = 0
            while at < size:
                got = f.readinto(view[at:min(size, at + (64 << 20))])
                if not got:
                    raise BundleError(f"the file ended at byte {at} of {size} while it was read", path=path)
                at += got
    except BaseException:
        buffer.close()
        raise
    return buffer


def checkpoint_kind(head: bytes) -> str | None:
    """What checkpoint a file's first bytes say it is ("GGUF", "SafeTensors", "PyTorch"), or
    None: the files a user may hand a command that reads bundles."""
    if head[:4] == b"GGUF":
        return "GGUF"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 1 << 32:
        return "SafeTensors"  # an 8-byte header length, then the header's JSON
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save's zip, or a pickle
        return "PyTorch"
    return None


def open_bundle(path: str | os.PathLike[str], *, mapped: bool = True) -> Bundle:
    """Open and validate a bundle's header and manifest. Maps nothing until a tensor is read.
    ``mapped=False``: the first tensor read reads the whole file into memory instead of mapping
    it (``ktc run --no-mmap``: faster kernels where the map reads slowly, see
    ``_read_into_memory``; the memory is the process's own, not the page cache's)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            header = BundleHeader.from_bytes(head, path)
            if header.file_size != size:
                raise BundleError(f"header says the file is {header.file_size} bytes; it is {size}",
                                  path=path, hint="the file is truncated or was appended to")
            if not (header.manifest_offset == HEADER_SIZE
                    and header.manifest_offset + header.manifest_length <= header.data_offset <= size
                    and header.data_offset % PAGE == 0):
                raise BundleError("manifest or data offsets in the header are out of range", path=path)
            f.seek(header.manifest_offset)
            raw = f.read(header.manifest_length)
    except FileNotFoundError:
        raise BundleError("no such bundle", path=path) from None
    except IsADirectoryError:
        if os.path.isfile(os.path.join(path, "config.json")):
            raise BundleError("is a model folder, not a ktc bundle", path=path,
                              hint=f"compile it first: ktc compile {path} -o model.ktb (--vram SIZE to put "
                                   "experts on the GPU)") from None
        raise BundleError("is a folder, not a bundle", path=path) from None
    try:
        manifest = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"manifest is not valid JSON ({exc})", path=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != "ktc-bundle":
        raise BundleError("manifest does not describe a ktc bundle", path=path)
    blocks, tensors = _validate_manifest(manifest, header, size, path)
    return Bundle(path, header, manifest, blocks, tensors, in_memory=not mapped)


def _validate_manifest(manifest: dict[str, Any], header: BundleHeader, size: int,
                       path: str) -> tuple[tuple[BundleBlock, ...], dict[str, BundleTensor]]:
    try:
        segments = manifest["segments"]
        raw_blocks = manifest["blocks"]
        raw_tensors = manifest["tensors"]
    except KeyError as exc:
        raise BundleError(f"manifest lacks {exc.args[0]!r}", path=path) from None
    seg_ranges = {}
    cursor = header.data_offset
    for seg in segments:
        off, length = _int(seg.get("offset"), "segment offset", path), _int(seg.get("length"), "segment length", path)
        if off != cursor or off % PAGE or length % PAGE:
            raise BundleError(f"segment '{seg.get('name')}' at {off}+{length} is not page-aligned "
                              "right after the previous one", path=path)
        seg_ranges[seg["name"]] = (off, off + length)
        cursor = off + length
    if cursor != size:
        raise BundleError(f"segments end at {cursor} but the file is {size} bytes", path=path)
    blocks = []
    cursor = header.data_offset
    for i, b in enumerate(raw_blocks):
        off, length = _int(b.get("offset"), "block offset", path), _int(b.get("length"), "block length", path)
        seg = seg_ranges.get(b.get("segment"))
        if seg is None or off != cursor or not (seg[0] <= off and off + length <= seg[1]):
            raise BundleError(f"block '{b.get('name')}' at {off}+{length} overlaps, leaves a gap or "
                              "lies outside its segment", path=path)
        sha = b.get("xxh3_128")
        if not isinstance(sha, str) or len(sha) != 32:
            raise BundleError(f"block '{b.get('name')}' has no xxh3_128 checksum", path=path)
        compression = b.get("compression")
        if compression not in (None, "zstd"):
            raise BundleError(f"block '{b.get('name')}' uses unknown compression {compression!r}", path=path)
        if compression:
            if _int(b.get("compressed_length"), "compressed length", path) > length:
                raise BundleError(f"block '{b.get('name')}': compressed frame is longer than the block",
                                  path=path)
            _int(b.get("raw_length"), "raw length", path)
        file_size = None
        if b.get("kind") == "file":
            file_size = _int(b.get("size"), f"size of file '{b.get('name')}'", path)
            if file_size > length or b.get("tensors"):
                raise BundleError(f"file block '{b.get('name')}' is larger than its block or lists tensors",
                                  path=path)
        blocks.append(BundleBlock(i, str(b.get("kind")), str(b.get("name")), b["segment"], off, length,
                                  sha, compression, b.get("compressed_length"), b.get("raw_length"),
                                  tuple(b.get("tensors", ())), file_size))
        cursor = off + length
    if cursor != size:
        raise BundleError(f"blocks end at {cursor} but the data runs to {size}", path=path)
    tensors: dict[str, BundleTensor] = {}
    for t in raw_tensors:
        name = t.get("name")
        if not isinstance(name, str) or name in tensors:
            raise BundleError(f"tensor name {name!r} is missing or repeated", path=path)
        block_index = _int(t.get("block"), f"block of '{name}'", path)
        if block_index >= len(blocks):
            raise BundleError(f"tensor '{name}' names block {block_index}, which does not exist", path=path)
        block = blocks[block_index]
        inner = _int(t.get("offset_in_block"), f"offset of '{name}'", path)
        nbytes = _int(t.get("nbytes"), f"length of '{name}'", path)
        limit = block.raw_length if block.compression else block.length
        if inner + nbytes > (limit or 0):
            raise BundleError(f"tensor '{name}' runs past the end of its block", path=path, tensor=name)
        absolute = None if block.compression else block.offset + inner
        if absolute is not None and t.get("offset") != absolute:
            raise BundleError(f"tensor '{name}': offset {t.get('offset')} disagrees with its block "
                              f"({absolute})", path=path, tensor=name)
        try:
            scheme = get_scheme(str(t.get("scheme")))
        except KeyError:
            raise BundleError(f"tensor '{name}' has unknown scheme {t.get('scheme')!r}", path=path) from None
        shape = tuple(_int(d, f"shape of '{name}'", path) for d in t.get("shape", ()))
        rows = shape[0] if len(shape) > 1 else 1
        cols = shape[-1] if shape else 1
        if scheme.block_elems == 1 and scheme.row_extra_bytes == 0:
            expected = int(np.prod(shape)) * scheme.block_bytes
        elif not scheme.fits(cols):
            raise BundleError(f"rows of {cols} values cannot be stored in {scheme.name}",
                              path=path, tensor=name)
        else:
            expected = scheme.matrix_bytes(rows, cols)
        if expected != nbytes:
            raise BundleError(f"tensor '{name}': shape {list(shape)} in {scheme.name} is {expected} bytes, "
                              f"the manifest says {nbytes}", path=path, tensor=name)
        tensors[name] = BundleTensor(name, str(t.get("role")), block.segment, block_index, absolute, inner,
                                     nbytes, shape, scheme.name, str(t.get("layout")), t.get("layer"),
                                     t.get("expert"), t.get("source"))
    for block in blocks:
        ends = []
        for name in block.tensors:
            t = tensors.get(name)
            if t is None or t.block != block.index:
                raise BundleError(f"block '{block.name}' lists tensor '{name}' that is not in it", path=path)
            ends.append((t.offset_in_block, t.offset_in_block + t.nbytes))
        for (_, end), (start, _) in zip(ends, ends[1:]):
            if start < end:
                raise BundleError(f"tensors of block '{block.name}' overlap", path=path)
    return tuple(blocks), tensors
