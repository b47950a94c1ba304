"""``ktc inspect`` as a user runs it (``ktc demo``: tests/runtime/test_demo_training.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import model_factory as mf
from ktc.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("family", list(mf.FAMILIES))
@pytest.mark.parametrize("fmt", ["safetensors", "pytorch", "gguf"])
def test_inspect_json(tiny_models, family, fmt):
    spec = mf.FAMILIES[family]
    result = run("inspect", tiny_models[family][fmt], "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["family"] == spec.name
    assert out["num_layers"] == mf.LAYERS
    assert out["moe_layers"] == list(spec.moe_layers)
    assert out["num_experts"] == mf.EXPERTS
    assert out["top_k"] == mf.TOP_K
    assert out["num_shared_experts"] == spec.shared
    assert out["hidden_size"] == mf.HIDDEN
    assert set(out["bytes"]) >= {"routed_experts", "shared_experts", "attention", "embeddings", "other"}
    assert out["bytes"]["routed_experts"] == len(spec.moe_layers) * mf.EXPERTS * out["expert_bytes"]
    assert out["kv_bytes_per_token"] > 0


def test_inspect_kv_bytes_formulas(tiny_models):
    gqa = json.loads(run("inspect", tiny_models["mixtral"]["safetensors"], "--json").output)
    assert gqa["kv_bytes_per_token"] == 2 * mf.LAYERS * 2 * (mf.HIDDEN // 4) * 2
    mla = json.loads(run("inspect", tiny_models["deepseek_v3"]["safetensors"], "--json").output)
    assert mla["kv_bytes_per_token"] == mf.LAYERS * (16 + 8) * 2  # kv_lora_rank + qk_rope_head_dim
    mla_gguf = json.loads(run("inspect", tiny_models["deepseek_v3"]["gguf"], "--json").output)
    assert mla_gguf["kv_bytes_per_token"] == mla["kv_bytes_per_token"]


def test_inspect_text_and_tensors(tiny_models):
    result = run("inspect", tiny_models["qwen2_moe"]["gguf"], "--tensors")
    assert result.exit_code == 0
    assert "qwen2_moe" in result.output and "blk.1.ffn_gate_exps.weight" in result.output
    listed = json.loads(run("inspect", tiny_models["qwen2_moe"]["gguf"], "--json", "--tensors").output)
    row = next(t for t in listed["tensors"] if t["name"] == "blk.1.ffn_gate_exps.weight")
    assert row["role"] == "routed_experts" and row["shape"] == [mf.EXPERTS, 32, mf.HIDDEN]


def test_errors_are_short_and_nonzero(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + bytes(40))
    for args in (["inspect", str(tmp_path / "bad.gguf")], ["inspect", str(tmp_path / "missing")]):
        proc = subprocess.run([sys.executable, "-m", "ktc.cli", *args], capture_output=True, text=True)
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        assert 1 <= len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
        assert proc.stderr.startswith("error: ")


def test_help_has_examples():
    for command in ("inspect", "demo"):
        result = run(command, "--help")
        assert result.exit_code == 0 and "Example" in result.output
