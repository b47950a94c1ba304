"""Compiling bundles: byte compatibility, reproducibility, atomic writes, checksums, bad input."""

from __future__ import annotations

import errno
import hashlib
import os
import json
import struct

import numpy as np
import pytest

import model_factory as mf
from ktc.compile import compile_bundle
from ktc.errors import BundleError, ConfigError, KtcError
from ktc.formats.bundle import BundleHeader, open_bundle
from ktc.formats.quantize import dequantize


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_golden_header_bytes():
    header = BundleHeader(manifest_offset=128, manifest_length=1000, data_offset=4096, file_size=8192,
                          manifest_sha256=bytes(range(32)))
    raw = header.to_bytes()
    assert raw[:96].hex() == (
        "4b5443424e444c00" "0200" "0000" "80000000" "8000000000000000" "e803000000000000"
        "0010000000000000" "0020000000000000" + bytes(range(32)).hex() + "00" * 16)
    assert raw[96:] == hashlib.sha256(raw[:96]).digest()
    assert BundleHeader.from_bytes(raw) == header


def test_newer_major_version_is_refused_by_name(tmp_path, demo_model):
    out = tmp_path / "d.ktb"
    compile_bundle(demo_model, str(out))
    raw = bytearray(out.read_bytes())
    struct.pack_into("<H", raw, 8, 3)  # major version 3
    raw[96:128] = hashlib.sha256(bytes(raw[:96])).digest()
    out.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=r"version 3\.0 is newer"):
        open_bundle(str(out))


def test_same_bytes_twice_and_with_any_jobs(tmp_path, demo_model):
    kw = dict(plan_kwargs=dict(vram="16MiB", reserve=0, ram="1GiB"))
    a = compile_bundle(demo_model, str(tmp_path / "a.ktb"), **kw)
    b = compile_bundle(demo_model, str(tmp_path / "b.ktb"), **kw)
    c = compile_bundle(demo_model, str(tmp_path / "c.ktb"), jobs=2, **kw)
    assert a.sha256 == b.sha256 == c.sha256 == sha(tmp_path / "a.ktb")
    assert 0 < a.gpu_experts < 64
    z1 = compile_bundle(demo_model, str(tmp_path / "z1.ktb"), compress=True, cpu_scheme="q8_0")
    z2 = compile_bundle(demo_model, str(tmp_path / "z2.ktb"), compress=True, cpu_scheme="q8_0", jobs=2)
    assert z1.sha256 == z2.sha256


def test_bundle_round_trip_values(tmp_path, tiny_models):
    from ktc.api import load_model
    from ktc.formats.dequant import to_float32

    src = tiny_models["gpt_oss"]["safetensors"]
    out = tmp_path / "g.ktb"
    compile_bundle(src, str(out), cpu_scheme="f32", dense_scheme="f32")
    ir = load_model(src)
    expert = ir.layer(1).experts[5]
    with open_bundle(str(out)) as b:
        assert not b.verify()
        gate_up = b.tensor("layers.1.experts.5.gate_up")
        np.testing.assert_array_equal(gate_up[:32], to_float32(expert.gate))
        np.testing.assert_array_equal(gate_up[32:], to_float32(expert.up))
        np.testing.assert_array_equal(b.tensor("layers.1.experts.5.down"), to_float32(expert.down))
        bias = b.tensor("layers.1.experts.5.gate_up_bias")
        np.testing.assert_array_equal(bias, np.concatenate([to_float32(expert.gate_bias), to_float32(expert.up_bias)]))
        layer_info = b.manifest["model"]["moe_layers"][1]
        assert layer_info["activation"] == "swiglu_clamped" and layer_info["router_bias"]
        for block in b.blocks:
            assert block.offset % 4096 == 0 if block.kind == "expert" else block.offset % 64 == 0
        for t in b.tensors.values():
            assert t.offset % 64 == 0


