"""The ``ktc`` command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import click

from ktc import __version__, kernels_cached
from ktc.errors import KtcError, Terminated, hold_signal, written_outputs
from ktc.formats.schemes import SCHEMES

EXIT_USER_ERROR = 2


class FiniteFloat(click.FloatRange):
    """A float flag in a range that also refuses nan and inf (click's range lets nan through:
    every comparison with it is false)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


JSON_VERSION = 1


def _print_json(command: str, payload: dict[str, Any]) -> None:
    """One JSON object on stdout, tagged ``"format": "ktc-COMMAND"`` and a version (a payload that
    has its own format, a plan's, keeps it). Sizes are bytes; rates bytes per second, or GB/s
    where the key ends in ``_gbps``."""
    tagged = {"format": f"ktc-{command}", "version": JSON_VERSION}
    tagged.update(payload)
    click.echo(json.dumps(tagged, indent=1))


def _handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Print a ``KtcError`` in a line or two and exit non-zero; let bugs show their traceback.

    SIGTERM (``timeout``, ``kill``, docker) is handled like Ctrl-C: it raises where the command
    is, what it was writing is removed, and the exit status is 128 + 15 as a shell expects."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        written_outputs(clear=True)
        with _sigterm_raises():
            try:
                return func(*args, **kwargs)
            except KtcError as exc:
                click.echo(f"error: {exc}", err=True)
                if kwargs.get("as_json"):  # a script reading stdout gets the error as JSON too
                    _print_json("error", {"error": type(exc).__name__, "message": exc.message,
                                          "path": exc.path, "tensor": exc.tensor, "hint": exc.hint})
                sys.exit(EXIT_USER_ERROR)
            except Terminated as exc:
                done = written_outputs()
                if done:  # stopped after its output was renamed into place: that output is whole
                    click.echo(f"error: stopped by SIGTERM after {', '.join(done)} was written whole "
                               "(ktc verify checks it); nothing half-written was left behind", err=True)
                else:
                    click.echo("error: stopped by SIGTERM; nothing half-written was left behind", err=True)
                sys.exit(128 + exc.signum)

    return wrapper


# Where a SIGTERM must not raise: inside Numba's compiler and llvmlite, an exception raised in a
# ctypes callback is swallowed (the stop was lost: the compile ran on and exited 0), and one
# raised while llvmlite builds an object leaves it half made, its finalizer printing a
# traceback at exit. There the stop is asked for again a little later, until the main thread is
# out of them.
_COMPILER_PATHS = (f"{os.sep}numba{os.sep}", f"{os.sep}llvmlite{os.sep}")
_AGAIN_AFTER = 0.02  # seconds


def _in_compiler(frame: Any) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMPILER_PATHS):
            return True
        frame = frame.f_back
    return False


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    lock = threading.Lock()
    state = {"handling": True}  # False once the command is done: a stop asked for again is dropped

    def send_again(signum: int) -> None:
        with lock:
            if state["handling"]:
                os.kill(os.getpid(), signum)

    def raise_terminated(signum: int, frame: Any) -> None:
        if not state["handling"] or hold_signal(signum):
            return
        if _in_compiler(frame):
            again = threading.Timer(_AGAIN_AFTER, send_again, (signum,))
            again.daemon = True
            again.start()
            return
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        state["handling"] = False  # before the lock: a signal sent again while it is taken is dropped
        with lock:  # no signal sent again reaches the handler restored here
            signal.signal(signal.SIGTERM, previous)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ktc")
def main() -> None:
    """ktc: plan and compile Mixture-of-Experts models for one GPU plus a big CPU.

    \b
    Examples:
      ktc demo                                      the whole flow on a built-in tiny model
      ktc inspect ./Qwen3-30B-A3B                   what the model is, where its bytes are
      ktc plan ./Qwen3-30B-A3B --vram 24GiB         which experts go on the GPU, and how fast
      ktc compile ./Qwen3-30B-A3B -o q.ktb --vram 24GiB
      ktc verify q.ktb && ktc bench q.ktb           check the bundle, time its CPU experts
      ktc run q.ktb -p "Hello" -n 32                generate text with the whole model
      ktc perplexity q.ktb --text t.txt --reference ./Qwen3-30B-A3B   what the quantization cost
      ktc profile q.ktb --text t.txt -o p.json      routing counts for ktc plan --profile
    """


