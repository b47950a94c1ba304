"""GGUF reader with llama.cpp's loader checks, done before anything is read or allocated.

The layout, type codes and block sizes come from the ``gguf`` package (``constants``), and its
``quants.dequantize`` decodes blocks (``formats.dequant``). We walk the header with our own bounds
checks instead of ``gguf.GGUFReader`` because that reader trusts every count and length in the
file (a header that claims 2^40 tensors or a 2^60-byte string makes it loop or allocate before it
fails), does not check that tensor data is in order and inside the file, and decodes every
metadata array into numpy objects up front, which takes seconds on a 150k-token vocabulary.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, Keys
from gguf.gguf_writer import SHARD_NAME_FORMAT

from ktc.errors import FormatError
from ktc.ir import STORAGE_TYPES, ByteRange, TensorRef

from .tensor_file import TensorFile, file_size

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # GGML_MAX_NAME, terminator included in llama.cpp
# Arrays of more elements than this are validated but kept only as a count (tokenizer tables).
MAX_KEPT_ARRAY = 4096

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# The smallest a tensor info can be: name length, 1 dim count, 1 dim, type, offset.
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8
# The smallest a key/value pair can be: key length, type, a one-byte value.
_MIN_KV = 8 + 4 + 1


@dataclass(frozen=True)
class LargeArray:
    """A metadata array too long to keep (a vocabulary): its element type and length."""

    element_type: str
    count: int


class _Cursor:
    """Reads little-endian values from a buffer, checking every length against what is left."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > self.size:
            raise FormatError(f"{what} needs {nbytes} bytes at offset {self.pos} but only "
                              f"{self.size - self.pos} remain", path=self.path,
                              hint="the file is truncated or damaged")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"{what} length")
        self.need(length, f"{what} of {length} bytes")
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{what} is not valid UTF-8", path=self.path) from None

    def skip_string(self, what: str) -> None:
        length = self.scalar("Q", f"{what} length")
        self.need(length, f"{what} of {length} bytes")
        self.pos += length


