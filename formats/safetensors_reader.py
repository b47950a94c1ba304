"""SafeTensors reader: one file or a sharded set with ``model.safetensors.index.json``.

The header is 8 bytes of little-endian length and a JSON object. We parse it ourselves rather
than with ``safetensors.safe_open`` because the IR needs each tensor's absolute file offset (so
passes and worker processes can map bytes without the reader), ``safe_open`` keeps the whole file
mapped while open, and its numpy path has no bf16 or fp8. The checks are the format's own rules,
with messages that name the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from ktc.errors import FormatError
from ktc.ir import STORAGE_TYPES, ByteRange, TensorRef

from .tensor_file import TensorFile, file_size, merge_shards, reject_duplicate_keys

INDEX_NAME = "model.safetensors.index.json"
# The reference implementation refuses headers over 100 MB; so do we, before reading them.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype names are ktc's storage type names, plus these aliases.
_DTYPE_ALIASES = {"F8_E4M3FN": "F8_E4M3"}


def read_safetensors_header(path: str) -> dict[str, TensorRef]:
    """Tensor references of one ``.safetensors`` file, from its header alone."""
    size = file_size(path)
    if size < 8:
        raise FormatError(f"file is {size} bytes, shorter than the 8-byte header length",
                          path=path, hint="the file is truncated")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise FormatError(f"header length {header_len} runs past the end of the file "
                              f"({size} bytes)", path=path, hint="the file is truncated or not safetensors")
        if header_len > MAX_HEADER_BYTES:
            raise FormatError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit",
                              path=path)
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"),
                            object_pairs_hook=lambda p: reject_duplicate_keys(p, path=path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not valid JSON ({exc})", path=path,
                          hint="the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object", path=path)

    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ref = _tensor_ref(path, name, entry, data_start, data_size)
        tensors[name] = ref
        if ref.location.nbytes:
            spans.append((ref.location.offset, ref.location.offset + ref.location.nbytes, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FormatError(f"data of '{first}' and '{second}' overlap", path=path, tensor=second)
    return tensors


def _tensor_ref(path: str, name: str, entry: Any, data_start: int, data_size: int) -> TensorRef:
    # This runs once per tensor (90k for DeepSeek-V3), so the checks are written for speed.
    try:
        dtype = entry["dtype"]
        shape = entry["shape"]
        begin, end = entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise FormatError("header entry needs 'dtype', 'shape' and a pair of 'data_offsets'",
                          path=path, tensor=name) from None
    st = STORAGE_TYPES.get(_DTYPE_ALIASES.get(dtype, dtype)) if isinstance(dtype, str) else None
    if st is None or st.is_quantized:
        raise FormatError(f"unknown dtype {dtype!r}", path=path, tensor=name)
    if type(shape) is not list or len(shape) > 8:
        raise FormatError(f"shape {shape!r} is not a list of non-negative integers", path=path, tensor=name)
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise FormatError(f"shape {shape!r} is not a list of non-negative integers",
                              path=path, tensor=name)
        count *= d
    if type(begin) is not int or type(end) is not int:
        raise FormatError(f"data_offsets {entry['data_offsets']!r} is not a pair of integers",
                          path=path, tensor=name)
    if not 0 <= begin <= end:
        raise FormatError(f"data_offsets [{begin}, {end}] are not increasing", path=path, tensor=name)
    if end > data_size:
        raise FormatError(f"data_offsets [{begin}, {end}] run past the end of the data "
                          f"({data_size} bytes)", path=path, tensor=name, hint="the file is truncated")
    if end - begin != count * st.block_bytes:
        raise FormatError(f"shape {shape} at {st.name} needs {count * st.block_bytes} bytes but "
                          f"data_offsets give {end - begin}", path=path, tensor=name)
    return TensorRef(name=name, dtype=st.name, stored_shape=tuple(shape),
                     location=ByteRange(path, data_start + begin, end - begin))


class SafetensorsFile(TensorFile):
    format = "safetensors"


def open_safetensors(path: str) -> SafetensorsFile:
    """Open a ``.safetensors`` file, a sharded index, or a folder holding either."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            return _open_index(index)
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            path = single
        else:
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not found:
                raise FormatError("no .safetensors file in folder", path=path)
            if len(found) > 1:
                raise FormatError(f"{len(found)} .safetensors files but no {INDEX_NAME}", path=path,
                                  hint="pass one file, or add the index that lists the shards")
            path = os.path.join(path, found[0])
    if path.endswith(".index.json"):
        return _open_index(path)
    return SafetensorsFile(path, (path,), read_safetensors_header(path))


def _open_index(index_path: str) -> SafetensorsFile:
    files, tensors = merge_shards(index_path, read_safetensors_header)
    return SafetensorsFile(index_path, files, tensors)