@main.command()
@click.argument("path", type=click.Path(exists=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--tensors", is_flag=True, help="Also list every tensor with its role, dtype and shape.")
@_handle_errors
def inspect(path: str, as_json: bool, tensors: bool) -> None:
    """Describe a checkpoint: family, layers, experts, bytes by component, KV cost per token.

    PATH is a Hugging Face model folder (safetensors or .bin), a single .safetensors / .bin /
    .pt file with config.json beside it, a .gguf file, or a GGUF split into parts (any part, or
    their folder: every part is read). Only headers are read.

    \b
    Examples:
      ktc inspect ./Mixtral-8x7B-Instruct-v0.1
      ktc inspect ./DeepSeek-V3 --json | jq .bytes
      ktc inspect qwen3-30b-a3b-q8_0.gguf --tensors
      ktc inspect DeepSeek-V3-Q4_K_M-00001-of-00009.gguf
    """
    from ktc.api import load_model
    from ktc.formats.bundle import is_bundle_file
    from ktc.summary import render_text, summarize

    if not os.path.exists(path):
        raise KtcError("no such file or folder", path=path)
    if is_bundle_file(path):
        _inspect_bundle(path, as_json, tensors)
        return
    started = time.perf_counter()
    ir = load_model(path)
    summary = summarize(ir)
    elapsed = time.perf_counter() - started
    if as_json:
        out = summary.to_json()
        out["inspect_seconds"] = round(elapsed, 4)
        if tensors:
            out["tensors"] = _tensor_rows(ir)
        _print_json("inspect", out)
        return
    click.echo(render_text(summary))
    if tensors:
        click.echo("")
        for row in _tensor_rows(ir):
            click.echo(f"  {row['name']:<64} {row['role']:<15} {row['dtype']:<8} {row['shape']}")


def _inspect_bundle(path: str, as_json: bool, tensors: bool) -> None:
    from ktc.formats.bundle import open_bundle
    from ktc.summary import format_bytes

    with open_bundle(path) as b:
        m = b.manifest
        experts = [blk for blk in b.blocks if blk.kind == "expert"]
        schemes: dict[str, int] = {}
        for blk in experts:
            key = f"{blk.segment}:{b.tensors[blk.tensors[0]].scheme}"
            schemes[key] = schemes.get(key, 0) + 1
        out: dict[str, Any] = {
            "format_version": m["format_version"], "file_bytes": b.header.file_size,
            "family": m["model"]["family"], "architecture": m["model"]["architecture"],
            "moe_layers": [layer["layer"] for layer in m["model"]["moe_layers"]],
            "segments": m["segments"], "experts": len(experts),
            "gpu_experts": sum(blk.segment == "device" for blk in experts),
            "cpu_experts": sum(blk.segment == "host" for blk in experts),
            "disk_experts": sum(p.startswith("disk:") for row in (m["plan"].get("placement") or {}).values()
                                for p in row),
            "schemes": schemes, "compressed_experts": sum(bool(blk.compression) for blk in experts),
            "plan": {k: v for k, v in m["plan"].items() if k != "placement"},
            "provenance": m["provenance"],
            "run": _run_summary(b),
        }
        if tensors:
            out["tensors"] = [{"name": t.name, "scheme": t.scheme, "offset": t.offset, "nbytes": t.nbytes,
                               "shape": list(t.shape), "segment": t.segment, "role": t.role}
                              for t in b.tensors.values()]
    if as_json:
        _print_json("inspect", out)
        return
    click.echo(f"{path}  (ktc bundle {out['format_version'][0]}.{out['format_version'][1]}, "
               f"{format_bytes(out['file_bytes'])})")
    click.echo(f"model         {out['family']} ({out['architecture']}), MoE layers "
               f"{out['moe_layers'][0]}-{out['moe_layers'][-1]}")
    disk = f" ({out['disk_experts']} of them kept on disk by the plan)" if out["disk_experts"] else ""
    click.echo(f"experts       {out['gpu_experts']} on the GPU, {out['cpu_experts']} on the CPU{disk}; " +
               ", ".join(f"{k} x{v}" for k, v in sorted(schemes.items())) +
               (f"; {out['compressed_experts']} compressed" if out["compressed_experts"] else ""))
    for seg in out["segments"]:
        click.echo(f"segment       {seg['name']:<7} at {seg['offset']}, {format_bytes(seg['length'])}")
    plan = out["plan"]
    if "predicted_ms_per_token" in plan:
        click.echo(f"plan          {plan['source']}: predicted {plan['predicted_ms_per_token']:.3f} ms/token")
    else:
        click.echo(f"plan          {plan['source']}")
    run_info = out["run"]
    if run_info["runnable"]:
        click.echo(f"run           config from {run_info['origin']}, files {', '.join(run_info['files'])}; "
                   f"KV cache for {run_info['max_tokens']} tokens")
    else:
        click.echo(f"run           cannot run: {run_info['why']}")
    prov = out["provenance"]
    click.echo(f"provenance    ktc {prov['ktc_version']} from {prov['source_format']} "
               f"({', '.join(f['name'] for f in prov['source_files'])})")
    if tensors:
        click.echo("")
        for t in out["tensors"]:
            offset = "compressed" if t["offset"] is None else t["offset"]
            click.echo(f"  {t['name']:<48} {t['scheme']:<10} {str(offset):>12} {t['nbytes']:>12} {t['shape']}")


def _run_summary(bundle: Any) -> dict[str, Any]:
    """Whether ``ktc run`` can run a bundle, and with what."""
    run = bundle.run_info
    if bundle.format_major < 2 or run is None:
        return {"runnable": False, "why": f"format {bundle.format_major}.x bundles carry no config or tokenizer; "
                                          "compile again"}
    if run.get("config") is None or not run.get("files"):
        return {"runnable": False, "why": run.get("missing") or "no config or tokenizer"}
    return {"runnable": True, "origin": run.get("origin"), "files": list(run.get("files", [])),
            "max_tokens": (run.get("workload") or {}).get("max_tokens")}


def _tensor_rows(ir: Any) -> list[dict[str, Any]]:
    rows = []
    for layer in ir.moe_layers:
        for ref in (layer.router, layer.router_bias, layer.score_correction_bias, layer.shared_expert_gate):
            if ref is not None:
                rows.append(("router" if ref is not layer.shared_expert_gate else "shared_experts", ref))
        for expert in layer.shared_experts:
            rows += [("shared_experts", t) for t in expert.tensors]
        seen: set[str] = set()
        for expert in layer.experts:
            for ref in expert.tensors:
                if ref.name not in seen:  # stacked experts share one stored tensor
                    seen.add(ref.name)
                    rows.append(("routed_experts", ref))
    rows += [(d.role.value, d.ref) for d in ir.dense]
    result = []
    for role, ref in sorted(rows, key=lambda r: r[1].name):
        stored = ref.view == ()
        shape = list(ref.shape if stored else ref.stored_shape)
        result.append({"name": ref.name, "role": role, "dtype": ref.dtype, "shape": shape,
                       "offset": ref.location.offset, "file": os.path.basename(ref.location.path)})
    return result


def _request(ctx: Any, param: Any, value: str | None) -> tuple[int, int] | None:
    """``--request PROMPT:NEW`` as (prompt tokens, new tokens)."""
    if value is None:
        return None
    prompt, sep, new = value.partition(":")
    try:
        pair = (int(prompt), int(new))
    except ValueError:
        pair = (-1, -1)
    if not sep or min(pair) < 0 or pair[0] == 0:
        raise click.BadParameter(f"{value!r}: give a typical request's prompt and new tokens, e.g. 4000:300")
    return pair


REQUEST_HELP = ("A typical request's prompt and generated tokens, e.g. 4000:300: the planner weighs prefill "
                "against decode and holds VRAM for the prefill offload's copies in place of resident experts "
                "where that makes such a request faster (it needs the CPU's prefill rate: ktc doctor --calibrate).")


def _hardware_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Flags shared by the commands that plan: the target machine and the workload."""
    options = [
        click.option("--vram", help="GPU memory budget, e.g. 24GiB (or give --hardware); 0: no GPU, every "
                     "weight and buffer in RAM (with --disk-bandwidth the experts that do not fit stay on disk)."),
        click.option("--ram", help="CPU memory budget, e.g. 256GiB [default: this machine's RAM]."),
        click.option("--hardware", "hardware", type=click.Path(dir_okay=False),
                     help="Hardware profile JSON (ktc doctor --write-profile); flags override it."),
        click.option("--reserve", help="VRAM kept free for the CUDA context and allocator [default: 1GiB]."),
        click.option("--cpu-bandwidth", help="CPU memory read bandwidth, e.g. 60GB/s [default: 60GB/s]."),
        click.option("--gpu-bandwidth", help="GPU memory bandwidth [default: 900GB/s]."),
        click.option("--pcie-bandwidth", help="PCIe bandwidth [default: 25GB/s]."),
        click.option("--sync-us", type=FiniteFloat(min=0),
                     help="Per-layer CPU/GPU sync cost in microseconds [default: 50]."),
        click.option("--device-step-us", type=FiniteFloat(min=0),
                     help="The runtime's fixed cost of a MoE layer's step with experts on the GPU, in "
                          "microseconds (ktc doctor --calibrate measures it on a CUDA machine); where it "
                          "exceeds what a layer's GPU experts save, they stay on the CPU [default: 0, not modelled]."),
        click.option("--disk-bandwidth",
                     help="Read bandwidth of the disk the bundle will be on, e.g. 3GB/s (ktc doctor measures it): "
                          "where the CPU experts do not fit --ram, the least used stay on disk, read through the "
                          "bundle's map, instead of the plan being refused [default: no disk tier]."),
        click.option("--max-tokens", type=click.IntRange(min=0), default=4096, show_default=True,
                     help="KV cache capacity: total tokens over all sequences."),
        click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Sequences decoded together."),
        click.option("--kv-dtype", default="bf16", show_default=True,
                     type=click.Choice(["bf16", "f16", "f32", "fp8"]), help="KV cache element type."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Tokens per prefill step (sizes the activation workspace)."),
        click.option("--profile", "profile", type=click.Path(dir_okay=False),
                     help="Activation profile: ktc JSON or a KTransformers/SGLang expert "
                          "distribution .pt. Default: uniform routing."),
        click.option("--trace", type=click.Path(dir_okay=False),
                     help="A routing trace (ktc profile --trace FILE): the planner replays it through the device "
                          "expert cache's policy and trades residents for cache slots (0, 1, 2, 4 or 8 a layer, or "
                          "one in a quarter, half or three quarters of the MoE layers) where that predicts a faster "
                          "decode; ktc run keeps the slots the plan chose."),
        click.option("--request", metavar="PROMPT:NEW", callback=_request, help=REQUEST_HELP),
        click.option("--gpu-schemes",
                     help="Comma list of schemes GPU experts may use, e.g. bf16,int8,int4. "
                          "[default: the source's own block type (a GGUF's Q4_K...), passed "
                          "through; bf16 for float sources]"),
        click.option("--cpu-schemes",
                     help="Comma list of schemes CPU experts may use, e.g. int8,int4. "
                          "[default: the source's own block type; int8 for float sources]"),
        click.option("--dense-scheme", default="auto", show_default=True, type=click.Choice(["auto", *SCHEMES]),
                     help="Scheme of non-expert matrices (what ktc compile --dense-scheme stores); auto "
                          "keeps a quantized source's own block types and stores float ones in bf16."),
        click.option("--pin-gpu", multiple=True, metavar="LAYER:EXPERT", help="Keep this expert on the GPU."),
        click.option("--pin-cpu", multiple=True, metavar="LAYER:EXPERT", help="Keep this expert on the CPU."),
        click.option("--quality-weight", type=FiniteFloat(min=0), default=0.0, show_default=True,
                     help="Seconds per step worth one unit of usage-weighted quantization error "
                          "(0: fastest, ties go to the more precise scheme)."),
        click.option("--time-limit", type=FiniteFloat(min=0, min_open=True), default=1.5, show_default=True,
                     help="Seconds the solver may take before it reports its proven gap."),
        click.option("--calibration-text", type=click.Path(exists=True, dir_okay=False),
                     help="Weigh each scheme's error on the hidden states that reach the experts over this "
                          "text (the source checkpoint run through transformers, up to 1024 tokens) "
                          "instead of its nominal error (see --quality-weight)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _plan_from_flags(model: str, kw: dict[str, Any]) -> Any:
    from ktc.api import plan as make_plan
    from ktc.formats.checkpoint import detect_format

    if not os.path.exists(model):
        raise KtcError("no such file or folder", path=model)
    split = lambda text: tuple(s.strip() for s in text.split(",") if s.strip())  # noqa: E731
    source_types = bool(kw.get("export_llamacpp")) and detect_format(model) == "gguf"  # a folder of parts too
    if source_types and (kw["gpu_schemes"] or kw["cpu_schemes"]):
        raise KtcError("--export-llamacpp plans at the GGUF's own types, which llama.cpp loads",
                       hint="drop --gpu-schemes/--cpu-schemes")
    return make_plan(model, vram=kw["vram"], ram=kw["ram"], hardware=kw["hardware"],
                     reserve=kw["reserve"], max_tokens=kw["max_tokens"], batch=kw["batch"],
                     kv_dtype=kw["kv_dtype"], prefill_chunk=kw["prefill_chunk"], profile=kw["profile"],
                     gpu_schemes=split(kw["gpu_schemes"] or "") or None,
                     cpu_schemes=split(kw["cpu_schemes"] or "") or None,
                     dense_scheme=kw["dense_scheme"],
                     pin_gpu=kw["pin_gpu"], pin_cpu=kw["pin_cpu"], quality_weight=kw["quality_weight"],
                     time_limit=kw["time_limit"], cpu_bandwidth=kw["cpu_bandwidth"],
                     gpu_bandwidth=kw["gpu_bandwidth"], pcie_bandwidth=kw["pcie_bandwidth"],
                     sync_us=kw["sync_us"], disk_bandwidth=kw.get("disk_bandwidth"), source_types=source_types,
                     device_step_us=kw.get("device_step_us"),
                     calibration_text=kw.get("calibration_text"), trace=kw.get("trace"), request=kw.get("request"))


@main.command()
@click.argument("model", type=click.Path(exists=False))
@_hardware_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write an HTML heatmap page.")
@click.option("--export-kt", "export_kt_dir", type=click.Path(file_okay=False),
              help="Write KTransformers' gpu_experts_mask.pt and kt_args.json into this folder.")
@click.option("--export-llamacpp", is_flag=True, help="Print llama.cpp -ot rules for the best whole-layer plan.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write plan.json for ktc compile.")
@_handle_errors
def plan(model: str, as_json: bool, html_path: str | None, export_kt_dir: str | None,
         export_llamacpp: bool, output: str | None, **kw: Any) -> None:
    """Plan which experts live on the GPU under a VRAM budget, and predict decode speed.

    Everything in VRAM is counted: non-expert weights, the KV cache for --max-tokens, an
    activation workspace, the reserve, and the GPU experts. The placement is solved exactly
    (or with a proven gap) and compared with KTransformers' and llama.cpp's ways of placing
    experts on the same budget. With --vram 0 the model runs on the CPU alone: everything is in
    RAM, and with --disk-bandwidth the least used experts that do not fit stay on disk.

    \b
    Examples:
      ktc plan ./Qwen3-30B-A3B --vram 24GiB --ram 64GiB --max-tokens 32768
      ktc plan model.gguf --vram 0 --ram 16GiB --disk-bandwidth 2GB/s   # no GPU, RAM short
      ktc plan ./DeepSeek-V3 --vram 80GiB --profile expert_distribution.pt --json
      ktc plan model.gguf --vram 12GiB --export-llamacpp
      ktc plan ./Mixtral-8x7B --vram 24GiB --export-kt kt/ -o plan.json --html plan.html
      ktc plan ./Qwen3-30B-A3B --vram 24GiB --gpu-schemes bf16,int8 --quality-weight 0.001 \\
          --calibration-text sample.txt
      ktc plan ./Qwen3-30B-A3B --hardware calibrated.json --request 4000:300
    """
    from ktc.compile import check_writable_target
    from ktc.plan_report import export_kt, llamacpp_plan, render_plan_html, render_plan_text

    for path in (p for p in (output, html_path) if p):  # before the solve, not after it
        check_writable_target(path)
    result = _plan_from_flags(model, {**kw, "export_llamacpp": export_llamacpp})
    out = result.to_json()
    if html_path:
        _write_text(html_path, render_plan_html(result))
    if output:
        _write_text(output, json.dumps(out, indent=1) + "\n")
    kt_info = export_kt(result, export_kt_dir) if export_kt_dir else None
    cpp = llamacpp_plan(result) if export_llamacpp else None
    if as_json:
        out.pop("placement")
        if kt_info:
            out["export_kt"] = kt_info
        if cpp:
            out["llamacpp"] = {"rules": cpp.rules, "cpu_layers": list(cpp.cpu_layers),
                               "predicted_ms_per_step": cpp.predicted_ms_per_step}
        click.echo(json.dumps(out, indent=1))  # the plan file's own format, "ktc-plan"
        return
    click.echo(render_plan_text(result))
    if kt_info:
        click.echo(f"KTransformers: mask written to {kt_info['gpu_experts_mask']} "
                   f"({kt_info['gpu_experts_total']} GPU experts; the most per layer that fits: "
                   f"--kt-num-gpu-experts {kt_info['kt_num_gpu_experts']})")
        click.echo(f"  for {kt_info['targets']}: {kt_info['sglang_command']}")
    if cpp:
        click.echo(f"llama.cpp: {cpp.rules}")
        if result.hardware.cpu_only:
            click.echo("  no GPU: every layer on the CPU, as ktc's plan" + (
                "; the experts ktc keeps on disk llama.cpp reads through its map as the page cache allows "
                "(not predicted)" if cpp.predicted_ms_per_step is None else ", at the same predicted time"))
        else:
            click.echo(f"  predicted {cpp.predicted_ms_per_step / result.workload.batch:.3f} ms/token with whole "
                       f"layers on one device ({len(cpp.cpu_layers)} layers' experts on the CPU); "
                       f"ktc's per-expert plan is {cpp.predicted_ms_per_step / result.predicted_ms_per_step:.2f}x faster")
    if output:
        click.echo(f"plan written to {output}")
    if html_path:
        click.echo(f"heatmap written to {html_path}")


def _write_text(path: str, text: str) -> None:
    """Write an output file whole or not at all; its folder must exist, as for every output."""
    _write_output(path, lambda f: f.write(text.encode("utf-8")))


def _write_output(path: str, write: Callable[[Any], Any]) -> None:
    """``write`` an output file (opened binary) whole or not at all: a temporary file renamed."""
    from ktc.compile import check_writable_target

    check_writable_target(path)
    try:
        with open(path + ".tmp", "wb") as f:
            write(f)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        raise KtcError(f"cannot write: {exc.strerror}", path=path) from None


def _given_flags(*names: str) -> list[str]:
    """The flags among the parameters ``names`` that were given on the command line or by the
    environment, not left at their defaults."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = []
    for name in names:
        source = ctx.get_parameter_source(name)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            given.append("--" + name.replace("_", "-"))
    return given


@main.command(name="compile")
@click.argument("source", type=click.Path(exists=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The bundle to write (.ktb).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), help="A plan from `ktc plan -o`.")
@click.option("--vram", help="Plan for this VRAM budget first (the planner flags below apply); 0 plans for "
                             "the CPU alone.")
@click.option("--ram", help="RAM budget for the planner [default: this machine's RAM].")
@click.option("--hardware", type=click.Path(dir_okay=False), help="Hardware profile JSON for the planner.")
@click.option("--reserve", help="VRAM reserve for the planner [default: 1GiB].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="KV cache capacity (prompt + generated tokens) the planner keeps room for and "
                   "`ktc run` allocates.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Decode batch for the planner.")
@click.option("--profile", type=click.Path(dir_okay=False), help="Activation profile for the planner.")
@click.option("--cpu-schemes", "--cpu-scheme", "cpu_scheme",
              help="Scheme of CPU experts (int8, int4_g32/64/128, q8_0, q4_0, mxfp4, bf16, ...; "
                   "the K-quants pass through from a GGUF); with a budget, a comma list the planner "
                   "chooses from, as in ktc plan. [default: the source's own block type, passed "
                   "through; int8 for float sources]")
@click.option("--gpu-schemes", "--gpu-scheme", "gpu_scheme",
              help="Scheme(s) of GPU experts, as --cpu-schemes. [default: the source's own block "
                   "type; bf16 for float sources]")
@click.option("--dense-scheme", type=click.Choice(["auto", *SCHEMES]),
              help="Scheme of non-expert matrices (attention, shared experts, lm_head, embeddings); "
                   "a quantized one runs through ktc's kernels on the CPU. Routers and norms stay f32. "
                   "auto keeps a quantized source's own block types (a Q4_K_M GGUF's Q4_K/Q6_K, byte "
                   "for byte) and stores float matrices in bf16. [default: the plan's, else auto]")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="With a budget, as in ktc plan: a routing trace (ktc profile --trace) from which the planner "
                   "chooses device cache slots; the bundle records them and ktc run keeps them.")
@click.option("--request", metavar="PROMPT:NEW", callback=_request, help="With a budget, as in ktc plan. " + REQUEST_HELP)
@click.option("--disk-bandwidth",
              help="With a budget, as in ktc plan: the disk's read bandwidth (e.g. 3GB/s), which lets the least "
                   "used CPU experts stay on disk where they do not fit --ram.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes building experts; each writes its experts into the bundle. "
                   "Pays off on large models (start-up about 1 s); the bytes do not depend on it.")
@click.option("--compress", is_flag=True, help="zstd-compress each expert (random access is kept).")
@click.option("--report-error", is_flag=True, help="Print each expert's relative RMSE and max error.")
@click.option("--calibration-text", type=click.Path(exists=True, dir_okay=False),
              help="Measure each MoE layer's output error on the hidden states that reach its experts over "
                   "this text (the source checkpoint's folder run through transformers, up to 1024 tokens), "
                   "and with a budget let the planner weigh those errors.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Compile tensors holding NaN or Inf (refused by default, naming the tensor).")
@click.option("--hash-sources", is_flag=True,
              help="Record full sha256 of the source files (default: of their first 16 MiB).")
@click.option("--check", is_flag=True, help="Verify each pass's postconditions as it finishes.")
@click.option("--stop-after", type=click.Choice(["detect", "plan", "quantize", "layout"]),
              help="Run the passes up to this one and write nothing (with --dump-after to look).")
@click.option("--dump-after", type=click.Choice(["detect", "plan", "quantize", "layout", "emit"]),
              help="Print what the IR holds after this pass, as JSON, on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_handle_errors
def compile_command(source: str, output: str, plan_path: str | None, vram: str | None, ram: str | None,
                    hardware: str | None, reserve: str | None, max_tokens: int, batch: int,
                    profile: str | None, cpu_scheme: str, gpu_scheme: str, dense_scheme: str | None,
                    trace: str | None, request: tuple[int, int] | None, disk_bandwidth: str | None, jobs: int,
                    compress: bool, report_error: bool, calibration_text: str | None, allow_nonfinite: bool,
                    hash_sources: bool, check: bool, stop_after: str | None, dump_after: str | None,
                    as_json: bool) -> None:
    """Compile a checkpoint into one packed, checksummed, reproducible bundle.

    Experts are placed by --plan, by the planner when a budget is given (--vram or
    --hardware), or all on the CPU. The bundle is written beside OUTPUT and renamed into place
    only when complete: a failure or interruption leaves OUTPUT as it was.

    \b
    Examples:
      ktc compile ./Qwen3-30B-A3B -o qwen.ktb --vram 24GiB --max-tokens 32768
      ktc plan ./DeepSeek-V3 --vram 80GiB -o plan.json && ktc compile ./DeepSeek-V3 --plan plan.json -o ds3.ktb --jobs 2
      ktc compile model.gguf -o cpu-only.ktb --cpu-scheme q8_0 --compress
      ktc compile model.gguf -o tiered.ktb --vram 0 --ram 16GiB --disk-bandwidth 2GB/s
      ktc compile ./Qwen3-30B-A3B -o q.ktb --vram 24GiB --stop-after layout --dump-after layout
    """
    from ktc.compile import check_writable_target, compile_bundle

    if not os.path.exists(source):
        raise KtcError("no such file or folder", path=source)
    check_writable_target(output)
    if plan_path and (vram or hardware):
        raise KtcError("give either --plan or planner flags (--vram/--hardware), not both")
    given = _given_flags("ram", "reserve", "profile", "batch", "max_tokens", "cpu_scheme", "gpu_scheme",
                         "disk_bandwidth", "trace", "request")
    if plan_path and given:
        raise KtcError(f"{', '.join(given)}: the plan file fixes the placement, the schemes and the workload",
                       hint=f"give {given[0].replace('-scheme', '-schemes')} to ktc plan when making the plan")
    if not (plan_path or vram or hardware) and (unused := [f for f in given if f not in (
            "--max-tokens", "--cpu-scheme")]):
        what = "is a planner flag" if len(unused) == 1 else "are planner flags"
        raise KtcError(f"{', '.join(unused)} {what}; the planner runs only when a budget is given",
                       hint="add --vram (e.g. --vram 24GiB) or --hardware FILE, or drop the flag")
    plan_kwargs = None
    if vram or hardware:
        plan_kwargs = {"vram": vram, "ram": ram, "hardware": hardware, "reserve": reserve,
                       "max_tokens": max_tokens, "batch": batch, "profile": profile,
                       "calibration_text": calibration_text, "disk_bandwidth": disk_bandwidth, "trace": trace,
                       "request": request}
    started = time.perf_counter()
    result = compile_bundle(source, output, plan_path=plan_path, plan_kwargs=plan_kwargs,
                            cpu_scheme=cpu_scheme, gpu_scheme=gpu_scheme, dense_scheme=dense_scheme,
                            jobs=jobs, compress=compress, report_error=report_error,
                            hash_sources=hash_sources, progress=not as_json, check=check,
                            stop_after=stop_after, dump_after=dump_after,
                            dump=lambda text: click.echo(text, err=True), max_tokens=max_tokens,
                            allow_nonfinite=allow_nonfinite, calibration_text=calibration_text)
    elapsed = time.perf_counter() - started  # writing the bundle; the sha256 below reads it back
    if result is None:
        message = f"stopped after the {stop_after} pass; nothing written"
        _print_json("compile", {"stopped_after": stop_after}) if as_json else click.echo(message)
        return
    if as_json:
        out = result.to_json()
        out["seconds"] = round(elapsed, 3)
        if result.plan is not None:
            out["plan"] = result.plan.to_json()
        _print_json("compile", out)
        return
    from ktc.summary import format_bytes

    if result.plan is not None:  # what the planner decided, as ktc plan prints it
        from ktc.plan_report import render_plan_text

        click.echo(render_plan_text(result.plan))
    disk = f" ({result.disk_experts} of them on disk)" if result.disk_experts else ""
    click.echo(f"wrote {result.path}: {format_bytes(result.file_bytes)}, {result.gpu_experts} GPU and "
               f"{result.cpu_experts} CPU experts{disk}, from {format_bytes(result.source_bytes)} of source "
               f"in {elapsed:.1f} s ({result.source_bytes / max(elapsed, 1e-9) / 1e6:.0f} MB/s)")
    click.echo(f"sha256 {result.sha256}")
    if result.emit.errors:
        errors = sorted((e for e in result.emit.errors if math.isfinite(e.rel_rmse)), key=lambda e: -e.rel_rmse)
        unmeasured = len(result.emit.errors) - len(errors)
        if unmeasured:
            click.echo(f"quantization error: not measurable for {unmeasured} experts (NaN or Inf weights)")
        mean = sum(e.rel_rmse for e in errors) / max(len(errors), 1)
        click.echo(f"quantization error: mean relative RMSE {mean:.4f}; worst experts:")
        for e in errors[:10]:
            click.echo(f"  layer {e.layer} expert {e.expert}: relative RMSE {e.rel_rmse:.4f}, "
                       f"max error {e.max_abs_error:.4g}")
    if result.activation_errors is not None:
        click.echo("output error on the calibration text's activations (the most chosen experts of each "
                   "layer, relative): " + "; ".join(f"layer {layer} " + ", ".join(f"{s} {v:.4f}" for s, v in e.items())
                                                    for layer, e in result.activation_errors.items()))


@main.command()
@click.argument("bundle", type=click.Path(exists=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_handle_errors
def verify(bundle: str, as_json: bool) -> None:
    """Check a bundle: header, manifest, every checksum and every padding byte.

    Exits 0 when the bundle is sound; otherwise names each damaged tensor and exits non-zero.

    \b
    Example:
      ktc verify qwen.ktb && scp qwen.ktb server:
    """
    from ktc.formats.bundle import open_bundle

    started = time.perf_counter()
    with open_bundle(bundle) as b:
        problems = b.verify()
        blocks = len(b.blocks)
    elapsed = time.perf_counter() - started
    if as_json:
        _print_json("verify", {"ok": not problems, "problems": problems, "blocks": blocks,
                               "seconds": round(elapsed, 3)})
    elif problems:
        for p in problems[:20]:
            click.echo(f"damaged: {p}", err=True)
        if len(problems) > 20:
            click.echo(f"... and {len(problems) - 20} more", err=True)
    else:
        click.echo(f"{bundle}: ok ({blocks} blocks checked in {elapsed:.2f} s)")
    if problems:
        sys.exit(1)


# ktc run's and ktc bench's --no-mmap (formats.bundle.open_bundle(mapped=False))
_NO_MMAP_HELP = ("Read the whole bundle into memory (huge pages where Linux gives them) instead of mapping it: "
                 "where the bundle's cached pages read slowly, the CPU kernels read its weights faster there "
                 "(one-layer models here: 0.99-1.24x, most 1.0-1.06x), at the cost of reading it all first and "
                 "memory of the process's own.")


@main.command()
@click.argument("bundle", type=click.Path(exists=False))
@click.option("--tokens", default="1,16,64", show_default=True, help="Comma list of tokens per step.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for the kernels [default: all cores].")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="Timed steps per token count.")
@click.option("--no-mmap", "no_mmap", is_flag=True,
              help=_NO_MMAP_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@_handle_errors
def bench(bundle: str, tokens: str, threads: int | None, steps: int, no_mmap: bool, as_json: bool) -> None:
    """Run a bundle's MoE layers on random hidden states with real routing, on the CPU kernels.

    Prints the threads used, the read bandwidth measured in the same run (and the plan's), then
    per token count and per layer: ms per step, the weight bytes read per second, that rate as a
    fraction of the measured bandwidth, and the cost model's time for the same bytes, beside the
    plan's. Every expert runs on the CPU kernels here, wherever the plan put it. Warns when other
    processes keep cores busy or the machine reads under half the plan's bandwidth.

    \b
    Example:
      ktc bench qwen.ktb --tokens 1,16,64 --threads 2
    """
    from ktc.runtime.bench import bench_bundle

    try:
        counts = tuple(int(t) for t in tokens.split(",") if t.strip())
    except ValueError:
        raise KtcError(f"--tokens takes a comma list of integers, not {tokens!r}") from None
    if not counts or min(counts) < 1:
        raise KtcError("--tokens needs positive integers")
    result = bench_bundle(bundle, counts, threads, steps, mapped=not no_mmap)
    if as_json:
        _print_json("bench", result)
        return
    planned = result["plan_cpu_bandwidth_gbps"]
    click.echo(f"{bundle}: {result['threads']} threads; read bandwidth measured {result['roofline_gbps']:.1f} GB/s"
               + (f" (the plan assumed {planned:.0f} GB/s)" if planned else ""))
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    for count, fig in result["tokens"].items():
        click.echo(f"  {count:>4} tokens: {fig['ms_per_step']:8.3f} ms/step ({fig['ms_per_token']:.3f} ms/token), "
                   f"weights {fig['weight_gbps']:6.2f} GB/s = {100 * fig['roofline_fraction']:.0f}% of the roofline")
        predicted = fig["predicted_ms_per_step"]
        click.echo(f"        the cost model for these bytes: {fig['roofline_ms_per_step']:.3f} ms at the measured "
                   "bandwidth" + (f", {predicted:.3f} ms at the plan's" if predicted is not None else ""))
        for layer, lf in fig["layers"].items():
            click.echo(f"        layer {layer:>3}: {lf['ms']:8.3f} ms, {lf['weight_gbps']:6.2f} GB/s")


@main.command()
@click.argument("bundle", type=click.Path(exists=False))
@click.option("-p", "--prompt", help="The prompt text.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from this file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template (one user turn).")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens to generate at most (fewer when the model ends its answer).")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="Sampling temperature; 0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="Sample among this many (0: all).")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="Nucleus sampling mass.")
@click.option("--seed", type=int, help="Random seed for sampling (reproducible runs).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="cuda: the plan's device experts, the non-expert weights and the KV cache on the GPU; "
                   "cpu: everything on the CPU; auto: cuda when torch sees one, else cpu.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads [default: all cores].")
@click.option("--ignore-eos", is_flag=True, help="Generate --max-new-tokens tokens even past the end of text.")
@click.option("--hardware", type=click.Path(exists=True, dir_okay=False),
              help="A hardware profile (ktc doctor --calibrate --write-profile FILE): on the CPU, print the "
                   "decode time per token the CPU cost model predicts for this bundle beside the measured.")
@click.option("--cache-slots", type=click.IntRange(min=0),
              help="On a device: this many more device slots per MoE layer for CPU experts, filled on demand "
                   "(a miss runs on the CPU and its expert is copied in for the next use); refused where they "
                   "do not fit the VRAM the plan leaves free [default: the plan's, see ktc plan --trace; "
                   "0 turns them off].")
@click.option("--cache-profile", type=click.Path(exists=True, dir_okay=False),
              help="An activation profile (ktc profile -o FILE): the slots' replacement policy starts from its "
                   "expert frequencies [default: uniform].")
@click.option("--prefetch", is_flag=True,
              help="Pre-gating one MoE layer ahead: the experts the next layer's router picks for this layer's "
                   "input are paged in from the bundle (madvise WILLNEED) and copied into its cache slots. On ktc's "
                   "compiled CPU decode steps the guess is made between layers, from a layer's output.")
@click.option("--prefill-offload/--no-prefill-offload", default=None,
              help="On a device: a prompt chunk of the plan's threshold of tokens or more (32 where it has none) "
                   "copies the CPU experts it uses to the device where the copy beats the CPU's work (the plan's "
                   "PCIe bandwidth against the CPU's time a token, measured on the first chunk), within the VRAM "
                   "the plan leaves free, and frees them after [default: on a device, as the plan says].")
@click.option("--no-mmap", "no_mmap", is_flag=True,
              help=_NO_MMAP_HELP + " Refused for a plan that keeps experts on disk.")
@click.option("--mlock", is_flag=True,
              help="Where the plan keeps experts on disk: lock what it holds in RAM (its CPU experts and the weights "
                   "every step reads) with mlock, as llama.cpp's --mlock, instead of only reading it in "
                   "(MADV_WILLNEED). Under a memory limit here the lock cut decode to a third (docs/runtime.md).")
@click.option("--no-interleave", "no_interleave", is_flag=True,
              help="On the CPU, multiply q4_0, q8_0, mxfp4 and q4_k matrices (attention, output, the experts of "
                   "layers whose experts share one scheme; int8 experts too, whose copies are q8_0's) in the "
                   "bundle's own layout, not from copies made at load with their rows interleaved 16 at a time "
                   "(as llama.cpp's --repack 0): the copies' products are faster; they take the load a copy's "
                   "time, and the map's pages of what they copied are released.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, timings) instead.")
@_handle_errors
def run(bundle: str, prompt: str | None, prompt_file: str | None, chat: bool, max_new_tokens: int,
        temperature: float, top_k: int, top_p: float, seed: int | None, device: str, threads: int | None,
        ignore_eos: bool, hardware: str | None, cache_slots: int | None, cache_profile: str | None,
        prefetch: bool, prefill_offload: bool | None, no_mmap: bool, mlock: bool, no_interleave: bool,
        as_json: bool) -> None:
    """Generate text from a bundle: the whole model, its experts where the plan put them.

    Text streams to stdout as it is generated; the speed follows on stderr: prompt tokens and
    prefill tokens/s, generated tokens and decode tokens/s, time to first token, peak memory
    (and on CUDA the device memory against the plan's figure). A prompt plus --max-new-tokens
    longer than the KV cache the bundle was planned for is refused before anything runs.

    \b
    Examples:
      ktc run qwen.ktb -p "The capital of France is" -n 32
      ktc run qwen.ktb --chat -p "Explain mixture of experts in one line" --temperature 0
      ktc run qwen.ktb --prompt-file long.txt -n 64 --device cuda --json
      ktc run qwen.ktb -p "Once upon a time" --device cuda --cache-slots 4 --cache-profile profile.json
      ktc run cpu.ktb -p "Once upon a time" --no-mmap       # weights read into memory first
      ktc run q4_0.ktb -p "Once upon a time" --no-interleave  # q4_0/q8_0/mxfp4/q4_k (int8 experts') rows as stored
    """
    from ktc.formats.bundle import open_bundle
    from ktc.runtime.generate import Sampling, encode_prompt, generate, peak_device_bytes, peak_rss_bytes
    from ktc.runtime.hf import check_capacity, from_bundle, kv_capacity, load_tokenizer

    if (prompt is None) == (prompt_file is None):
        raise KtcError("give the prompt with -p TEXT or --prompt-file FILE (one of them)")
    if prompt_file is not None:
        prompt = _read_text(prompt_file, "prompt")
    if not os.path.exists(bundle):
        raise KtcError("no such bundle", path=bundle)
    sampling = Sampling(temperature, top_k, top_p, seed)
    target = None if device == "cpu" else device
    if device == "auto":
        import torch

        target = "cuda" if torch.cuda.is_available() else None
    # The prompt is checked against the KV capacity before the model is loaded: a request that
    # cannot run allocates nothing.
    with open_bundle(bundle) as opened:
        tokenizer = load_tokenizer(opened)
        ids = encode_prompt(tokenizer, prompt or "", chat=chat)
        check_capacity(len(ids), max_new_tokens, kv_capacity(opened), bundle)
        planned = _planned_decode(opened.manifest.get("plan"))
        predicted = _cpu_prediction(opened, hardware, len(ids) + max_new_tokens // 2) if target is None else None
        if (cache_slots or prefill_offload) and target is None:
            flag = "--cache-slots" if cache_slots else "--prefill-offload"
            raise KtcError(f"{flag} puts experts in device memory; this run has no device",
                           hint="run with --device cuda on a machine where torch sees a GPU")
        prior = _bundle_profile(opened, cache_profile) if cache_profile else None
    compiling = target is None and not kernels_cached()
    if compiling:  # minutes without a word otherwise
        click.echo(f"compiling ktc's CPU kernels for this machine (the first run after installing or updating ktc: "
                   f"a few minutes; cached in {os.environ['NUMBA_CACHE_DIR']}); this run's speeds include it",
                   err=True)
    loaded_at = time.perf_counter()
    with from_bundle(bundle, device=target, threads=threads, tokenizer=tokenizer, cache_slots=cache_slots,
                     cache_prior=prior, prefetch=prefetch, prefill_offload=prefill_offload,
                     mapped=not no_mmap, interleave=not no_interleave, mlock=mlock) as model:
        load_seconds = time.perf_counter() - loaded_at
        echo = None if as_json else (lambda text: click.echo(text, nl=False))
        result = generate(model, ids, max_new_tokens=max_new_tokens, sampling=sampling, on_text=echo,
                          stop_at_eos=not ignore_eos)
        load_seconds += result.load_seconds  # the compiled decode step's, before the timers
        peak_device = peak_device_bytes(model)
        device_bytes, plan_bytes = model.device_total, model.plan_device_total
        used_threads = model.threads
        decode_steps = "ktc" if model.fast is not None else "transformers"
        slots = max((e.cache.policy.slots for e in model.experts if e.cache is not None), default=0)
        slot_layers = sum(e.cache is not None and e.cache.policy.slots > 0 for e in model.experts)
        cached = _cache_counters(model.experts) if slots else None
        paged = model.prefetcher.asked if model.prefetcher is not None else None
        guessed = model.prefetcher.accuracy if model.prefetcher is not None else None
        unpaged = model.prefetcher.skipped if model.prefetcher is not None else None
        offloaded = dataclasses.asdict(model.offload.counters) if model.offload is not None else None
        if offloaded is not None:
            offloaded["copy_bandwidth"] = model.offload.copy_bandwidth
        model_min_tokens = model.offload.min_tokens if model.offload is not None else 0
        # a decode step's device experts: through the fused kernels or torch's operations
        token_kernels = ({path: sum(e.token_kernels[path] for e in model.experts) for path in ("fused", "torch")}
                         if target is not None else None)
        pinning = None
        if model.pinning is not None:
            pinning = {"method": model.pinning[0], "pinned_bytes": model.pinning[1], "fallback": model.pinning[2]}
        parts = None
        if model.fast is not None and model.fast.steps:
            per_step = 1e3 * model.fast.seconds / model.fast.steps
            parts = {"layers_ms": [round(float(v), 4) for v in per_step[:-1]], "lm_head_ms": float(per_step[-1])}
    out = {"prompt_tokens": result.prompt_tokens, "generated_tokens": result.generated_tokens,
           "text": result.text, "stopped": result.stopped,
           "prefill_tokens_per_s": result.prefill_tokens_per_s,
           "decode_tokens_per_s": result.decode_tokens_per_s, "ttft_s": result.ttft_seconds,
           "load_s": load_seconds, "compiled_kernels": compiling, "peak_rss_bytes": peak_rss_bytes(),
           "threads": used_threads, "device": "cpu" if target is None else target, "device_bytes": device_bytes,
           "peak_device_bytes": peak_device, "plan_device_bytes": plan_bytes, "decode_steps": decode_steps,
           "decode_ms_per_token": 1e3 / result.decode_tokens_per_s if result.decode_tokens_per_s > 0 else None,
           # the plan's prediction for its placement: its GPU experts on a GPU
           "plan_predicted_ms_per_token": planned[0],
           "plan_prediction_applies": planned[0] is not None and (target is not None or planned[1] == 0),
           # measured by part (ktc's decode steps), and the CPU cost model's prediction (--hardware)
           "decode_parts": parts, "cpu_predicted": predicted, "expert_cache": cached,
           "prefetch_paged_bytes": paged, "prefetch_accuracy": guessed,
           "prefetch_guesses_not_paged": unpaged, "prefill_offload": offloaded,
           "disk_tier": pinning, "device_token_kernels": token_kernels}
    if as_json:
        _print_json("run", out)
        return
    click.echo("")
    from ktc.summary import format_bytes

    click.echo(f"prompt {result.prompt_tokens} tokens, {result.prefill_tokens_per_s:.1f} tokens/s; "
               f"generated {len(result.generated_tokens)} tokens, {result.decode_tokens_per_s:.1f} tokens/s; "
               f"first token after {result.ttft_seconds * 1e3:.0f} ms", err=True)
    if out["plan_predicted_ms_per_token"] is not None and out["decode_ms_per_token"] is not None:
        click.echo(f"the plan predicted {out['plan_predicted_ms_per_token']:.3f} ms/token for its placement; measured "
                   f"{out['decode_ms_per_token']:.3f}" + ("" if out["plan_prediction_applies"] else
                                                          f" (its {planned[1]} GPU experts ran on the CPU here)"),
                   err=True)
    if predicted is not None and out["decode_ms_per_token"] is not None:
        click.echo(f"the CPU cost model predicted {predicted['ms_per_token']:.3f} ms/token "
                   f"({'calibrated' if predicted['calibrated'] else 'not calibrated: no per-scheme rates'}, "
                   f"{hardware}); measured {out['decode_ms_per_token']:.3f}", err=True)
    memory = f"peak RSS {format_bytes(out['peak_rss_bytes'])}; {used_threads} CPU thread{'s' if used_threads > 1 else ''}"
    memory += f"; decode steps by {'ktc' if decode_steps == 'ktc' else 'transformers'}"
    if threads is None and used_threads < (os.cpu_count() or 1):
        memory += " (other processes keep the other cores busy: results slow down under such load)"
    if target is not None:
        shown = peak_device if peak_device is not None else device_bytes
        memory += f"; device {format_bytes(shown)}" + (f" of the plan's {format_bytes(plan_bytes)}" if plan_bytes else "")
    click.echo(memory, err=True)
    if token_kernels is not None and sum(token_kernels.values()):
        click.echo(f"device experts of one-token forwards: {token_kernels['fused']} layer stacks through ktc's fused "
                   f"kernels, {token_kernels['torch']} through torch's operations"
                   + ("" if token_kernels["fused"] else " (the fused kernels need Triton and CUDA: ktc doctor)"),
                   err=True)
    if cached is not None:
        every = slot_layers == len(model.experts)
        where = "a layer" if every else f"a layer in {slot_layers} of the {len(model.experts)} MoE layers"
        click.echo(f"expert cache: {slots} slot{'s' * (slots != 1)} {where} ({format_bytes(cached['device_bytes'])}); "
                   f"{cached['hits']} hits, {cached['misses']} misses ({cached['late']} while their copy was on its "
                   f"way), hit rate {100 * cached['hit_rate']:.1f}% of {cached['uses']} uses"
                   f"{'' if every else ' in those layers'}; {cached['uploads']} "
                   f"copies ({format_bytes(cached['bytes_uploaded'])}), {cached['evictions']} evictions", err=True)
        if prefetch:
            share = cached["guess_used"] / cached["guessed"] if cached["guessed"] else 0.0
            click.echo(f"pre-gating: {cached['prefetched']} of the copies started a layer ahead; "
                       f"{100 * share:.1f}% of {cached['guessed']} guessed experts were used", err=True)
    if paged is not None:
        named = "" if guessed is None else f"; the guesses named {100 * guessed:.1f}% of the experts then used"
        held = (f"; {unpaged} guesses not paged in (their layer's guessed disk experts used under half the time)"
                if unpaged else "")
        click.echo(f"prefetch: {format_bytes(paged)} of experts paged in a layer ahead{named}{held}", err=True)
    if pinning is not None:
        how = ("locked by mlock" if pinning["method"] == "mlock" else
               f"read in (MADV_WILLNEED: {pinning['fallback']})" if pinning["fallback"] else
               "read in (MADV_WILLNEED; --mlock locks them)")
        ahead = ("the disk experts paged in a layer ahead by pre-gating" if paged is not None else
                 "the disk experts read as used (all in the first MoE layer, which no layer guesses)")
        click.echo(f"disk tier: the plan's RAM experts and weights ({format_bytes(pinning['pinned_bytes'])}) {how}; "
                   f"{ahead}", err=True)
    if offloaded is not None:
        click.echo(f"prefill offload: {offloaded['offloaded']} of {offloaded['forwards']} layer forwards of "
                   f"{model_min_tokens} tokens or more ran {offloaded['experts']} experts on the device, "
                   f"{offloaded['ahead_used']} of them copied a layer ahead ({offloaded['ahead']} started so); "
                   f"{format_bytes(offloaded['bytes_uploaded'])} copied"
                   + (f" at {offloaded['copy_bandwidth'] / 1e9:.1f} GB/s measured" if offloaded["copies_measured"]
                      else ""), err=True)


def _cache_counters(experts: list[Any]) -> dict[str, Any]:
    """The expert cache's counters over every MoE layer (uses of the plan's device experts count
    as hits; a use is one expert in one forward of one layer)."""
    caches = [e.cache for e in experts if e.cache is not None]
    total = {name: sum(getattr(c.counters, name) for c in caches)
             for name in ("hits", "misses", "late", "uploads", "evictions", "bytes_uploaded", "prefetched",
                          "guessed", "guess_used")}
    uses = total["hits"] + total["misses"]
    return {**total, "uses": uses, "hit_rate": total["hits"] / uses if uses else 0.0,
            "device_bytes": sum(c.nbytes for c in caches)}


def _bundle_profile(opened: Any, path: str) -> Any:
    """The activation profile at ``path``, checked against the bundle's model."""
    from ktc.formats.activation_profile import load_activation_profile

    model = opened.manifest["model"]
    infos = model["moe_layers"]
    return load_activation_profile(path, moe_layers=tuple(int(i["layer"]) for i in infos),
                                   num_layers=int(model["config"]["num_layers"]),
                                   num_experts=int(infos[0]["num_experts"]))


def _forward_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--batch and --threads of the commands that run text through a bundle's model."""
    func = click.option("--threads", type=click.IntRange(min=1), help="CPU threads [default: all cores].")(func)
    return click.option("--batch", type=click.IntRange(min=1),
                        help="Tokens a forward pass [default: the bundle's prefill chunk].")(func)


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise KtcError(f"cannot read the {what}: {exc}", path=path) from None


@main.command()
@click.argument("bundle", type=click.Path(exists=False))
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False),
              help="The text to score (UTF-8).")
@click.option("--ctx", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens a window; the second half of each is scored.")
@click.option("--chunks", type=click.IntRange(min=1), help="Score at most this many windows (the first ones).")
@click.option("--reference", type=click.Path(exists=False),
              help="Compare with this model's token distributions: another bundle, or a checkpoint folder "
                   "transformers loads (run in float32).")
@click.option("--logits", "logits_file", type=click.Path(dir_okay=False),
              help="Compare with log-probabilities saved by --save-logits (the reference computed once).")
@click.option("--save-logits", type=click.Path(dir_okay=False),
              help="Save this model's log-probabilities, for --logits in later runs (4 bytes per vocabulary "
                   "entry and scored token).")
@_forward_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@_handle_errors
def perplexity(bundle: str, text_file: str, ctx: int, batch: int | None, chunks: int | None, reference: str | None,
               logits_file: str | None, save_logits: str | None, threads: int | None, as_json: bool) -> None:
    """Perplexity of a bundle's model over a text, and its KL divergence from a reference.

    Computed as llama-perplexity computes it, so the two compare on the same text and tokenizer:
    the text is tokenized once and cut into non-overlapping windows of --ctx tokens (the last
    partial one dropped; where the tokenizer starts texts with BOS, each window's first token is
    BOS); each window runs from an empty KV cache and only its second half is scored (the logits
    at positions ctx/2 .. ctx-2 against the next tokens). PPL = exp(mean negative log-likelihood)
    +/- its standard error.

    With --reference or --logits, on the same positions: the KL divergence from the reference's
    distribution (mean +/- error, median, 99th percentile, maximum), how often both models' most
    likely tokens agree, and the RMS of the change of the correct token's probability, as
    llama-perplexity --kl-divergence reports them. The reference's perplexity is printed too.

    \b
    Examples:
      ktc perplexity q4.ktb --text wiki.test.raw --ctx 512
      ktc perplexity q4.ktb --text wiki.test.raw --reference ./Qwen3-30B-A3B --chunks 20
      ktc perplexity f32.ktb --text wiki.test.raw --save-logits f32.logprobs
      ktc perplexity q4.ktb --text wiki.test.raw --logits f32.logprobs --json
    """
    from ktc.runtime.perplexity import measure

    if not os.path.exists(bundle):
        raise KtcError("no such bundle", path=bundle)
    if reference is not None and not os.path.exists(reference):
        raise KtcError("no such reference model", path=reference)
    if save_logits is not None and logits_file is not None and os.path.abspath(save_logits) == os.path.abspath(logits_file):
        raise KtcError("--save-logits would write over the --logits file it reads", path=save_logits)
    text = _read_text(text_file, "text")
    result = measure(bundle, text, ctx=ctx, batch=batch, threads=threads, max_windows=chunks, reference=reference,
                     logits=logits_file, save_logits=save_logits, progress=not as_json)
    result["text"] = text_file
    if as_json:
        _print_json("perplexity", result)
        return
    click.echo(f"{bundle}: {result['windows']} windows of {ctx} tokens, {result['scored_per_window']} scored in "
               f"each (the second half), {result['tokens']} tokens scored of the text's {result['text_tokens']}")
    click.echo(f"PPL = {result['perplexity']:.4f} +/- {result['perplexity_error']:.5f}")
    ref = result.get("reference")
    if ref is not None:
        click.echo(f"against {ref['source']}: reference PPL = {ref['perplexity']:.4f} +/- "
                   f"{ref['perplexity_error']:.5f}")
        click.echo(f"  KLD: mean {ref['kld_mean']:.4g} +/- {ref['kld_mean_error']:.2g}, median "
                   f"{ref['kld_median']:.4g}, 99% {ref['kld_p99']:.4g}, max {ref['kld_max']:.4g}")
        click.echo(f"  same top token: {100 * ref['top1_agreement']:.2f} +/- {100 * ref['top1_agreement_error']:.2f} %;"
                   f" RMS change of the correct token's probability: {100 * ref['rms_delta_p']:.3f} +/- "
                   f"{100 * ref['rms_delta_p_error']:.3f} %")
    if save_logits is not None:
        click.echo(f"log-probabilities saved to {save_logits}")


@main.command()
@click.argument("bundle", type=click.Path(exists=False))
@click.option("--text", "text_file", type=click.Path(dir_okay=False),
              help="A text to run through the model (UTF-8), cut into sequences of --ctx tokens.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help="Prompts to run instead, one per line (each its own sequence).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the profile (JSON, for ktc plan --profile).")
@click.option("--ctx", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens a sequence at most (each from an empty KV cache).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False),
              help="Also write the routing token by token (NumPy .npy, int64 [tokens, MoE layers, top k]), "
                   "for ktc plan --trace and benchmarks/stream.py --trace.")
@_forward_options
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@_handle_errors
def profile(bundle: str, text_file: str | None, prompts_file: str | None, output: str, ctx: int,
            trace_file: str | None, batch: int | None, threads: int | None, as_json: bool) -> None:
    """Record how often each MoE layer's router chooses each expert on your text.

    Runs the text through the bundle's model (prefill only, sequences of at most --ctx tokens,
    each from an empty KV cache) and writes per layer and expert the number of times the router
    chose it, in the format ktc plan --profile reads: a plan then puts the experts your text
    uses most on the GPU. Prints per layer how skewed the routing is.

    \b
    Examples:
      ktc profile qwen.ktb --text my-corpus.txt -o profile.json
      ktc profile qwen.ktb --prompts prompts.txt -o profile.json --ctx 2048
      ktc profile qwen.ktb --text my-corpus.txt -o profile.json --trace routes.npy
      ktc plan ./Qwen3-30B-A3B --vram 24GiB --profile profile.json
    """
    import statistics

    from ktc.runtime.profile import record

    if not os.path.exists(bundle):
        raise KtcError("no such bundle", path=bundle)
    if (text_file is None) == (prompts_file is None):
        raise KtcError("give the text to profile with --text FILE or --prompts FILE (one of them)")
    text = _read_text(text_file, "text") if text_file is not None else None
    prompts = _read_text(prompts_file, "prompts").splitlines() if prompts_file is not None else None
    if trace_file is not None:
        from ktc.compile import check_writable_target

        check_writable_target(trace_file)  # before the text runs, not after
    recorded, figures = record(bundle, text=text, prompts=prompts, ctx=ctx, batch=batch, threads=threads,
                               progress=not as_json, source=output, trace=trace_file is not None)
    recorded.save(output)
    figures |= {"bundle": bundle, "output": output}
    if trace_file is not None:
        import numpy as np

        routes = figures.pop("trace")
        _write_output(trace_file, lambda f: np.save(f, routes))
        figures["trace"] = trace_file
    if as_json:
        _print_json("profile", figures)
        return
    shares = figures["top_expert_share"]
    uniform = 1 / figures["num_experts"]
    click.echo(f"{output}: the routing of {figures['tokens']} tokens ({figures['sequences']} sequences) through "
               f"{figures['moe_layers']} MoE layers of {figures['num_experts']} experts (top {figures['top_k']})")
    click.echo(f"  the most chosen expert of a layer takes {100 * min(shares):.1f}-{100 * max(shares):.1f}% of its "
               f"choices (median {100 * statistics.median(shares):.1f}%; {100 * uniform:.1f}% if routing were uniform)")
    pregating = figures["pregating"]
    if pregating:
        click.echo(f"  pre-gating (each MoE layer's router on the previous one's input) named "
                   f"{100 * min(pregating):.1f}-{100 * max(pregating):.1f}% of the experts chosen "
                   f"(median {100 * statistics.median(pregating):.1f}%)")
    click.echo(f"  use it: ktc plan MODEL --profile {output}")
    if trace_file is not None:
        click.echo(f"  the routing token by token: {trace_file} (ktc plan MODEL --trace {trace_file} plans device cache slots from it)")


def _cpu_prediction(bundle: Any, hardware: str | None, context: int) -> dict[str, Any] | None:
    """The CPU decode cost model's prediction for an opened bundle run on the CPU with the
    profile at ``hardware`` (None without one, or where the bundle has GPU experts)."""
    if hardware is None:
        return None
    from ktc.formats.hardware_profile import load_hardware_profile
    from ktc.passes.decode_cost import bundle_decode_cost

    cost = bundle_decode_cost(bundle, load_hardware_profile(hardware, vram_bytes=0), context)
    return None if cost is None else cost.to_json()


def _planned_decode(plan: Any) -> tuple[float | None, int]:
    """(the plan's predicted decode ms per token, its GPU experts) from a bundle's manifest plan
    (no prediction where the bundle was compiled without planning)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("predicted_ms_per_token"), (int, float)):
        return None, 0
    per_layer = plan.get("gpu_experts_per_layer")
    gpu = sum(v for v in per_layer.values() if isinstance(v, int)) if isinstance(per_layer, dict) else 0
    return float(plan["predicted_ms_per_token"]), gpu


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--write-profile", type=click.Path(dir_okay=False),
              help="Write the hardware profile ktc plan and ktc run read (--hardware FILE).")
@click.option("--calibrate", is_flag=True,
              help="Also measure what the CPU decode cost model assumes (a minute or two): ktc's "
                   "kernels' bytes/s at each scheme and the fixed cost of a layer's and a token's "
                   "step; into the profile.")
@click.option("--no-mmap", "no_mmap", is_flag=True,
              help="With --calibrate: the kernels' weights in the process's memory, for ktc run --no-mmap "
                   "(by default read through a file's map, as ktc run reads a bundle).")
@click.option("--disk", "disk_folder", type=click.Path(file_okay=False),
              help="Also measure the read bandwidth of the disk under this folder (where bundles will be; "
                   "writes and reads back a 256 MiB file): ktc plan's disk tier, written into the profile.")
@_handle_errors
def doctor(as_json: bool, write_profile: str | None, calibrate: bool, no_mmap: bool, disk_folder: str | None) -> None:
    """Check this machine: versions, CPU features, cores, RAM, CUDA devices, measured memory
    bandwidth, Numba's threading layer, and what will hurt, with the fix.

    With --calibrate, also time ktc's one-token kernels at every CPU scheme (through the fused
    experts call and a matrix-vector product, over more bytes than the caches hold; q4_0, q8_0,
    mxfp4 and q4_k, and int8's experts, from interleaved copies on a VNNI CPU, as ktc run reads
    them), three
    small probe models (the fixed cost of a decoder layer and of a token beside their bytes,
    and how a token's grows with the vocabulary) and, with CUDA, the GPU's read bandwidth and
    uploads from pinned memory: ktc plan uses the rates, and ktc run --hardware FILE predicts a
    CPU-only bundle's decode time from them (docs/planner.md). Run it on an idle machine.

    \b
    Examples:
      ktc doctor --write-profile hw.json && ktc plan ./model --hardware hw.json
      ktc doctor --calibrate --write-profile hw.json && ktc run q.ktb -p "Hello" --hardware hw.json
      ktc doctor --disk /models --write-profile hw.json && ktc plan ./model --hardware hw.json --ram 32GiB
    """
    if write_profile:
        from ktc.compile import check_writable_target

        check_writable_target(write_profile)  # before the measurement, not after it
    from ktc.runtime.doctor import diagnose

    report = diagnose()
    if calibrate:
        from ktc.calibrate import calibrate as measure
        from ktc.formats.hardware_profile import HardwareProfile

        written = report["hardware_profile"]
        base = HardwareProfile.from_json(written, "ktc doctor", vram_bytes=written.get("vram_bytes", 0))
        profile = measure(base, progress=None if as_json else lambda text: click.echo(f"calibrating {text}",
                                                                                       err=True),
                          mapped=not no_mmap)
        report["hardware_profile"] = {**profile.to_json(), "source": "ktc doctor --calibrate"}
        if "vram_bytes" not in written:
            del report["hardware_profile"]["vram_bytes"]
        from ktc.runtime.doctor import doctor_bandwidth, unsteady_warning

        after = doctor_bandwidth()
        report["read_bandwidth_after_calibration_gbps"] = after / 1e9
        warning = unsteady_warning(report["read_bandwidth_gbps"] * 1e9, after)
        if warning:
            report["warnings"].append(warning)
    if disk_folder is not None:
        from ktc.runtime.doctor import disk_read_bandwidth

        disk = disk_read_bandwidth(disk_folder)
        report["disk_read_gbps"] = disk / 1e9
        report["hardware_profile"]["disk_bandwidth"] = disk
    if write_profile:
        _write_text(write_profile, json.dumps(report["hardware_profile"], indent=1) + "\n")
    if as_json:
        _print_json("doctor", report)
        return
    for key in ("python", "ktc", "numpy", "torch", "numba", "triton"):
        click.echo(f"{key:<14}{report['versions'][key]}")
    cpu = report["cpu"]
    click.echo(f"{'cpu':<14}{cpu['model']}, {cpu['cores']} cores; " +
               ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items()))
    click.echo(f"{'ram':<14}{report['ram_bytes'] / 2**30:.1f} GiB")
    click.echo(f"{'cuda':<14}" + (", ".join(f"{d['name']} {d['memory_bytes'] / 2**30:.0f} GiB" for d in report["cuda"])
                                  or "no CUDA device"))
    after = report.get("read_bandwidth_after_calibration_gbps")
    click.echo(f"{'bandwidth':<14}{report['read_bandwidth_gbps']:.1f} GB/s read, measured"
               + (f"; {after:.1f} after the calibration" if after is not None else ""))
    if disk_folder is not None:
        click.echo(f"{'disk':<14}{report['disk_read_gbps']:.2f} GB/s read under {disk_folder}, measured "
                   "(the disk tier's rate in the profile)")
    click.echo(f"{'numba threads':<14}{report['numba']['threads']} ({report['numba']['threading_layer']})")
    click.echo(f"{'kernels':<14}{report['kernels']['description']}")
    if calibrate:
        hw = report["hardware_profile"]
        for path in ("experts", "matrix"):
            rates = hw["cpu_scheme_bandwidth"][path]
            click.echo(f"{path + ' GB/s':<14}" + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items()))
        if report["cuda"]:
            click.echo(f"{'gpu':<14}{hw['gpu_bandwidth'] / 1e9:.0f} GB/s read by a bf16 matrix-vector product, "
                       f"{hw['pcie_bandwidth'] / 1e9:.1f} GB/s uploads from pinned memory; a layer's step with "
                       f"experts on the GPU {hw.get('device_step_seconds', 0.0) * 1e6:.0f} us more than on the CPU "
                       "alone")
        click.echo(f"{'fixed':<14}{hw['cpu_layer_seconds'] * 1e6:.0f} us a layer, "
                   f"{hw['cpu_token_seconds'] * 1e6:.0f} us a token and {hw['cpu_vocab_seconds'] * 1e11:.1f} us more "
                   "a token for each 100k words of the vocabulary, beside their bytes")
        prefill = hw.get("cpu_prefill_ops", 0.0)
        click.echo(f"{'prefill':<14}" + (f"{prefill / 1e9:.0f} GOP/s through the batched expert products (the prefill "
                                         "offload's threshold)" if prefill else
                                         "no batched kernel for q8_0 here: the prefill offload keeps 32 tokens"))
    for warning in report["warnings"]:
        click.echo(f"warning: {warning}")
    if write_profile:
        click.echo(f"hardware profile written to {write_profile}")


@main.command()
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the demo checkpoint (default: the ktc cache folder).")
@click.option("--vram", default="16MiB", show_default=True,
              help="VRAM budget to plan the demo for (its experts take 12 MiB at bf16).")
@click.option("--json", "as_json", is_flag=True, help="Print the inspection and plan as JSON.")
@_handle_errors
def demo(out: str | None, vram: str, as_json: bool) -> None:
    """Build the built-in demo MoE model (Qwen3-MoE layout) and run the loop a user runs.

    The demo model has 4 layers of 16 experts (top-4) and a byte-level BPE tokenizer; with
    transformers installed it is trained first (about a minute on two cores, once: the weights
    are cached) on a snapshot of ktc's own documentation, so that its text is words and its
    routing skewed. Then: inspect it; plan it for a tiny GPU with uniform routing; compile,
    verify and time the bundle (ktc bench); generate text (ktc run); record the routing on
    held-out text (ktc profile); plan again with that profile (the predicted gain over the
    uniform plan) and compile again; score the bundle's quantization against the f32 checkpoint
    on the held-out text (ktc perplexity --reference).

    \b
    Example:
      ktc demo --out ./demo-model --vram 16MiB
    """
    from ktc.api import load_model
    from ktc.api import plan as make_plan
    from ktc.compile import compile_bundle
    from ktc.demo import default_cache_dir, write_demo_model
    from ktc.formats.bundle import open_bundle
    from ktc.plan_report import render_plan_text
    from ktc.summary import format_bytes, render_text, summarize

    say = (lambda text="": None) if as_json else click.echo
    folder = out or os.path.join(default_cache_dir(), "demo-model")
    trained = True
    try:
        try:
            write_demo_model(folder, trained=True, progress=not as_json)
        except KtcError:  # transformers not installed: random weights, and no whole-model steps
            trained = False
            write_demo_model(folder)
    except OSError as exc:
        raise KtcError(f"cannot write the demo model: {exc.strerror}", path=folder) from None
    ir = load_model(folder)
    summary = summarize(ir)
    say(f"demo model written to {folder}" + ("" if trained else " (random weights: transformers is not installed)"))
    say("")
    say(render_text(summary))

    def plan_and_compile(profile: str | None, name: str) -> tuple[Any, Any, str]:
        planned = make_plan(ir, vram=vram, ram="1GiB", reserve=0, max_tokens=4096, profile=profile)
        plan_path = os.path.join(folder, f"{name}-plan.json")
        bundle_path = os.path.join(folder, f"{name}.ktb")
        _write_text(plan_path, json.dumps(planned.to_json(), indent=1) + "\n")
        say(f"\n$ ktc plan {folder} --vram {vram} --ram 1GiB --reserve 0"
            + (f" --profile {profile}" if profile else "") + f" -o {plan_path}")
        say(render_plan_text(planned))
        compiled = compile_bundle(folder, bundle_path, plan_path=plan_path, cpu_scheme="int8")
        with open_bundle(bundle_path) as bundle:
            problems = bundle.verify()
        if problems:
            raise KtcError("the demo bundle failed verification: " + problems[0], path=bundle_path)
        say(f"\n$ ktc compile {folder} --plan {plan_path} -o {bundle_path} && ktc verify {bundle_path}")
        say(f"wrote {bundle_path}: {format_bytes(compiled.file_bytes)}, {compiled.gpu_experts} GPU experts (bf16) "
            f"and {compiled.cpu_experts} CPU experts (int8); verified, sha256 {compiled.sha256[:16]}…")
        return planned, compiled, bundle_path

    result, compiled, bundle_path = plan_and_compile(None, "demo")
    from ktc.runtime.bench import bench_bundle

    if not kernels_cached():  # the bench compiles them: minutes without a word otherwise
        say("\n(compiling ktc's CPU kernels for this machine first: a few minutes, once after installing or "
            "updating ktc)")
    ran = bench_bundle(bundle_path, tokens=(1, 16), steps=3)
    say(f"\n$ ktc bench {bundle_path} --tokens 1,16")
    for count, figures in ran["tokens"].items():
        say(f"{count:>2} tokens: {figures['ms_per_step']:.3f} ms per step through the {len(figures['layers'])} MoE "
            f"layers (every expert on the CPU kernels; the cost model gives {figures['roofline_ms_per_step']:.3f} ms "
            f"for these bytes at the {ran['roofline_gbps']:.0f} GB/s measured, {figures['weight_gbps']:.1f} GB/s "
            "reached)")
    report: dict[str, Any] = {**summary.to_json(), "trained": trained, "plan": _plan_json(result),
                              "bundle": compiled.to_json(), "bench": ran}
    if trained:
        report |= _demo_loop(folder, ir, bundle_path, result, plan_and_compile, say, as_json)
    else:
        say("\n(skipped ktc run, ktc profile and ktc perplexity: they need transformers, pip install 'ktc[hf]')")
    if as_json:
        _print_json("demo", report)


def _plan_json(result: Any) -> dict[str, Any]:
    out = result.to_json()
    out.pop("placement")
    return out


def _demo_loop(folder: str, ir: Any, bundle_path: str, uniform: Any, plan_and_compile: Callable[..., Any],
               say: Callable[..., None], as_json: bool) -> dict[str, Any]:
    """The demo's run, profile, replan and perplexity steps on the trained model."""
    import numpy as np

    from ktc.demo import demo_corpus
    from ktc.api import plan as make_plan
    from ktc.passes.planner import placement_ms_per_token
    from ktc.plan_report import cache_lines
    from ktc.runtime.perplexity import measure
    from ktc.summary import format_bytes
    from ktc.runtime.profile import record

    prompt = "A compiler for such models"
    generated = _demo_generate(bundle_path, prompt, None if as_json else (lambda t: click.echo(t, nl=False)),
                               announce=lambda: say(f"\n$ ktc run {bundle_path} -p \"{prompt}\" -n 48 --seed 0"))
    say(f"\n[prompt {generated['prompt_tokens']} tokens, {generated['prefill_tokens_per_s']:.0f} tokens/s; "
        f"generated {len(generated['generated_tokens'])} tokens, {generated['decode_tokens_per_s']:.0f} "
        f"tokens/s; first token after {generated['ttft_s'] * 1e3:.0f} ms]")
    text = demo_corpus()[1]
    held_out = os.path.join(folder, "held-out.txt")
    _write_text(held_out, text)
    profile_path = os.path.join(folder, "demo-profile.json")
    trace_path = os.path.join(folder, "demo-routes.npy")
    recorded, figures = record(bundle_path, text=text, ctx=256, source=profile_path, trace=True)
    recorded.save(profile_path)
    _write_output(trace_path, lambda f: np.save(f, figures.pop("trace")))
    figures["trace"] = trace_path
    shares = figures["top_expert_share"]
    say(f"\n$ ktc profile {bundle_path} --text {held_out} -o {profile_path} --ctx 256 --trace {trace_path}")
    say(f"the routing of {figures['tokens']} held-out tokens: the most chosen expert of a layer takes "
        f"{100 * min(shares):.0f}-{100 * max(shares):.0f}% of its choices ({100 / figures['num_experts']:.1f}% if "
        "routing were uniform)")
    profiled, _, profiled_path = plan_and_compile(profile_path, "demo-profiled")
    # both placements under the measured routing: what planning with the profile gained
    before = placement_ms_per_token(ir, profiled, uniform.placement)
    after = profiled.predicted_ms_per_token
    say(f"under the measured routing: the uniform plan's placement {before:.4f} ms/token, the profile's "
        f"{after:.4f} ms/token ({before / after:.2f}x predicted)")
    # the trace replayed: what device cache slots would add on a GPU (ktc run keeps the slots a
    # bundle compiled from this plan records; this CPU-only demo runs without them)
    streamed = make_plan(ir, vram=uniform.hardware.vram_bytes, ram="1GiB", reserve=0, max_tokens=4096,
                         profile=profile_path, trace=trace_path)
    say(f"\n$ ktc plan {folder} --vram {format_bytes(uniform.hardware.vram_bytes).replace(' ', '')} --ram 1GiB "
        f"--reserve 0 --profile {profile_path} --trace {trace_path}")
    say("\n".join(cache_lines(streamed)))
    scored = measure(profiled_path, text, ctx=128, reference=folder)
    ref = scored["reference"]
    say(f"\n$ ktc perplexity {profiled_path} --text {held_out} --ctx 128 --reference {folder}")
    say(f"PPL = {scored['perplexity']:.3f} +/- {scored['perplexity_error']:.3f} (the f32 checkpoint: "
        f"{ref['perplexity']:.3f}); KLD mean {ref['kld_mean']:.5f}, 99% {ref['kld_p99']:.5f}; same top token "
        f"{100 * ref['top1_agreement']:.1f}% ({scored['tokens']} tokens scored)")
    return {"run": generated, "profile": figures, "profiled_plan": _plan_json(profiled),
            "streaming_plan": _plan_json(streamed)["streaming"],
            "uniform_placement_ms_per_token_measured_routing": before, "perplexity": scored}


def _demo_generate(bundle_path: str, prompt: str, echo: Callable[[str], None] | None,
                   announce: Callable[[], None] | None) -> dict[str, Any]:
    """``ktc run`` on the demo bundle: 48 tokens sampled with seed 0."""
    from ktc.runtime.generate import Sampling, encode_prompt, generate
    from ktc.runtime.hf import from_bundle

    with from_bundle(bundle_path) as model:
        ids = encode_prompt(model, prompt)
        # untimed first: the kernels' first calls compile them (once, cached) on a new install
        generate(model, ids, max_new_tokens=2, sampling=Sampling(seed=0), stop_at_eos=False)
        if announce is not None:
            announce()
            if echo is not None:
                echo(prompt)
        out = generate(model, ids, max_new_tokens=48, sampling=Sampling(seed=0), on_text=echo)
    return {"prompt": prompt, "prompt_tokens": out.prompt_tokens, "generated_tokens": out.generated_tokens,
            "text": out.text, "prefill_tokens_per_s": out.prefill_tokens_per_s,
            "decode_tokens_per_s": out.decode_tokens_per_s, "ttft_s": out.ttft_seconds}


if __name__ == "__main__":  # pragma: no cover
    main()