def test_gguf_q8_0_experts_pass_through_equal_to_quantizing_f32(tmp_path, tiny_models):
    src = tiny_models["qwen3_moe"]["safetensors"]
    gguf_path = mf.write_gguf(src, str(tmp_path / "q8.gguf"), family="qwen3_moe", expert_qtype="Q8_0")
    compile_bundle(src, str(tmp_path / "from_f32.ktb"), cpu_scheme="q8_0")
    compile_bundle(gguf_path, str(tmp_path / "from_gguf.ktb"), cpu_scheme="q8_0")
    with open_bundle(str(tmp_path / "from_f32.ktb")) as a, open_bundle(str(tmp_path / "from_gguf.ktb")) as b:
        experts = [n for n in a.tensors if ".experts." in n]
        assert len(experts) == 3 * mf.EXPERTS * 2
        for name in experts:
            np.testing.assert_array_equal(a.tensor_bytes(name), b.tensor_bytes(name), err_msg=name)


def test_gpt_oss_mxfp4_source_repacks_losslessly(tmp_path, tiny_models):
    from ktc.api import load_model
    from ktc.formats.dequant import to_float32

    mf.write_gpt_oss_mxfp4(tiny_models["gpt_oss"]["safetensors"], str(tmp_path / "mx"))
    compile_bundle(str(tmp_path / "mx"), str(tmp_path / "mx.ktb"), cpu_scheme="mxfp4")
    expert = load_model(str(tmp_path / "mx")).layer(0).experts[2]
    with open_bundle(str(tmp_path / "mx.ktb")) as b:
        raw = b.tensor("layers.0.experts.2.gate_up")
        values = dequantize(raw, "mxfp4", mf.HIDDEN)
    np.testing.assert_array_equal(values[:32], to_float32(expert.gate))
    np.testing.assert_array_equal(values[32:], to_float32(expert.up))


def test_flipping_any_sampled_byte_fails_verification(tmp_path, tiny_models):
    src = tiny_models["qwen2_moe"]["safetensors"]
    good = tmp_path / "good.ktb"
    compile_bundle(src, str(good), plan_kwargs=dict(vram="1MiB", reserve=0, max_tokens=16), compress=True)
    raw = good.read_bytes()
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.integers(0, len(raw), 200).tolist()) | {0, 8, 50, 100, 127, 128, len(raw) - 1})
    bad = tmp_path / "bad.ktb"
    for pos in positions:
        damaged = bytearray(raw)
        damaged[pos] ^= 0x5A
        bad.write_bytes(bytes(damaged))
        try:
            with open_bundle(str(bad)) as b:
                problems = b.verify()
        except BundleError:
            continue
        assert problems, f"flipping byte {pos} went unnoticed"


def test_verify_names_the_damaged_tensor(tmp_path, demo_model):
    out = tmp_path / "d.ktb"
    compile_bundle(demo_model, str(out))
    with open_bundle(str(out)) as b:
        target = b.tensors["layers.2.experts.7.down"]
        offset = target.offset + 5
    raw = bytearray(out.read_bytes())
    raw[offset] ^= 1
    out.write_bytes(bytes(raw))
    with open_bundle(str(out)) as b:
        problems = b.verify()
    assert len(problems) == 1 and "layers.2.experts.7" in problems[0] and "down" in problems[0]


def test_bad_inputs_leave_nothing_behind(tmp_path, demo_model, tiny_models):
    out = tmp_path / "out.ktb"

    def leftovers():
        return sorted(p.name for p in tmp_path.iterdir())

    with pytest.raises(ConfigError, match="unknown scheme"):
        compile_bundle(demo_model, str(out), cpu_scheme="int3")
    with pytest.raises(ConfigError, match="multiple of 128"):
        compile_bundle(tiny_models["mixtral"]["safetensors"], str(out), cpu_scheme="int4_g128")
    from ktc.api import plan

    other = plan(tiny_models["mixtral"]["safetensors"], vram="1GiB", reserve=0)
    (tmp_path / "plan.json").write_text(json.dumps(other.to_json()))
    with pytest.raises(ConfigError, match="another model"):
        compile_bundle(demo_model, str(out), plan_path=str(tmp_path / "plan.json"))
    (tmp_path / "plan.json").unlink()
    assert leftovers() == []
    with pytest.raises(KtcError, match="does not exist"):
        compile_bundle(demo_model, str(tmp_path / "no" / "such" / "out.ktb"))


