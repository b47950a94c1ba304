"""The common shape of every checkpoint reader: a context manager over lazy ``TensorRef``s."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from collections.abc import Callable
from typing import Any

import numpy as np

from ktc.errors import FormatError
from ktc.ir import TensorRef


class TensorFile:
    """Tensors of one checkpoint (one file or a sharded set), read lazily.

    Opening reads headers only. ``tensors`` maps names to ``TensorRef``s; ``load`` maps the bytes
    of one tensor. Nothing stays open between calls: every map belongs to the array it backs,
    so ``close`` leaves no descriptor or map behind once those arrays are gone.
    """

    format: str = ""

    def __init__(self, path: str, files: tuple[str, ...], tensors: dict[str, TensorRef],
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.path = path
        self.files = files
        self.tensors: Mapping[str, TensorRef] = MappingProxyType(tensors)
        self.metadata: Mapping[str, Any] = MappingProxyType(dict(metadata or {}))
        self._closed = False

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    @property
    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    def load(self, name: str) -> np.ndarray:
        """The stored representation of tensor ``name`` (see ``TensorRef.load``)."""
        if self._closed:
            raise ValueError(f"{self.path}: reader is closed")
        try:
            ref = self.tensors[name]
        except KeyError:
            raise FormatError("no such tensor", path=self.path, tensor=name) from None
        return ref.load()


def file_size(path: str) -> int:
    """Size of ``path`` in bytes, or a ``FormatError`` that says it is missing."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        raise FormatError("file not found", path=path) from None
    except OSError as exc:
        raise FormatError(f"cannot read file: {exc.strerror}", path=path) from None


def reject_duplicate_keys(pairs: list[tuple[str, Any]], *, path: str) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key is an error, not a silent overwrite."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise FormatError(f"duplicate key {key!r} in JSON", path=path, tensor=key)
            seen.add(key)
    return result


JSON_LIMIT_BYTES = 64 * 1024 * 1024  # a plan or profile of the largest models is a few MiB


def read_json(path: str, what: str, *, finite: bool = True) -> Any:
    """A small JSON file (config, index, profile, plan), with duplicate keys refused and every
    failure a ``FormatError`` that names the file and says what it should have been.

    At most ``JSON_LIMIT_BYTES`` are read (``--profile /dev/zero`` would otherwise fill the
    memory). With ``finite``, ``NaN``, ``Infinity`` and numbers too large for a float (``1e400``)
    are refused where the parser meets them."""
    try:
        with open(path, "rb") as f:
            raw = f.read(JSON_LIMIT_BYTES + 1)
    except FileNotFoundError:
        raise FormatError(f"{what} not found", path=path) from None
    except IsADirectoryError:
        raise FormatError(f"{what} is a folder, not a file", path=path) from None
    except OSError as exc:
        raise FormatError(f"cannot read {what}: {exc.strerror}", path=path) from None
    if len(raw) > JSON_LIMIT_BYTES:
        raise FormatError(f"{what} is larger than {JSON_LIMIT_BYTES >> 20} MiB; not read", path=path)

    def non_finite(text: str) -> Any:
        raise FormatError(f"{what} holds {text}; only finite numbers are accepted", path=path)

    def finite_float(text: str) -> float:
        value = float(text)
        if value in (math.inf, -math.inf):
            non_finite(f"{text[:40]} (too large for a number)")
        return value

    checks: dict[str, Any] = {"parse_constant": non_finite, "parse_float": finite_float} if finite else {}
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=lambda p: reject_duplicate_keys(p, path=path),
                          **checks)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{what} is not valid JSON ({exc})", path=path) from None
    except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits; nesting too deep
        raise FormatError(f"{what} is not valid JSON ({str(exc)[:120]})", path=path) from None


def read_index(index_path: str) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face shard index, checked."""
    index = read_json(index_path, "index file")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError("index has no 'weight_map' object of tensor name to file name",
                          path=index_path)
    for shard in weight_map.values():
        if os.path.isabs(shard) or ".." in shard.split("/"):
            raise FormatError(f"shard name {shard!r} points outside the model folder", path=index_path)
    return weight_map



def merge_shards(index_path: str, read_shard: Callable[[str], dict[str, TensorRef]]
                 ) -> tuple[tuple[str, ...], dict[str, TensorRef]]:
    """Read every shard an index lists and check the index against what the shards hold."""
    weight_map = read_index(index_path)
    folder = os.path.dirname(index_path)
    tensors: dict[str, TensorRef] = {}
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        shard_path = os.path.join(folder, shard)
        if not os.path.exists(shard_path):
            listed = next(n for n, s in weight_map.items() if s == shard)
            raise FormatError(f"shard '{shard}' is listed in the index but missing",
                              path=index_path, tensor=listed)
        for name, ref in read_shard(shard_path).items():
            if name in tensors:
                raise FormatError("tensor appears in two shards", path=shard_path, tensor=name)
            tensors[name] = ref
    for name, shard in weight_map.items():
        if name not in tensors:
            raise FormatError(f"the index puts this tensor in '{shard}' but no shard has it",
                              path=index_path, tensor=name)
        if tensors[name].location.path != os.path.join(folder, shard):
            found = os.path.basename(tensors[name].location.path)
            raise FormatError(f"the index puts this tensor in '{shard}' but it is in '{found}'",
                              path=index_path, tensor=name)
    return tuple(os.path.join(folder, s) for s in shards), tensors
