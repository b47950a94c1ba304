"""PyTorch reader: offsets from meta tensors, sharding, and refusing unsafe pickles."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from ktc.errors import FormatError
from ktc.formats.dequant import to_float32
from ktc.formats.pytorch_reader import open_pytorch


def test_values_views_and_dtypes(tmp_path):
    base = torch.arange(40, dtype=torch.float32)
    state = {
        "plain": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "slice": base[10:20],  # a view with a storage offset
        "row": base.reshape(4, 10)[2],
        "transposed": torch.randn(3, 5).t(),  # not contiguous
        "i8": torch.randint(-5, 5, (6,), dtype=torch.int8),
    }
    torch.save(state, tmp_path / "m.pt")
    with open_pytorch(str(tmp_path / "m.pt")) as f:
        for name, value in state.items():
            np.testing.assert_array_equal(to_float32(f.tensors[name]), value.float().numpy(), err_msg=name)
        assert f.tensors["bf16"].dtype == "BF16"
        assert f.tensors["transposed"].location.strides == (1, 5)


def test_nested_state_dict(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "m.pt")
    with open_pytorch(str(tmp_path / "m.pt")) as f:
        assert set(f.tensors) == {"w"}


def test_sharded_bin(tiny_models, tmp_path):
    import model_factory as mf
    from ktc.api import load_model

    folder = mf.write_pytorch_from_safetensors(tiny_models["qwen2_moe"]["safetensors"], str(tmp_path / "sh"), shards=3)
    ir = load_model(folder)
    assert len(ir.source.files) == 3 and ir.family == "qwen2_moe"


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_arbitrary_code_pickle_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "evil": _Payload()}, tmp_path / "evil.bin")
    with pytest.raises(FormatError) as info:
        open_pytorch(str(tmp_path / "evil.bin"))
    message = str(info.value)
    assert "evil.bin" in message and "arbitrary code" in message and "not executed" in message
    assert "GLOBAL" in message and "system" in message and "Weights only load failed" not in message
    assert not (tmp_path / "pwned").exists()


def test_truncated_file(tmp_path):
    torch.save({"w": torch.randn(100, 100)}, tmp_path / "m.bin")
    raw = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(FormatError, match="m.bin"):
        open_pytorch(str(tmp_path / "m.bin"))


def test_legacy_format_refused_with_hint(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(FormatError, match="legacy"):
        open_pytorch(str(tmp_path / "old.bin"))


def test_missing_shard(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "p1.bin")
    json.dump({"weight_map": {"a": "p1.bin", "b": "p2.bin"}}, open(tmp_path / "pytorch_model.bin.index.json", "w"))
    with pytest.raises(FormatError, match="p2.bin.*missing"):
        open_pytorch(str(tmp_path))


def test_every_torch_load_failure_on_a_patched_file_is_a_format_error(tmp_path):
    """One-byte patches over the whole pickle of a torch.save file (a few values a byte): every
    one that torch.load cannot read is a FormatError naming the file, with torch's exception
    chained and its type in the message; and the patches reach the many exception types that
    torch's zip reader and restricted unpickler raise."""
    torch.save({"model.layers.0.mlp.experts.0.w1.weight": torch.randn(8, 4),
                "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "seed.bin")
    raw = (tmp_path / "seed.bin").read_bytes()
    start = raw.index(b"\x80\x02")  # the pickle's PROTO opcode, stored uncompressed in the zip
    end = raw.index(b"PK\x07\x08", start)
    causes: dict[str, int] = {}
    loaded = 0
    path = tmp_path / "patched.bin"
    for pos in range(start, end):
        for value in (0x00, 0x29, 0x30, 0x4F, 0x72, 0x7F, 0x86, 0xFF):
            if raw[pos] == value:
                continue
            patched = bytearray(raw)
            patched[pos] = value
            path.write_bytes(bytes(patched))
            try:
                tensors = open_pytorch(str(path)).tensors
            except FormatError as exc:
                assert "patched.bin" in str(exc)
                cause = exc.__cause__
                if cause is None:  # refused by the reader's own checks after torch.load
                    assert "cannot read checkpoint" not in str(exc), str(exc)
                    continue
                assert "arbitrary code" not in str(exc) or "GLOBAL" in str(exc)
                name = type(cause).__name__
                causes[name] = causes.get(name, 0) + 1
            else:
                loaded += 1
                assert all(isinstance(name, str) for name in tensors)
    for name in ("AttributeError", "TypeError", "AssertionError", "IndexError", "KeyError",
                 "UnicodeDecodeError", "EOFError", "UnpicklingError"):
        assert name in causes, (name, causes)
    assert loaded > 0  # some patches change only values (a name's letter, a number)


def test_zip_end_record_that_python_cannot_read(tmp_path):
    """zipfile.is_zipfile itself raises on a zip64 locator naming several disks (a fuzzer find)."""
    import struct

    locator = b"PK\x06\x07" + struct.pack("<LQL", 0, 0, 2)
    end = b"PK\x05\x06" + bytes(18)
    (tmp_path / "m.bin").write_bytes(bytes(64) + locator + end)
    with pytest.raises(FormatError, match="m.bin: cannot read checkpoint: damaged zip archive") as info:
        open_pytorch(str(tmp_path / "m.bin"))
    assert info.value.__cause__ is not None
