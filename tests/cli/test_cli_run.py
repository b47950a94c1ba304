"""``ktc run``: text and speed from a bundle, and each bad input as a one- or two-line error."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from click.testing import CliRunner

import model_factory as mf
from ktc.cli import main
from ktc.compile import compile_bundle
from ktc.formats.bundle import open_bundle


@pytest.fixture(scope="module")
def bundle(demo_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("run") / "demo.ktb")
    compile_bundle(demo_model, path, max_tokens=256)
    return path


def run(*args: str):
    return CliRunner(mix_stderr=False).invoke(main, ["run", *args]) if _mix_stderr_supported() else \
        CliRunner().invoke(main, ["run", *args])


def _mix_stderr_supported() -> bool:
    import inspect

    return "mix_stderr" in inspect.signature(CliRunner.__init__).parameters


def test_streams_text_then_speed(bundle):
    result = run(bundle, "-p", "A Mixture-of-Experts model", "-n", "12", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()  # the generated text
    for words in ("prompt", "tokens/s", "generated 12 tokens", "first token", "peak RSS"):
        assert words in result.stderr


def test_json_reports_tokens_text_and_timings(bundle):
    result = run(bundle, "-p", "A Mixture-of-Experts model", "-n", "8", "--temperature", "0", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["generated_tokens"]) == 8 and isinstance(out["text"], str)
    assert out["prompt_tokens"] > 0 and out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["ttft_s"] > 0 and out["peak_rss_bytes"] > 0
    assert out["device_bytes"] == 0 and out["plan_device_bytes"] == 0  # CPU only
    assert out["device_token_kernels"] is None  # no device experts to count
    assert out["decode_steps"] == "ktc"  # a Qwen3-MoE model on the CPU: ktc's own decode steps
    assert out["decode_ms_per_token"] == pytest.approx(1e3 / out["decode_tokens_per_s"])
    assert out["plan_predicted_ms_per_token"] is None and not out["plan_prediction_applies"]  # not planned
    again = json.loads(run(bundle, "-p", "A Mixture-of-Experts model", "-n", "8", "--temperature", "0",
                           "--json").stdout)
    assert again["generated_tokens"] == out["generated_tokens"]  # greedy is deterministic
    in_memory = json.loads(run(bundle, "-p", "A Mixture-of-Experts model", "-n", "8", "--temperature", "0",
                               "--json", "--no-mmap").stdout)
    assert in_memory["generated_tokens"] == out["generated_tokens"]  # the bundle read into memory: the same
    seeded = [json.loads(run(bundle, "-p", "Decoding", "-n", "8", "--seed", "3", "--json").stdout)["generated_tokens"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_chat_template_and_prompt_file(bundle, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Explain the key and value cache")
    result = run(bundle, "--prompt-file", str(prompt), "--chat", "-n", "4", "--json")
    assert result.exit_code == 0, result.output
    plain = run(bundle, "--prompt-file", str(prompt), "-n", "4", "--json")
    assert json.loads(result.stdout)["prompt_tokens"] > json.loads(plain.stdout)["prompt_tokens"]


def _older_bundle(path: str, out: str) -> str:
    """The same bundle as a format 1.0 one: no run section in the manifest."""
    def older(manifest):  # type: ignore[no-untyped-def]
        manifest.pop("run")
        manifest["format_version"] = [1, 0]

    return _rewrite_manifest(path, out, older, major=1)


def _first_safetensors(folder: str) -> str:
    return next(os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".safetensors"))


def _gguf_head(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A file that starts as a GGUF file does (the checks read no further)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(200))
    return str(path)


def test_bad_inputs_are_one_or_two_line_errors(bundle, tmp_path, demo_model):
    cases = {
        "empty prompt": (run(bundle, "-p", "  "), "prompt is empty"),
        "no prompt": (run(bundle), "-p TEXT or --prompt-file"),
        "too long": (run(bundle, "-p", "x" * 300, "-n", "8"), "exceeds the KV cache of 256"),
        "older bundle": (run(_older_bundle(bundle, str(tmp_path / "old.ktb")), "-p", "hi"),
                         "compile it again"),
        "missing": (run(str(tmp_path / "none.ktb"), "-p", "hi"), "no such bundle"),
        "a model folder": (run(demo_model, "-p", "hi"), f"compile it first: ktc compile {demo_model}"),
        "a SafeTensors file": (run(_first_safetensors(demo_model), "-p", "hi"), "is a SafeTensors checkpoint"),
        "a GGUF file": (run(_gguf_head(tmp_path), "-p", "hi"), "is a GGUF checkpoint, not a ktc bundle"),
        "cache without a device": (run(bundle, "-p", "hi", "--cache-slots", "2", "--device", "cpu"),
                                   "this run has no device"),
        "offload without a device": (run(bundle, "-p", "hi", "--prefill-offload", "--device", "cpu"),
                                     "--prefill-offload puts experts in device memory"),
    }
    if not torch.cuda.is_available():
        cases["cuda without CUDA"] = (run(bundle, "-p", "hi", "--device", "cuda"), "no CUDA device")
    for name, (result, words) in cases.items():
        assert result.exit_code != 0, name
        message = result.stderr if _mix_stderr_supported() else result.output
        assert words in message, (name, message)
        assert "Traceback" not in message and len(message.strip().splitlines()) <= 2, (name, message)
    for bad in ("0", "-3"):
        result = run(bundle, "-p", "hi", "-n", bad)
        assert result.exit_code == 2 and "max-new-tokens" in (result.stderr or result.output)


def test_older_bundle_still_opens_for_bench_and_inspect(bundle, tmp_path):
    old = _older_bundle(bundle, str(tmp_path / "old.ktb"))
    assert CliRunner().invoke(main, ["inspect", old]).exit_code == 0
    assert CliRunner().invoke(main, ["verify", old]).exit_code == 0
    result = CliRunner().invoke(main, ["bench", old, "--tokens", "1", "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    folder = mf.write_safetensors(mf.build_hf_model("qwen3_moe"), str(tmp_path / "m"))
    mf.write_char_tokenizer(folder, 100)  # the model's vocabulary is 96
    compile_bundle(folder, str(tmp_path / "m.ktb"))
    result = run(str(tmp_path / "m.ktb"), "-p", "hi")
    assert result.exit_code != 0
    assert "100 tokens" in (result.stderr or result.output) and "96" in (result.stderr or result.output)


def test_transformers_older_than_the_experts_interface_is_named(bundle, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    result = run(bundle, "-p", "hi")
    assert result.exit_code != 0
    message = result.stderr or result.output
    assert "4.56.2" in message and "5.7" in message



def test_demo_ends_by_generating_text(tmp_path, monkeypatch):
    import ktc.demo as demo_module

    # its trained weights in a cache of its own, few steps (as test_demo_training's): trained
    # here into the user's cache, they were not the weights ``ktc demo`` trains from a shell (the
    # demo's perplexity 93.4 after make test, 102.1 from an empty cache) and the demo took them
    monkeypatch.setenv("KTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(demo_module.TRAIN, "steps", 30)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["run"]["generated_tokens"]) == 48 and out["run"]["decode_tokens_per_s"] > 0
    text = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo")])
    assert "$ ktc run" in text.stdout and "tokens/s" in text.stdout


def _rewrite_manifest(path: str, out: str, change, major: int = 2) -> str:  # type: ignore[no-untyped-def]
    """The bundle with its manifest changed by ``change`` and its checksums made to match."""
    from ktc.formats.bundle import HEADER_SIZE, BundleHeader, manifest_json

    with open_bundle(path) as b:
        manifest = json.loads(json.dumps(b.manifest))
        header = b.header
    change(manifest)
    raw = bytearray(open(path, "rb").read())
    text = manifest_json(manifest)
    region = text + bytes(header.data_offset - HEADER_SIZE - len(text))
    raw[HEADER_SIZE:header.data_offset] = region
    raw[:HEADER_SIZE] = BundleHeader(HEADER_SIZE, len(text), header.data_offset, header.file_size,
                                     hashlib.sha256(region).digest(), major=major, minor=0).to_bytes()
    open(out, "wb").write(bytes(raw))
    return out


@pytest.mark.parametrize("change", [
    lambda m: m["run"]["workload"].update(max_tokens="many"),
    lambda m: m["run"]["workload"].update(max_tokens=0),
    lambda m: m["run"].update(files=["missing.json"]),
    lambda m: m["run"].update(config=[1, 2]),
])
def test_a_wrong_run_section_is_a_clear_error(bundle, tmp_path, change):
    result = run(_rewrite_manifest(bundle, str(tmp_path / "w.ktb"), change), "-p", "hi")
    message = result.stderr if _mix_stderr_supported() else result.output
    assert result.exit_code != 0 and "Traceback" not in message and "run." in message, message


def test_the_plans_prediction_is_read_from_the_manifest():
    from ktc.cli import _planned_decode

    assert _planned_decode({"predicted_ms_per_token": 0.5, "gpu_experts_per_layer": {"0": 3, "1": 2}}) == (0.5, 5)
    assert _planned_decode({"source": "all experts on the CPU", "placement": {}}) == (None, 0)
    assert _planned_decode(None) == (None, 0)


def test_hardware_profile_adds_the_cpu_prediction_beside_the_measured_parts(bundle, tmp_path):
    from ktc.formats.hardware_profile import HardwareProfile

    rates = {"matrix": {s: 20e9 for s in ("f32", "bf16", "int8", "q8_0")}, "experts": {"int8": 20e9}}
    profile = tmp_path / "hw.json"
    profile.write_text(json.dumps(HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=rates,
                                                  cpu_layer_seconds=5e-5, cpu_token_seconds=2e-5).to_json()))
    result = run(bundle, "-p", "A Mixture-of-Experts model", "-n", "6", "--temperature", "0", "--json",
                 "--hardware", str(profile))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    predicted, parts = out["cpu_predicted"], out["decode_parts"]
    assert predicted["calibrated"] and predicted["layers"] == len(parts["layers_ms"]) == 4
    assert predicted["fixed_ms"] == pytest.approx(4 * 0.05 + 0.02)
    assert predicted["ms_per_token"] > predicted["fixed_ms"] and predicted["bytes_read"] > 0
    assert 0 < sum(parts["layers_ms"]) + parts["lm_head_ms"] <= out["decode_ms_per_token"]
    text = run(bundle, "-p", "A Mixture-of-Experts model", "-n", "4", "--hardware", str(profile))
    assert "the CPU cost model predicted" in text.stderr and "measured" in text.stderr
    assert json.loads(run(bundle, "-p", "x", "-n", "2", "--json").stdout)["cpu_predicted"] is None


def test_prefetch_pages_in_the_guessed_experts(bundle):
    """--prefetch on the CPU: the prompt's forward (and the int8 experts' decode steps) page in
    the experts the next layer's router guesses; the text is the same as without it."""
    args = ["-p", "A Mixture-of-Experts model", "-n", "6", "--temperature", "0", "--json"]
    plain = json.loads(run(bundle, *args).stdout)
    result = run(bundle, *args, "--prefetch")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["generated_tokens"] == plain["generated_tokens"]
    assert plain["prefetch_paged_bytes"] is None and out["prefetch_paged_bytes"] > 0
    assert plain["prefetch_accuracy"] is None and 0.25 < out["prefetch_accuracy"] <= 1.0  # 4 of 16: 0.25 by chance
    assert out["expert_cache"] is None and out["prefill_offload"] is None


