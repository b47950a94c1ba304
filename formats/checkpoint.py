"""Open any supported checkpoint: pick the reader, read the config, pair companion tensors."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ktc.errors import ConfigError, FormatError
from ktc.ir import ModelConfig, SourceInfo, TensorRef

from .gguf_reader import model_file_in, open_gguf
from .model_config import config_from_gguf, find_config_json, read_hf_config
from .pytorch_reader import INDEX_NAME as PYTORCH_INDEX
from .pytorch_reader import open_pytorch
from .safetensors_reader import INDEX_NAME as SAFETENSORS_INDEX
from .safetensors_reader import open_safetensors
from .tensor_file import TensorFile

FORMATS = ("safetensors", "pytorch", "gguf")
# DeepSeek-V3 FP8 weights carry one float32 scale per 128 x 128 block.
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_DEFAULT_BLOCK = (128, 128)


@dataclass
class Checkpoint:
    """A checkpoint opened for reading: lazy tensors, the typed config, and where they came from."""

    format: str
    path: str
    config: ModelConfig
    tensors: Mapping[str, TensorRef]
    files: tuple[str, ...]
    raw_config: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    _file: TensorFile | None = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    @property
    def source(self) -> SourceInfo:
        total = sum(os.path.getsize(f) for f in self.files)
        return SourceInfo(self.format, self.path, self.files, total)


def detect_format(path: str) -> str:
    """``safetensors``, ``pytorch`` or ``gguf`` for a file or model folder."""
    if os.path.isdir(path):
        names = os.listdir(path)
        if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        if PYTORCH_INDEX in names or any(n.endswith((".bin", ".pt", ".pth")) for n in names):
            return "pytorch"
        if model_file_in(path) is not None:
            return "gguf"
        if any(n.endswith(".gguf") for n in names):
            raise FormatError("several .gguf files in the folder, not the parts of one split GGUF",
                              path=path, hint="name the .gguf file to read")
        raise FormatError("no checkpoint found in folder (looked for .safetensors, .bin/.pt, "
                          ".gguf)", path=path)
    if not os.path.exists(path):
        raise FormatError("no such file or folder", path=path)
    name = os.path.basename(path)
    if name.endswith(".gguf"):
        return "gguf"
    if name.endswith(".safetensors") or name == SAFETENSORS_INDEX:
        return "safetensors"
    if name.endswith((".bin", ".pt", ".pth")) or name == PYTORCH_INDEX:
        return "pytorch"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return "gguf"
    if head[:2] == b"PK":
        return "pytorch"
    raise FormatError("cannot tell the checkpoint format from the name or first bytes", path=path,
                      hint="use a .safetensors, .bin/.pt or .gguf file, or a model folder")


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint file or folder: headers and config only, no tensor data."""
    path = os.fspath(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        gguf_file = open_gguf((model_file_in(path) or path) if os.path.isdir(path) else path)
        path = gguf_file.path  # a split GGUF's first part, which holds its metadata
        config = config_from_gguf(gguf_file.metadata, gguf_file.tensors, path)
        return Checkpoint("gguf", path, config, gguf_file.tensors, gguf_file.files,
                          metadata=gguf_file.metadata, _file=gguf_file)
    config_path = find_config_json(path)
    if config_path is None:
        raise ConfigError("no config.json beside the checkpoint", path=path,
                          hint="copy the model's config.json into the same folder")
    config, raw = read_hf_config(config_path)
    tensor_file = open_safetensors(path) if fmt == "safetensors" else open_pytorch(path)
    tensors = pair_companions(dict(tensor_file.tensors), tensor_file.path, raw)
    return Checkpoint(fmt, tensor_file.path, config, MappingProxyType(tensors), tensor_file.files,
                      raw_config=MappingProxyType(raw), _file=tensor_file)


def pair_companions(tensors: dict[str, TensorRef], path: str,
                    raw_config: Mapping[str, Any]) -> dict[str, TensorRef]:
    """Attach scale tensors to the weights they scale, so each weight is one ``TensorRef``.

    - FP8 ``X.weight`` + ``X.weight_scale_inv`` (DeepSeek-V3): a weight with block scales.
    - gpt-oss ``X_blocks`` (U8 [..., n/32, 16]) + ``X_scales`` (U8 [..., n/32]): one
      ``MXFP4_BLOCKS`` tensor named ``X`` of logical shape [..., n].
    """
    quant = raw_config.get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or FP8_DEFAULT_BLOCK)
    result = dict(tensors)
    for name, ref in tensors.items():
        if ref.dtype in ("F8_E4M3", "F8_E5M2"):
            scale = tensors.get(name + FP8_SCALE_SUFFIX)
            if scale is None:
                if quant.get("weight_block_size"):  # the config says every FP8 weight has block scales
                    raise FormatError(f"an FP8 weight without its scale tensor {name + FP8_SCALE_SUFFIX}",
                                      path=path, tensor=name, hint="the checkpoint is incomplete")
                continue  # per-tensor fp8 without scales: values are taken as stored
            if len(block) != len(ref.stored_shape):
                raise FormatError(f"FP8 block size {block} does not fit shape {ref.stored_shape}",
                                  path=path, tensor=name)
            want = tuple(-(-n // b) for n, b in zip(ref.stored_shape, block))
            if scale.stored_shape != want:
                raise FormatError(f"scales have shape {scale.stored_shape}; {ref.stored_shape} in "
                                  f"{block} blocks needs {want}", path=path, tensor=scale.name)
            result[name] = TensorRef(name, ref.dtype, ref.stored_shape, ref.location,
                                     scale=scale, scale_block=block)
            del result[scale.name]
        elif name.endswith("_blocks") and ref.dtype == "U8":
            base = name[: -len("_blocks")]
            scale = tensors.get(base + "_scales")
            if scale is None:
                raise FormatError(f"MXFP4 blocks without '{base}_scales'", path=path, tensor=name)
            shape = ref.stored_shape
            if len(shape) < 2 or shape[-1] != 16 or scale.stored_shape != shape[:-1]:
                raise FormatError(f"blocks {shape} and scales {scale.stored_shape} are not "
                                  "MXFP4 (expected [..., n/32, 16] and [..., n/32])",
                                  path=path, tensor=name)
            logical = shape[:-2] + (shape[-2] * 32,)
            scale_ref = TensorRef(scale.name, "U8", shape[:-1], scale.location)
            result[base] = TensorRef(base, "MXFP4_BLOCKS", logical, ref.location, scale=scale_ref)
            del result[name], result[scale.name]
    return result
