"""Schemes' errors on the activations that reach the experts (``--calibration-text``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ktc.api import load_model
from ktc.cli import main
from ktc.passes.activation_error import layer_scheme_errors
from ktc.passes.placement_solver import CPU, PlacementOption, PlacementProblem, solve_placement


def test_errors_grow_with_fewer_bits_and_an_exact_scheme_has_none(demo_model):
    ir = load_model(demo_model)
    rng = np.random.default_rng(0)
    hidden, experts, k = ir.config.hidden_size, ir.config.num_experts, ir.config.top_k
    inputs = {layer.layer: (rng.standard_normal((64, hidden)).astype(np.float32),
                            rng.integers(0, experts, (64, k))) for layer in ir.moe_layers}
    errors = layer_scheme_errors(ir, inputs, ("f32", "bf16", "int8", "q4_0"))
    assert errors["f32"] == (0.0,) * len(ir.moe_layers)
    for layer in range(len(ir.moe_layers)):
        assert 0 < errors["bf16"][layer] < errors["int8"][layer] < errors["q4_0"][layer] < 0.5


def test_the_solver_weighs_each_layers_own_errors():
    # two layers of one expert each, room for one precise expert: it goes where its scheme's
    # error would be largest, which only the per-layer errors tell
    options = (PlacementOption(CPU, "precise", 0, 2, 1e-3, error=0.01),
               PlacementOption(CPU, "small", 0, 1, 1e-3, error=0.05))
    for bad_layer in (0, 1):
        errors = np.array([[0.01, 0.01], [0.01, 0.01]])
        errors[bad_layer, 1] = 0.9
        problem = PlacementProblem(usage=np.ones((2, 1)), options=options, allowed=np.ones((2, 1, 2), dtype=bool),
                                   vram_budget=0, ram_budget=3, sync_seconds=np.zeros(2), quality_weight=1.0,
                                   layer_errors=errors)
        choice = solve_placement(problem).choice
        assert choice[bad_layer, 0] == 0 and choice[1 - bad_layer, 0] == 1


def test_plan_and_compile_measure_on_a_calibration_text(demo_model, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("Experts live on the GPU or the CPU; the router picks a few for every token. " * 30)
    result = CliRunner().invoke(main, ["plan", demo_model, "--vram", "16MiB", "--reserve", "0", "--gpu-schemes",
                                       "bf16,int8", "--cpu-schemes", "int8,q4_0", "--quality-weight", "0.001",
                                       "--calibration-text", str(text)])
    assert result.exit_code == 0, result.output
    assert "measured on the calibration text's activations" in result.output
    out = json.loads(CliRunner().invoke(main, ["plan", demo_model, "--vram", "16MiB", "--reserve", "0",
                                               "--calibration-text", str(text), "--json"]).output)
    measured = dict(out["options"]["activation_errors"])
    assert set(measured) == {"bf16", "int8"} and all(len(v) == 4 for v in measured.values())
    compiled = CliRunner().invoke(main, ["compile", demo_model, "-o", str(tmp_path / "m.ktb"), "--cpu-scheme",
                                         "q4_0", "--calibration-text", str(text), "--json"])
    assert compiled.exit_code == 0, compiled.output
    errors = json.loads(compiled.output)["activation_errors"]
    assert set(errors) == {"0", "1", "2", "3"} and all(set(e) == {"q4_0"} and 0 < e["q4_0"] < 0.5
                                                        for e in errors.values())
    gguf = CliRunner().invoke(main, ["compile", str(text), "-o", str(tmp_path / "x.ktb"), "--calibration-text",
                                     str(text)])
    assert gguf.exit_code != 0 and "checkpoint's folder" in gguf.output
