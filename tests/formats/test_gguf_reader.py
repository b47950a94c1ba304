"""GGUF reader: agreement with the gguf package, and llama.cpp's loader checks, byte by byte."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from ktc.errors import FormatError
from ktc.formats.dequant import to_float32
from ktc.formats.gguf_reader import LargeArray, open_gguf
from ktc.ir import STORAGE_TYPES

STRING, UINT32, ARRAY = 8, 4, 9


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + struct.pack("<II", UINT32, value)


def tensor_info(name: str, dims: tuple[int, ...], qtype: int = 0, offset: int = 0) -> bytes:
    return (gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", qtype, offset))


def gguf_file(path, *, kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"",
              magic: bytes = b"GGUF", version: int = 3, n_tensors: int | None = None,
              n_kv: int | None = None, alignment: int = 32) -> str:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    body += bytes(-len(body) % alignment)
    path.write_bytes(body + data)
    return str(path)


def random_blocks(rng, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Valid blocks of any ggml type: random bytes, with every fp16 scale field made finite."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    elems, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // elems, size), dtype=np.uint8)
    raw[..., 1::2] &= 0x3B  # keep every 16-bit word below 0x3C00 in magnitude: no inf or NaN
    return raw.reshape(*shape[:-1], -1)


def test_matches_gguf_package(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_expert_count(4)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5000)])
    rng = np.random.default_rng(0)
    values = {"a": rng.standard_normal((4, 8, 64)).astype(np.float32),
              "b": rng.standard_normal((3, 32)).astype(np.float16)}
    w.add_tensor("a", values["a"])
    w.add_tensor("b", values["b"])
    q = random_blocks(rng, (2, 5, 256), "Q4_K")
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    reference = gguf.GGUFReader(path)
    with open_gguf(path) as f:
        assert f.architecture == "qwen3moe"
        assert f.metadata["qwen3moe.expert_count"] == 4
        assert f.metadata["tokenizer.ggml.tokens"] == LargeArray("string", 5000)
        for t in reference.tensors:
            ref = f.tensors[t.name]
            assert ref.location.offset == t.data_offset
            assert ref.location.nbytes == t.n_bytes
            assert ref.stored_shape == tuple(int(d) for d in reversed(t.shape))
        assert f.tensors["q"].dtype == "Q4_K" and f.tensors["q"].shape == (2, 5, 256)
        np.testing.assert_array_equal(to_float32(f.tensors["a"]), values["a"])
        np.testing.assert_array_equal(to_float32(f.tensors["b"]), values["b"].astype(np.float32))
        np.testing.assert_array_equal(to_float32(f.tensors["q"]),
                                      gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K))
        # One expert of a stacked quantized tensor is a zero-copy row selection.
        from ktc.ir import Take
        one = f.tensors["q"].with_view(Take(0, 1))
        np.testing.assert_array_equal(to_float32(one), gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K)[1])


def write_split(folder, stem: str = "m", per_part: int = 2) -> tuple[list[str], dict[str, np.ndarray]]:
    """A GGUF split into parts by the gguf package's writer (``per_part`` tensors a part, the
    metadata in the first), as llama.cpp's gguf-split names them: the parts' paths and tensors."""
    import gguf
    from pathlib import Path

    w = gguf.GGUFWriter(str(folder / f"{stem}.gguf"), "qwen3moe", split_max_tensors=per_part)
    w.add_expert_count(4)
    rng = np.random.default_rng(1)
    values = {f"t{i}": rng.standard_normal((3, 32 * (i + 1))).astype(np.float32) for i in range(5)}
    for name, value in values.items():
        w.add_tensor(name, value)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file()
    parts = [str(p) for p in w.format_shard_names(Path(folder / f"{stem}.gguf"))]
    w.close()
    return parts, values


def test_a_split_gguf_opens_from_any_part_with_every_part_s_tensors(tmp_path):
    parts, values = write_split(tmp_path)
    assert [p.rsplit("/", 1)[1] for p in parts] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf",
                                                    "m-00003-of-00003.gguf"]
    for given in parts:
        with open_gguf(given) as f:
            assert f.path == parts[0] and f.files == tuple(parts)
            assert f.metadata["qwen3moe.expert_count"] == 4  # the first part's metadata
            assert sorted(f.tensors) == sorted(values)
            assert {f.tensors[n].location.path for n in values} == set(parts)
            for name, value in values.items():
                np.testing.assert_array_equal(to_float32(f.tensors[name]), value)


def test_a_split_gguf_with_a_part_missing_renamed_or_from_another_split_is_refused(tmp_path):
    import os
    import shutil

    parts, _ = write_split(tmp_path)
    os.remove(parts[2])
    with pytest.raises(FormatError, match="1 of the 3 parts of this GGUF are missing: m-00003-of-00003.gguf"):
        open_gguf(parts[0])
    renamed = str(tmp_path / "model.gguf")
    shutil.copy(parts[1], renamed)
    with pytest.raises(FormatError, match="its name does not say which"):
        open_gguf(renamed)
    other = tmp_path / "other"
    other.mkdir()
    other_parts, _ = write_split(other, per_part=3)  # two parts
    shutil.copy(parts[0], parts[2])  # the first part again where the third should be
    with pytest.raises(FormatError, match="split.no is 0, but the part's name makes it 2"):
        open_gguf(parts[0])
    shutil.copy(other_parts[1], str(tmp_path / "m-00002-of-00002.gguf"))
    shutil.copy(parts[0], str(tmp_path / "m-00001-of-00002.gguf"))
    with pytest.raises(FormatError, match="split.count is 3, but the part's name makes it 2"):
        open_gguf(str(tmp_path / "m-00002-of-00002.gguf"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "BF16", "F16", "F32"])
def test_block_types_kept_and_dequantized_like_gguf(tmp_path, qtype):
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    assert (STORAGE_TYPES[qtype].block_elems, STORAGE_TYPES[qtype].block_bytes) == gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(1)
    try:
        raw = gguf.quants.quantize(rng.standard_normal((3, 512)).astype(np.float32), t)
    except NotImplementedError:  # the gguf package only decodes K-quants: use random blocks
        raw = random_blocks(rng, (3, 512), qtype)
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("w", raw, raw_dtype=t)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with open_gguf(path) as f:
        ref = f.tensors["w"]
        assert ref.dtype == qtype and ref.shape == (3, 512)
        assert ref.nbytes == raw.nbytes
        np.testing.assert_array_equal(to_float32(ref), gguf.quants.dequantize(raw, t).astype(np.float32))


def test_every_ggml_block_size_matches_the_gguf_package():
    import gguf

    for t, (elems, size) in gguf.GGML_QUANT_SIZES.items():
        if t.name in STORAGE_TYPES and STORAGE_TYPES[t.name].is_quantized:
            assert (STORAGE_TYPES[t.name].block_elems, STORAGE_TYPES[t.name].block_bytes) == (elems, size), t.name


def _case(tmp_path, case):
    p = tmp_path / "bad.gguf"
    f32 = tensor_info("w", (4, 2), 0, 0)
    data = bytes(32)
    if case == "wrong_magic":
        return gguf_file(p, magic=b"GGUX")
    if case == "bad_version":
        return gguf_file(p, version=7)
    if case == "too_many_tensors":
        return gguf_file(p, n_tensors=2**40)
    if case == "too_many_kv":
        return gguf_file(p, n_kv=2**62)
    if case == "string_past_end":
        return gguf_file(p, kvs=[struct.pack("<Q", 2**60) + b"key"])
    if case == "array_past_end":
        return gguf_file(p, kvs=[gstr("arr") + struct.pack("<IIQ", ARRAY, UINT32, 2**50)])
    if case == "duplicate_key":
        return gguf_file(p, kvs=[kv_u32("a.b", 1), kv_u32("a.b", 2)])
    if case == "duplicate_tensor":
        return gguf_file(p, infos=[f32, tensor_info("w", (4, 2), 0, 32)], data=bytes(64))
    if case == "too_many_dims":
        return gguf_file(p, infos=[tensor_info("w", (1, 1, 1, 1, 2))], data=data)
    if case == "alignment":
        return gguf_file(p, kvs=[kv_u32("general.alignment", 24)], infos=[f32], data=data)
    if case == "data_past_end":
        return gguf_file(p, infos=[f32], data=bytes(16))
    if case == "out_of_order":
        return gguf_file(p, infos=[tensor_info("a", (8,), 0, 32), tensor_info("b", (8,), 0, 0)], data=bytes(64))
    if case == "row_not_multiple":
        return gguf_file(p, infos=[tensor_info("w", (40, 1), 8, 0)], data=bytes(64))
    if case == "unknown_type":
        return gguf_file(p, infos=[tensor_info("w", (4,), 99, 0)], data=data)
    if case == "unknown_value_type":
        return gguf_file(p, kvs=[gstr("k") + struct.pack("<I", 77) + b"\0" * 8])
    if case == "truncated_header":
        path = gguf_file(p, kvs=[kv_u32("a.b", 1)], infos=[f32], data=data)
        raw = p.read_bytes()
        p.write_bytes(raw[:40])
        return path
    if case == "tiny":
        p.write_bytes(b"GGUF")
        return str(p)
    raise AssertionError(case)


@pytest.mark.parametrize("case, words", [
    ("wrong_magic", ["bad magic", "GGUX"]),
    ("bad_version", ["version 7"]),
    ("too_many_tensors", ["1099511627776 tensors"]),
    ("too_many_kv", ["metadata entries"]),
    ("string_past_end", ["metadata key", "remain"]),
    ("array_past_end", ["array 'arr'", "remain"]),
    ("duplicate_key", ["duplicate metadata key", "a.b"]),
    ("duplicate_tensor", ["duplicate tensor name", "'w'"]),
    ("too_many_dims", ["5 dimensions"]),
    ("alignment", ["general.alignment", "power of two"]),
    ("data_past_end", ["past the end of the file", "'w'"]),
    ("out_of_order", ["out of order", "'a'"]),
    ("row_not_multiple", ["row length 40", "Q8_0", "32"]),
    ("unknown_type", ["unknown tensor type 99"]),
    ("unknown_value_type", ["unknown metadata value type 77"]),
    ("truncated_header", ["damaged"]),
    ("tiny", ["too short"]),
])
def test_corrupt_gguf(tmp_path, case, words):
    path = _case(tmp_path, case)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as info:
            open_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "bad.gguf" in message
    for word in words:
        assert word in message, (word, message)
    assert peak < 1_000_000, f"allocated {peak} bytes while rejecting a {case} file"