def test_no_interleave_reads_the_stored_layout_and_gives_the_same_tokens(tmp_path, monkeypatch):
    """``--no-interleave``: a q4_0 model's matrices read as the bundle stores them instead of
    from interleaved copies (``runtime.interleave``); the same greedy tokens either way."""
    from ktc.runtime import hf

    folder = str(tmp_path / "src")
    mf.write_safetensors(mf.build_hf_model("qwen3_moe", hidden_size=64, moe_intermediate_size=64), folder)
    mf.write_char_tokenizer(folder, 96)
    path = str(tmp_path / "q4_0.ktb")
    compile_bundle(folder, path, cpu_scheme="q4_0", dense_scheme="q4_0")
    seen, real = [], hf.from_bundle

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("interleave"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "from_bundle", spy)
    tokens = []
    for flags in ((), ("--no-interleave",)):
        result = run(path, "-p", "abcab", "-n", "6", "--temperature", "0", "--json", *flags)
        assert result.exit_code == 0, result.output
        tokens.append(json.loads(result.stdout)["generated_tokens"])
    assert seen == [True, False] and tokens[0] == tokens[1]


def test_a_bundle_planned_without_a_gpu_runs_with_its_disk_tier(bundle, demo_model, tmp_path):
    """``ktc compile --vram 0`` plans for the CPU alone; with RAM short and the disk's bandwidth
    given, the least used experts stay on disk, and ``ktc run`` reads the rest in and gives the
    text of the bundle that holds every expert in RAM."""
    tiered = str(tmp_path / "tiered.ktb")
    made = CliRunner().invoke(main, ["compile", demo_model, "-o", tiered, "--vram", "0", "--ram", "8MiB",
                                     "--max-tokens", "256", "--disk-bandwidth", "2GB/s", "--json"])
    assert made.exit_code == 0, made.output
    placement = json.loads(made.stdout[made.stdout.index("{"):])
    assert placement["gpu_experts"] == 0 and placement["cpu_experts"] > placement["disk_experts"] > 0
    with open_bundle(tiered) as made_bundle:
        rows = made_bundle.manifest["plan"]["placement"].values()
        assert sum(p.startswith("disk:") for row in rows for p in row) == placement["disk_experts"]
    inspected = CliRunner().invoke(main, ["inspect", tiered, "--json"])
    assert json.loads(inspected.stdout)["disk_experts"] == placement["disk_experts"]
    args = ["-p", "A Mixture-of-Experts model", "-n", "8", "--temperature", "0", "--json"]
    want, got = run(bundle, *args), run(tiered, *args)
    assert got.exit_code == 0, got.output
    report = json.loads(got.stdout)
    assert report["text"] == json.loads(want.stdout)["text"]
    assert report["disk_tier"]["pinned_bytes"] > 0 and report["prefetch_paged_bytes"] > 0