def _value_type(code: int, path: str, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise FormatError(f"unknown metadata value type {code}", path=path, tensor=key) from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of '{key}'")
    if vtype == GGUFValueType.ARRAY:
        etype = _value_type(cur.scalar("I", f"array type of '{key}'"), cur.path, key)
        count = cur.scalar("Q", f"array length of '{key}'")
        if etype == GGUFValueType.ARRAY:
            raise FormatError("nested arrays are not supported", path=cur.path, tensor=key)
        if etype == GGUFValueType.STRING:
            # Each string is at least its 8-byte length.
            cur.need(count * 8, f"array '{key}' of {count} strings")
            if count > MAX_KEPT_ARRAY:
                for _ in range(count):
                    cur.skip_string(f"element of '{key}'")
                return LargeArray("string", count)
            return [cur.string(f"element of '{key}'") for _ in range(count)]
        fmt = _SCALAR_FORMATS[etype]
        size = struct.calcsize("<" + fmt)
        cur.need(count * size, f"array '{key}' of {count} elements")
        if count > MAX_KEPT_ARRAY:
            cur.pos += count * size
            return LargeArray(etype.name.lower(), count)
        values = list(struct.unpack_from(f"<{count}{fmt}", cur.buf, cur.pos))
        cur.pos += count * size
        return values
    return cur.scalar(_SCALAR_FORMATS[vtype], f"value of '{key}'")


def read_gguf_header(path: str) -> tuple[dict[str, Any], dict[str, TensorRef]]:
    """Metadata and tensor references of a GGUF file, every field checked against the file."""
    size = file_size(path)
    if size < 24:
        raise FormatError(f"file is {size} bytes, too short for a GGUF header", path=path,
                          hint="the file is truncated")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(buf, path, size)


def _parse(buf: mmap.mmap, path: str, size: int) -> tuple[dict[str, Any], dict[str, TensorRef]]:
    cur = _Cursor(buf, path)
    magic = bytes(buf[:4])
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, expected {MAGIC!r}", path=path,
                          hint="not a GGUF file")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(f"GGUF version {version} is not supported (supported: "
                          f"{', '.join(map(str, SUPPORTED_VERSIONS))})", path=path)
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "metadata count")
    left = size - cur.pos
    if n_tensors > left // _MIN_TENSOR_INFO:
        raise FormatError(f"header claims {n_tensors} tensors but the {left} bytes left hold at "
                          f"most {left // _MIN_TENSOR_INFO} tensor infos", path=path,
                          hint="the file is damaged")
    if n_kv > left // _MIN_KV:
        raise FormatError(f"header claims {n_kv} metadata entries but the {left} bytes left hold "
                          f"at most {left // _MIN_KV}", path=path, hint="the file is damaged")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise FormatError(f"duplicate metadata key '{key}'", path=path, tensor=key)
        vtype = _value_type(cur.scalar("I", f"type of '{key}'"), path, key)
        metadata[key] = _read_value(cur, vtype, key)

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1)):
        raise FormatError(f"general.alignment {alignment!r} is not a power of two", path=path,
                          tensor="general.alignment")

    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        if len(name.encode()) >= MAX_NAME_BYTES:
            raise FormatError(f"tensor name is {len(name.encode())} bytes; at most "
                              f"{MAX_NAME_BYTES - 1} allowed", path=path, tensor=name[:80])
        if name in seen:
            raise FormatError("duplicate tensor name", path=path, tensor=name)
        seen.add(name)
        n_dims = cur.scalar("I", f"dimension count of '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(f"{n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}", path=path,
                              tensor=name)
        dims = tuple(cur.scalar("Q", f"dimension of '{name}'") for _ in range(n_dims))
        code = cur.scalar("I", f"type of '{name}'")
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise FormatError(f"unknown tensor type {code}", path=path, tensor=name) from None
        if qtype.name not in STORAGE_TYPES or qtype not in GGML_QUANT_SIZES:
            raise FormatError(f"tensor type {qtype.name} is not supported", path=path, tensor=name)
        block, _ = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise FormatError(f"row length {dims[0]} is not a multiple of {qtype.name}'s block "
                              f"size {block}", path=path, tensor=name)
        elements = 1
        for d in dims:
            elements *= d
        if elements >= 2**63:
            raise FormatError(f"dimensions {dims} overflow the element count", path=path, tensor=name)
        offset = cur.scalar("Q", f"offset of '{name}'")
        infos.append((name, dims, qtype, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorRef] = {}
    expected = 0
    for name, dims, qtype, offset in infos:
        if offset != expected:
            raise FormatError(f"data offset {offset} is out of order; expected {expected} "
                              f"(tensors must follow each other, aligned to {alignment})",
                              path=path, tensor=name)
        stored_shape = tuple(reversed(dims))  # ggml's ne[0] is the innermost axis
        nbytes = STORAGE_TYPES[qtype.name].nbytes(stored_shape)
        if data_start + offset + nbytes > size:
            raise FormatError(f"data at {data_start + offset}+{nbytes} runs past the end of the file "
                              f"({size} bytes)", path=path, tensor=name, hint="the file is truncated")
        tensors[name] = TensorRef(name=name, dtype=qtype.name, stored_shape=stored_shape,
                                  location=ByteRange(path, data_start + offset, nbytes))
        expected = -(-(offset + nbytes) // alignment) * alignment
    metadata["_ktc.version"] = version
    return metadata, tensors


class GgufFile(TensorFile):
    format = "gguf"

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def open_gguf(path: str) -> GgufFile:
    """Open a ``.gguf`` file, or a GGUF split into parts (``split_parts``) from any of them: the
    first part's metadata (the only part that carries it all), every part's tensors."""
    path = os.fspath(path)
    metadata, tensors = read_gguf_header(path)
    count = metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise FormatError(f"{Keys.Split.LLM_KV_SPLIT_COUNT} is {count!r}", path=path,
                          tensor=Keys.Split.LLM_KV_SPLIT_COUNT)
    if count == 1:
        return GgufFile(path, (path,), tensors, metadata)
    parts = split_parts(path, count)
    headers = {path: (metadata, tensors)}
    merged: dict[str, TensorRef] = {}
    for number, part in enumerate(parts):
        if part not in headers:
            headers[part] = read_gguf_header(part)
        part_metadata, part_tensors = headers[part]
        for key, want in ((Keys.Split.LLM_KV_SPLIT_NO, number), (Keys.Split.LLM_KV_SPLIT_COUNT, count)):
            if part_metadata.get(key) != want:
                raise FormatError(f"{key} is {part_metadata.get(key)!r}, but the part's name makes it "
                                  f"{want}", path=part, tensor=key,
                                  hint="the parts come from different splits: download them again")
        for name, ref in part_tensors.items():
            if name in merged:
                raise FormatError(f"tensor also in {merged[name].location.path}", path=part, tensor=name)
            merged[name] = ref
    metadata = headers[parts[0]][0]
    expected = metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(merged))
    if expected != len(merged):
        raise FormatError(f"the {count} parts hold {len(merged)} tensors; the first part says "
                          f"{expected}", path=parts[0], hint="a part is damaged or from another split")
    return GgufFile(parts[0], parts, merged, metadata)


_PART_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_parts(path: str, count: int) -> tuple[str, ...]:
    """The files of a GGUF split into ``count`` parts that ``path`` is one of, in order: the
    names llama.cpp's ``gguf-split`` and the ``gguf`` package's writer give them
    (``PREFIX-00001-of-00003.gguf``), side by side in one folder. Every part must be there."""
    folder, name = os.path.split(os.path.abspath(path))
    match = _PART_NAME.match(name)
    if match is None or int(match.group(3)) != count:
        raise FormatError(f"this is part of a GGUF split into {count} files, but its name does not "
                          f"say which (PREFIX-00001-of-{count:05d}.gguf)", path=path,
                          hint="keep the names gguf-split gave the parts")
    parts = tuple(os.path.join(folder, n) for n in _part_names(match.group(1), count))
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise FormatError(f"{len(missing)} of the {count} parts of this GGUF are missing: "
                          f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}", path=path,
                          hint="put every part of the split in one folder")
    return parts


def model_file_in(folder: str) -> str | None:
    """The GGUF model in ``folder``: its one ``.gguf`` file, or the first part of the one GGUF split
    into parts there (``split_parts``' names); None for none or several."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    if len(names) == 1:
        return os.path.join(folder, names[0])
    match = _PART_NAME.match(names[0]) if names else None  # a split's first part sorts first
    if match and names == _part_names(match.group(1), int(match.group(3))):
        return os.path.join(folder, names[0])
    return None


def _part_names(prefix: str, count: int) -> list[str]:
    """The names of a GGUF split into ``count`` parts, in order."""
    return [SHARD_NAME_FORMAT.format(prefix, i + 1, count) for i in range(count)]
