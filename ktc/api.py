"""The public Python API."""

from __future__ import annotations

import os

from ktc.formats.checkpoint import open_checkpoint
from ktc.ir import ModelIR
from ktc.passes.base import PassContext
from ktc.passes.detect import DetectExperts
from ktc.pipeline import PassManager


def load_model(path: str | os.PathLike[str], *, check: bool = True) -> ModelIR:
    """Read a checkpoint's headers and config and detect its experts; reads no tensor data.

    ``path`` is a Hugging Face model folder (safetensors or PyTorch ``.bin``), a single
    ``.safetensors``/``.pt``/``.bin`` file with ``config.json`` beside it, or a ``.gguf`` file.
    """
    with open_checkpoint(path) as ckpt:
        manager = PassManager((DetectExperts(ckpt),))
        return manager.run(PassContext(check=check))
