"""SafeTensors reader: laziness, sharding, and every corrupt-input check."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from ktc.errors import FormatError, KtcError
from ktc.formats.checkpoint import open_checkpoint
from ktc.formats.safetensors_reader import open_safetensors


def write_raw(path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length))
        f.write(raw)
        f.write(data)
    return str(path)


def entry(dtype="F32", shape=(2, 2), begin=0, end=16):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_reads_header_and_maps_values(tmp_path):
    from safetensors.numpy import save_file

    values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int8)}
    save_file(values, str(tmp_path / "m.safetensors"))
    with open_safetensors(str(tmp_path / "m.safetensors")) as f:
        assert f.tensors["a"].shape == (2, 3) and f.tensors["a"].dtype == "F32"
        assert f.tensors["b"].dtype == "I8"
        np.testing.assert_array_equal(f.load("a"), values["a"])
        np.testing.assert_array_equal(f.load("b"), values["b"])
        assert not f.load("a").flags.writeable  # a view of the map, never a copy to mutate


def test_every_moe_dtype(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {
        "f32": torch.randn(4, 8), "f16": torch.randn(4, 8).half(), "bf16": torch.randn(4, 8).bfloat16(),
        "f8": torch.randn(4, 8).to(torch.float8_e4m3fn), "u8": torch.randint(0, 255, (4, 8), dtype=torch.uint8),
        "i8": torch.randint(-100, 100, (4, 8), dtype=torch.int8), "i32": torch.randint(-9, 9, (4,), dtype=torch.int32),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    from ktc.formats.dequant import to_float32

    with open_safetensors(str(tmp_path / "m.safetensors")) as f:
        assert {n: r.dtype for n, r in f.tensors.items()} == {
            "f32": "F32", "f16": "F16", "bf16": "BF16", "f8": "F8_E4M3", "u8": "U8", "i8": "I8", "i32": "I32"}
        for name, value in tensors.items():
            np.testing.assert_array_equal(to_float32(f.tensors[name]), value.float().numpy(), err_msg=name)


def test_sharded_index(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": np.zeros(3, np.float32)}, str(tmp_path / "s2.safetensors"))
    json.dump({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}},
              open(tmp_path / "model.safetensors.index.json", "w"))
    with open_safetensors(str(tmp_path)) as f:
        assert set(f.tensors) == {"a", "b"} and len(f.files) == 2
        np.testing.assert_array_equal(f.load("b"), np.zeros(3))


def test_shard_listed_but_missing(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    json.dump({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}},
              open(tmp_path / "model.safetensors.index.json", "w"))
    with pytest.raises(FormatError) as info:
        open_safetensors(str(tmp_path))
    assert "s2.safetensors" in str(info.value) and "missing" in str(info.value)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_names_tensor_no_shard_has(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    json.dump({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}},
              open(tmp_path / "model.safetensors.index.json", "w"))
    with pytest.raises(FormatError, match="ghost"):
        open_safetensors(str(tmp_path))


@pytest.mark.parametrize("case, words", [
    ("empty", ["shorter than the 8-byte header"]),
    ("header_past_end", ["header length", "past the end"]),
    ("broken_json", ["not valid JSON"]),
    ("not_object", ["not a JSON object"]),
    ("duplicate_key", ["duplicate key", "w"]),
    ("overlap", ["overlap", "a", "b"]),
    ("out_of_file", ["past the end of the data", "w"]),
    ("truncated_data", ["past the end of the data", "w", "truncated"]),
    ("shape_bytes_disagree", ["needs 16 bytes", "give 12", "w"]),
    ("unknown_dtype", ["unknown dtype", "F12"]),
    ("bad_shape", ["shape", "non-negative"]),
    ("decreasing_offsets", ["not increasing"]),
])
def test_corrupt_safetensors(tmp_path, case, words):
    path = tmp_path / "bad.safetensors"
    data = bytes(16)
    if case == "empty":
        path.write_bytes(b"\x01\x02")
    elif case == "header_past_end":
        write_raw(path, {"w": entry()}, data, length=10_000)
    elif case == "broken_json":
        write_raw(path, b'{"w": {"dtype": "F32", ', data)
    elif case == "not_object":
        write_raw(path, b"[1, 2]", data)
    elif case == "duplicate_key":
        write_raw(path, b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                        b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', data)
    elif case == "overlap":
        write_raw(path, {"a": entry(end=16), "b": entry(shape=(2,), begin=8, end=16)}, data)
    elif case == "out_of_file":
        write_raw(path, {"w": entry(begin=16, end=32)}, data)
    elif case == "truncated_data":
        write_raw(path, {"w": entry()}, data[:10])
    elif case == "shape_bytes_disagree":
        write_raw(path, {"w": entry(end=12)}, data)
    elif case == "unknown_dtype":
        write_raw(path, {"w": entry(dtype="F12")}, data)
    elif case == "bad_shape":
        write_raw(path, {"w": entry(shape=(-1, 4))}, data)
    elif case == "decreasing_offsets":
        write_raw(path, {"w": entry(begin=16, end=0)}, data)
    with pytest.raises(FormatError) as info:
        open_safetensors(str(path))
    message = str(info.value)
    assert "bad.safetensors" in message
    for word in words:
        assert word in message, (word, message)


def test_missing_config_json(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KtcError, match="config.json"):
        open_checkpoint(str(tmp_path))


def test_broken_config_json(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"hidden_size": 4,')
    with pytest.raises(FormatError, match="config.json.*not valid JSON"):
        open_checkpoint(str(tmp_path))


def test_large_sparse_checkpoint_inspects_fast_without_reading_data(tmp_path):
    """A header that describes 187 GB of Mixtral-8x7B tensors over a sparse file."""
    import time

    from ktc.api import load_model
    from ktc.summary import summarize

    # Mixtral-8x7B's published config.json values.
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 32000}
    h, inter, kv = 4096, 14336, 8 * 128
    shapes = {"model.embed_tokens.weight": (32000, h), "lm_head.weight": (32000, h), "model.norm.weight": (h,)}
    for layer in range(32):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "block_sparse_moe.gate.weight": (8, h)})
        for e in range(8):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (inter, h), q + "w3.weight": (inter, h), q + "w2.weight": (h, inter)})
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 4
        header[name] = entry("F32", shape, offset, offset + n)
        offset += n
    assert offset > 100e9
    path = write_raw(tmp_path / "model.safetensors", header)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + offset)  # sparse: no blocks allocated
    json.dump(config, open(tmp_path / "config.json", "w"))

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    before = read_bytes()
    started = time.perf_counter()
    summary = summarize(load_model(str(tmp_path)))
    elapsed = time.perf_counter() - started
    read = read_bytes() - before
    assert summary.family == "mixtral" and summary.num_experts == 8 and len(summary.moe_layers) == 32
    assert summary.expert_bytes == 3 * inter * h * 4
    assert sum(summary.bytes.values()) == offset
    assert elapsed < 1.0, elapsed
    assert read < 2_000_000, read  # the header and config, not tensor data
