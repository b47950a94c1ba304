"""PyTorch checkpoint reader: ``.pt``/``.bin``, one file or sharded with
``pytorch_model.bin.index.json``.

``torch.load(mmap=True, weights_only=True, map_location="meta")`` runs torch's restricted
unpickler (a pickle that needs arbitrary code is refused, never executed) and reads no tensor
data: each meta tensor's storage records its absolute offset in the zip archive, which is all a
``TensorRef`` needs.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile

from ktc.errors import FormatError
from ktc.ir import ByteRange, TensorRef

from .tensor_file import TensorFile, file_size, merge_shards

INDEX_NAME = "pytorch_model.bin.index.json"

_TORCH_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def read_pytorch_header(path: str) -> dict[str, TensorRef]:
    """Tensor references of one PyTorch zip checkpoint, without reading tensor data."""
    import torch  # the reader is the only part of formats that needs torch

    size = file_size(path)
    try:
        is_zip = zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, ValueError, OverflowError) as exc:  # it raises on some damage
        raise FormatError(f"cannot read checkpoint: damaged zip archive ({exc})", path=path,
                          hint="the file is truncated or damaged") from exc
    if not is_zip:
        raise FormatError("not a PyTorch zip checkpoint (legacy or damaged file)", path=path,
                          hint="re-save it with torch.save() from PyTorch 1.6 or newer")
    try:
        with warnings.catch_warnings():  # torch's notes on odd pickles: the outcome says enough
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, mmap=True, weights_only=True, map_location="meta")
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(exc)
        if "GLOBAL " in reason:  # the pickle names a function to call: refused before it runs
            raise FormatError(f"the pickle needs arbitrary code to load; refused and not executed ({reason})",
                              path=path, hint="convert the checkpoint to safetensors in an environment "
                                              "you trust") from exc
        raise FormatError(f"cannot read checkpoint: damaged pickle ({reason})", path=path,
                          hint="the file is truncated or damaged") from exc
    except Exception as exc:
        # A damaged file makes torch.load raise whatever its zip reader or restricted unpickler
        # meets: RuntimeError, EOFError, ValueError, UnicodeDecodeError, KeyError, IndexError,
        # TypeError, AttributeError, AssertionError, struct.error (all seen from one-byte patches).
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise FormatError(f"cannot read checkpoint ({type(exc).__name__}: {first})" if first else
                          f"cannot read checkpoint ({type(exc).__name__})", path=path,
                          hint="the file is truncated or damaged") from exc
    state = _state_dict(state, path)
    tensors: dict[str, TensorRef] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if not isinstance(name, str):
            raise FormatError(f"a tensor is stored under the key {name!r}, not a name", path=path,
                              hint="the file is damaged, or not a state dict")
        dtype = _TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise FormatError(f"unsupported dtype {tensor.dtype}", path=path, tensor=name)
        storage = tensor.untyped_storage()
        base = getattr(storage, "_checkpoint_offset", None)
        if base is None:
            raise FormatError("storage offsets are not recorded in this checkpoint", path=path,
                              tensor=name, hint="re-save it with a current torch.save()")
        itemsize = tensor.element_size()
        offset = base + tensor.storage_offset() * itemsize
        shape = tuple(tensor.shape)
        contiguous = tensor.is_contiguous()
        span = (1 + sum((d - 1) * s for d, s in zip(shape, tensor.stride()))) if all(shape) else 0
        nbytes = span * itemsize
        if offset + nbytes > size or tensor.storage_offset() * itemsize + nbytes > storage.nbytes():
            raise FormatError(f"data at {offset}+{nbytes} runs past the end of the file ({size} bytes)",
                              path=path, tensor=name, hint="the file is truncated")
        strides = None if contiguous else tuple(tensor.stride())
        tensors[name] = TensorRef(name=name, dtype=dtype, stored_shape=shape,
                                  location=ByteRange(path, offset, nbytes, strides))
    return tensors


def _unpickler_reason(exc: pickle.UnpicklingError) -> str:
    """The line of torch's long weights-only message that says what was refused (its first
    paragraph and its closing lines are the same for every refusal)."""
    text = str(exc).replace("WeightsUnpickler error:", "")
    boiler = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith(boiler)]
    return lines[0][:160] if lines else type(exc).__name__


def _state_dict(state: object, path: str) -> dict:
    if isinstance(state, dict):
        for key in ("state_dict", "model"):
            inner = state.get(key)
            if isinstance(inner, dict) and len(state) <= 4:
                return inner
        return state
    raise FormatError(f"checkpoint holds a {type(state).__name__}, not a dict of tensors", path=path)


class PytorchFile(TensorFile):
    format = "pytorch"


def open_pytorch(path: str) -> PytorchFile:
    """Open a ``.pt``/``.bin`` file, a shard index, or a folder holding either."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            path = index
        else:
            found = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
            if len(found) != 1:
                raise FormatError(f"expected one .bin/.pt file or {INDEX_NAME}, found {len(found)}",
                                  path=path)
            path = os.path.join(path, found[0])
    if path.endswith(".index.json"):
        files, tensors = merge_shards(path, read_pytorch_header)
        return PytorchFile(path, files, tensors)
    return PytorchFile(path, (path,), read_pytorch_header(path))