@pytest.mark.parametrize("failure", ["disk_full", "interrupt"])
def test_failure_mid_write_keeps_the_previous_bundle(tmp_path, demo_model, monkeypatch, failure):
    import ktc.passes.emit as emit

    out = tmp_path / "out.ktb"
    compile_bundle(demo_model, str(out))
    before = sha(out)
    calls = {"n": 0}
    real_build = emit.build_expert

    def failing_build(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            if failure == "interrupt":
                raise KeyboardInterrupt
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_build(*args, **kwargs)

    if failure == "disk_full":
        real_write = emit._Writer.write

        def full_write(self, data, digest=None):
            if self.pos > 2_000_000:
                raise emit._os_error(OSError(errno.ENOSPC, "No space left on device"), self.path)
            return real_write(self, data, digest)

        monkeypatch.setattr(emit._Writer, "write", full_write)
        with pytest.raises(KtcError, match="disk is full"):
            compile_bundle(demo_model, str(out), cpu_scheme="f32")
    else:
        monkeypatch.setattr(emit, "build_expert", failing_build)
        with pytest.raises(KeyboardInterrupt):
            compile_bundle(demo_model, str(out), cpu_scheme="f32")
    assert sha(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.ktb"]


def test_inspect_tensors_offsets_are_absolute(tmp_path, demo_model):
    from click.testing import CliRunner

    from ktc.cli import main

    out = tmp_path / "d.ktb"
    compile_bundle(demo_model, str(out), plan_kwargs=dict(vram="16MiB", reserve=0))
    result = CliRunner().invoke(main, ["inspect", str(out), "--json", "--tensors"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    raw = out.read_bytes()
    with open_bundle(str(out)) as b:
        for row in info["tensors"][:: max(1, len(info["tensors"]) // 25)]:
            assert set(row) >= {"name", "scheme", "offset", "nbytes", "shape"}
            np.testing.assert_array_equal(np.frombuffer(raw, np.uint8, row["nbytes"], row["offset"]),
                                          b.tensor_bytes(row["name"]))
    assert info["gpu_experts"] + info["cpu_experts"] == 64


def test_open_close_1000_times_leaks_nothing(tmp_path, demo_model):
    import gc

    from conftest import fd_and_map_counts

    out = tmp_path / "d.ktb"
    compile_bundle(demo_model, str(out))

    def cycle():
        with open_bundle(str(out)) as b:
            float(b.tensor("model.norm.weight")[0])

    cycle()
    gc.collect()
    before = fd_and_map_counts()
    for _ in range(1000):
        cycle()
    gc.collect()
    assert fd_and_map_counts() == before


def test_opening_reads_only_header_and_manifest(tmp_path, demo_model):
    import time

    out = tmp_path / "d.ktb"
    compile_bundle(demo_model, str(out))

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    before = read_bytes()
    started = time.perf_counter()
    with open_bundle(str(out)) as b:
        elapsed = time.perf_counter() - started
        read = read_bytes() - before
        region = b.header.data_offset
        assert b.tensor("layers.3.experts.9.down").shape[0] == 256  # mapping reads nothing either
    assert read < region + 4096, (read, region)  # no expert bytes, whatever the file's size
    assert elapsed < 0.5


def test_every_expert_starts_on_a_page_with_gpu_experts(tmp_path, demo_model):
    """The device segment's non-expert tensors are padded so the GPU experts after them start
    on pages too (docs/bundle-format.md)."""
    out = tmp_path / "g.ktb"
    result = compile_bundle(demo_model, str(out), plan_kwargs=dict(vram="16MiB", reserve=0))
    assert result is not None and result.gpu_experts > 0
    with open_bundle(str(out)) as bundle:
        experts = [b for b in bundle.manifest["blocks"] if b["kind"] == "expert"]
        assert {b["device"] for b in experts} == {"gpu", "cpu"}
        assert all(b["offset"] % 4096 == 0 for b in experts)
        assert bundle.verify() == []


def test_passes_stop_and_dump(tmp_path, demo_model):
    """The compile runs as passes: --stop-after writes nothing, --dump-after shows the IR."""
    out = tmp_path / "s.ktb"
    dumps: list[str] = []
    assert compile_bundle(demo_model, str(out), plan_kwargs=dict(vram="16MiB", reserve=0),
                          stop_after="layout", dump_after="quantize", dump=dumps.append) is None
    assert not out.exists() and list(tmp_path.iterdir()) == []
    (dumped,) = [json.loads(text) for text in dumps]
    assert dumped["after"] == "quantize" and dumped["placement"]["gpu_experts"] > 0
    assert dumped["quant"]["expert_schemes"] == {"bf16": dumped["placement"]["gpu_experts"],
                                                 "int8": dumped["placement"]["cpu_experts"]}
    assert "layout" not in dumped
    with pytest.raises(ConfigError, match="no pass named 'lay-out'"):
        compile_bundle(demo_model, str(out), stop_after="lay-out")


def test_check_names_the_pass_that_broke_its_postconditions(tmp_path, demo_model, monkeypatch):
    from dataclasses import replace

    import ktc.passes.layout as layout_pass
    from ktc.errors import InternalError

    real = layout_pass.plan_layout

    def misaligned(ir, placement, quant, files=()):
        layout = real(ir, placement, quant, files)
        first = layout.blocks[0]
        return layout_pass.BundleLayout((replace(first, length=first.length + 64),) + layout.blocks[1:])

    monkeypatch.setattr(layout_pass, "plan_layout", misaligned)
    with pytest.raises(InternalError, match="pass 'layout' failed.*not on a page"):
        compile_bundle(demo_model, str(tmp_path / "x.ktb"), check=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dense", ["bf16", "q8_0", "int8", "q4_0"])
def test_planner_counts_non_expert_bytes_as_the_bundle_stores_them(tmp_path, demo_model, dense):
    """--dense-scheme sizes the planner's non-expert VRAM and the bundle's tensors alike."""
    from ktc.formats.schemes import TENSOR_ALIGN, align

    path = str(tmp_path / "d.ktb")
    compile_bundle(demo_model, path, dense_scheme=dense, plan_kwargs=dict(vram="16MiB", reserve=0, ram="1GiB"))
    with open_bundle(path) as b:
        vram = b.manifest["plan"]["memory"]["vram"]
        ram = b.manifest["plan"]["memory"]["ram"]
        stored = {seg: sum(align(t.nbytes, TENSOR_ALIGN) for t in b.tensors.values()
                           if t.role != "expert" and t.segment == seg) for seg in ("device", "host")}
        schemes = {t.scheme for t in b.tensors.values() if t.role != "expert" and len(t.shape) == 2
                   and t.role != "router"}
    planned = sum(v for k, v in vram.items() if k not in ("gpu_experts", "kv_cache", "workspace", "reserve"))
    assert stored["device"] == planned
    assert stored["host"] == ram["embeddings"]
    assert schemes == {dense}


def test_bundle_gets_the_permissions_of_a_new_file(tmp_path, demo_model):
    """Written through a private temporary file, the bundle still ends up readable as any file
    the user creates (mode 0666 minus the umask), not 0600."""
    old = os.umask(0o022)
    try:
        compile_bundle(demo_model, str(tmp_path / "m.ktb"))
    finally:
        os.umask(old)
    assert (tmp_path / "m.ktb").stat().st_mode & 0o777 == 0o644


def _copy(src: str, dst) -> str:
    import shutil

    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return str(dst)


@pytest.mark.parametrize("target", ["same", "hard_link", "config", "plan"])
def test_compile_never_replaces_a_file_it_reads(tmp_path, tiny_models, target):
    if target == "same":
        source = _copy(tiny_models["mixtral"]["gguf"], tmp_path / "m.gguf")
        out, kw = source, {}
    elif target == "hard_link":
        source = _copy(tiny_models["mixtral"]["safetensors"], tmp_path / "src")
        shard = next(str(p) for p in (tmp_path / "src").iterdir() if p.suffix == ".safetensors")
        out, kw = str(tmp_path / "link.ktb"), {}
        os.link(shard, out)
    elif target == "config":
        source = _copy(tiny_models["mixtral"]["pytorch"], tmp_path / "src")
        out, kw = str(tmp_path / "src" / "config.json"), {}
    else:
        source = tiny_models["mixtral"]["gguf"]
        out = str(tmp_path / "plan.json")
        from ktc.api import plan

        with open(out, "w") as f:
            json.dump(plan(source, vram="64MiB", reserve="0").to_json(), f)
        kw = {"plan_path": out}
    before = {p: open(p, "rb").read() for p in [out]}
    with pytest.raises(KtcError, match="a file this compile reads"):
        compile_bundle(source, out, **kw)
    assert {p: open(p, "rb").read() for p in [out]} == before
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.endswith(".tmp")]


def _poisoned_copy(src: str, dst, name_part: str, value: float) -> tuple[str, str]:
    """A copy of a safetensors model folder with one value of the first tensor whose name
    contains ``name_part`` set to ``value``."""
    from safetensors.numpy import load_file, save_file

    folder = _copy(src, dst)
    shard = next(p for p in sorted(os.listdir(folder)) if p.endswith(".safetensors"))
    tensors = load_file(os.path.join(folder, shard))
    name = next(n for n in sorted(tensors) if name_part in n)
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[7] = value
    save_file(tensors, os.path.join(folder, shard), metadata={"format": "pt"})
    return folder, name


@pytest.mark.parametrize("where, value, kw", [
    ("experts.3.w2", np.nan, {}),
    ("experts.3.w2", np.inf, {"jobs": 2}),
    ("experts.1.w1", -np.inf, {"cpu_scheme": "f32"}),  # stored as it is: the bits are checked
    ("self_attn.q_proj", np.nan, {}),
    ("self_attn.q_proj", np.inf, {"dense_scheme": "f32"}),
    ("norm.weight", np.nan, {}),
])
def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, tiny_models, where, value, kw):
    source, name = _poisoned_copy(tiny_models["mixtral"]["safetensors"], tmp_path / "src", where, value)
    out = str(tmp_path / "m.ktb")
    with pytest.raises(KtcError, match="1 of .* values are NaN or infinite") as info:
        compile_bundle(source, out, **kw)
    assert name in str(info.value) and "--allow-nonfinite" in str(info.value)
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    compile_bundle(source, out, allow_nonfinite=True, **kw)
    assert os.path.exists(out)


def test_report_error_never_reports_zero_for_an_unmeasurable_expert(tmp_path, tiny_models):
    source, _ = _poisoned_copy(tiny_models["mixtral"]["safetensors"], tmp_path / "src",
                               "layers.1.block_sparse_moe.experts.2.w1", np.nan)
    result = compile_bundle(source, str(tmp_path / "m.ktb"), allow_nonfinite=True, report_error=True)
    errors = {(e.layer, e.expert): e.rel_rmse for e in result.emit.errors}
    assert np.isnan(errors[(1, 2)])
    assert all(0 < v < 0.05 for k, v in errors.items() if k != (1, 2))
    listed = json.loads(json.dumps(result.to_json()))["expert_errors"]
    assert [e["rel_rmse"] for e in listed if (e["layer"], e["expert"]) == (1, 2)] == [None]


def test_check_finite_reads_the_bits_of_stored_floats():
    from ktc.formats.quantize import check_finite

    for dtype, values in (("F16", np.array([1, np.inf, 2], np.float16)),
                          ("BF16", (np.array([1, np.nan, 2], np.float32).view(np.uint32) >> 16).astype(np.uint16)),
                          ("F32", np.array([3e38, 3e38, np.nan], np.float32))):
        with pytest.raises(KtcError, match="1 of 3 values"):
            check_finite(values, "t", dtype)
    check_finite(np.array([3e38, 3e38, 3e38], np.float32), "t")  # the sum overflows; the values do not
    check_finite(np.array([65504, -65504], np.float16), "t", "F16")


def test_manifest_shape_that_no_block_scheme_can_hold(tmp_path, tiny_models):
    """A q8_0 tensor whose manifest row is 1 value wide (a fuzzer find): a BundleError, not the
    scheme's ValueError."""
    out = tmp_path / "m.ktb"
    compile_bundle(tiny_models["mixtral"]["gguf"], str(out), cpu_scheme="q8_0")
    raw = out.read_bytes()
    with open_bundle(str(out)) as b:
        name = next(t.name for t in b.tensors.values() if t.scheme == "q8_0")
    start = raw.index(b'"name":"%s"' % name.encode())
    start = raw.rindex(b"{", 0, start)
    end = raw.index(b"}", start)
    entry = raw[start:end]
    shape = entry.index(b'"shape":[') + len(b'"shape":[')
    close = entry.index(b"]", shape)
    rows = entry[shape:close].split(b",")[0]
    patched = (rows + b",1").ljust(close - shape)
    out.write_bytes(raw[:start + shape] + patched + raw[start + close:])
    with pytest.raises(BundleError, match="rows of 1 values cannot be stored in q8_0"):
        open_bundle(str(out))


@pytest.mark.parametrize("qtype, scheme", [("Q8_0", "q8_0"), ("Q4_0", "q4_0")])
def test_passed_through_blocks_with_a_nan_scale_are_refused(tmp_path, tiny_models, qtype, scheme):
    """Blocks copied as stored are checked by their fp16 scales (a NaN scale makes the block NaN)."""
    from gguf import GGUFReader

    path = tmp_path / "m.gguf"
    mf.write_gguf(tiny_models["qwen3_moe"]["safetensors"], str(path), family="qwen3_moe", expert_qtype=qtype)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name.endswith("ffn_down_exps.weight"))
    raw = bytearray(path.read_bytes())
    block = 34 if qtype == "Q8_0" else 18
    at = int(tensor.data_offset) + 5 * block
    raw[at: at + 2] = np.float16(np.nan).tobytes()
    path.write_bytes(bytes(raw))
    out = str(tmp_path / "m.ktb")
    with pytest.raises(KtcError, match=f"1 of .* {qtype} blocks have a NaN or infinite scale"):
        compile_bundle(str(path), out, cpu_scheme=scheme)
    compile_bundle(str(path), out, cpu_scheme=scheme, allow_nonfinite=True)


def test_gpt_oss_mxfp4_scale_of_nan_is_refused(tmp_path, tiny_models):
    """gpt-oss's released MXFP4 experts: an e8m0 scale of 0xFF (NaN) is refused when the blocks
    pass through to ktc's mxfp4, and compiled with --allow-nonfinite."""
    from safetensors.numpy import save_file

    tensors = mf.write_gpt_oss_mxfp4(tiny_models["gpt_oss"]["safetensors"], str(tmp_path / "mx"))
    name = next(n for n in sorted(tensors) if n.endswith("down_proj_scales"))
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[3] = 0xFF
    save_file(tensors, str(tmp_path / "mx" / "model.safetensors"))
    out = str(tmp_path / "mx.ktb")
    with pytest.raises(KtcError, match="1 of .* MXFP4 block scales are NaN"):
        compile_bundle(str(tmp_path / "mx"), out, cpu_scheme="mxfp4")
    compile_bundle(str(tmp_path / "mx"), out, cpu_scheme="mxfp4", allow_nonfinite=True)
