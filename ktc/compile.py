"""``ktc compile``: checkpoint (+ plan) -> one ``.ktb`` bundle."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ktc import __version__
from ktc.errors import ConfigError, FormatError, KtcError
from ktc.formats.bundle import FORMAT_MAJOR, FORMAT_MINOR
from ktc.formats.schemes import DENSE_AUTO, dense_scheme_name, expert_scheme_name, expert_schemes
from ktc.ir import Device, ExpertPlacement, ModelIR, Placement
from ktc.passes.emit import BuildOptions, Emit, EmitResult, remove_stale_temporaries
from ktc.passes.layout import ChooseSchemes, LayOut, RunFile
from ktc.passes.plan import KV_DTYPE_BYTES, PLAN_FORMAT, placement_from_json
from ktc.passes.planner import UsePlacement, model_facts

HEAD_HASH_BYTES = 16 * 1024 * 1024
# Plan fields that describe how long solving took: not part of a reproducible bundle.
_TIMING_KEYS = ("solve_seconds", "solver")


@dataclass
class CompileResult:
    path: str
    file_bytes: int
    source_bytes: int
    gpu_experts: int
    cpu_experts: int  # computed on the CPU: in RAM, or on disk (disk_experts of them)
    emit: EmitResult
    plan: Any = None  # the planner's Plan when the compile made one (a budget was given)
    # MoE layer -> {scheme its experts use: output error on the calibration text's activations}
    activation_errors: dict[int, dict[str, float]] | None = None
    disk_experts: int = 0

    @property
    def sha256(self) -> str:
        return self.emit.sha256

    def to_json(self) -> dict[str, Any]:
        out = {"path": self.path, "sha256": self.sha256, "file_bytes": self.file_bytes,
               "source_bytes": self.source_bytes, "gpu_experts": self.gpu_experts,
               "cpu_experts": self.cpu_experts, "disk_experts": self.disk_experts}
        if self.emit.errors:  # an error that could not be measured (NaN/Inf weights) is null
            out["expert_errors"] = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                     for k, v in dataclasses.asdict(e).items()} for e in self.emit.errors]
        if self.activation_errors is not None:
            out["activation_errors"] = {str(k): v for k, v in self.activation_errors.items()}
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def model_section(ir: ModelIR) -> dict[str, Any]:
    """What the runtime needs to run the MoE layers, in the manifest."""
    layers = []
    for layer in ir.moe_layers:
        layers.append({
            "layer": layer.layer, "top_k": layer.top_k, "gating": layer.gating.value,
            "norm_topk_prob": layer.norm_topk_prob, "activation": layer.activation.value,
            "routed_scaling_factor": layer.routed_scaling_factor, "num_groups": layer.num_groups,
            "topk_groups": layer.topk_groups, "num_experts": len(layer.experts),
            "intermediate_size": layer.experts[0].intermediate_size,
            "shared_experts": len(layer.shared_experts),
            "router_bias": layer.router_bias is not None,
            "score_correction_bias": layer.score_correction_bias is not None,
            "shared_expert_gate": layer.shared_expert_gate is not None,
        })
    config = {k: _plain(v) for k, v in dataclasses.asdict(ir.config).items()}
    return {"family": ir.family, "architecture": ir.config.architecture, "config": config,
            "moe_layers": layers}


def _source_files(ir: ModelIR, hash_sources: bool) -> list[dict[str, Any]]:
    files = []
    for path in ir.source.files:
        entry: dict[str, Any] = {"name": os.path.basename(path), "bytes": os.path.getsize(path)}
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            if hash_sources:
                for chunk in iter(lambda: f.read(16 * 1024 * 1024), b""):
                    digest.update(chunk)
                entry["sha256"] = digest.hexdigest()
            else:
                digest.update(f.read(HEAD_HASH_BYTES))
                entry["head_sha256"] = digest.hexdigest()
        files.append(entry)
    return files


def read_plan_file(path: str) -> dict[str, Any]:
    """The JSON object of a plan written by ``ktc plan -o`` (read once; see ``load_plan_file``)."""
    from ktc.formats.json_fields import Fields
    from ktc.formats.tensor_file import read_json

    fields = Fields(read_json(path, "plan file"), path, "plan")
    if fields.string("format", default="") != PLAN_FORMAT:
        raise FormatError(f"not a ktc plan (expected \"format\": \"{PLAN_FORMAT}\")", path=path)
    return fields.data


def load_plan_file(path: str, ir: ModelIR, data: dict[str, Any] | None = None
                   ) -> tuple[Placement, dict[str, Any]]:
    """A plan (``data`` as ``read_plan_file`` gives it, or read from ``path``), checked field by
    field and against the model."""
    from ktc.formats.json_fields import Fields

    data = read_plan_file(path) if data is None else data
    fields = Fields(data, path, "plan")
    if data.get("feasible", True) is not True:
        raise ConfigError("the plan says it does not fit its budget (\"feasible\": false)", path=path,
                          hint="make a plan that fits: ktc plan with a larger --vram or fewer --max-tokens")
    facts = dataclasses.asdict(model_facts(ir))
    recorded = fields.mapping("model", default={})
    mismatched = [k for k in ("family", "num_layers", "num_experts", "hidden_size", "expert_intermediate_size")
                  if recorded.get(k) != facts[k]]
    if recorded.get("moe_layers") != list(facts["moe_layers"]):
        mismatched.append("moe_layers")
    if mismatched:
        detail = ", ".join(f"{k} {recorded.get(k)!r} vs {facts[k]!r}" for k in mismatched[:3])
        raise ConfigError(f"the plan was made for another model ({detail})", path=path,
                          hint="run ktc plan on this checkpoint")
    placement = placement_from_json(data, path)
    if placement.layers != tuple(ir.moe_layer_indices):
        raise ConfigError(f"the plan places layers {list(placement.layers)[:6]}; the model's MoE layers "
                          f"are {list(ir.moe_layer_indices)[:6]}", path=path)
    for layer, row, moe in zip(placement.layers, placement.experts, ir.moe_layers):
        if len(row) != len(moe.experts):
            raise ConfigError(f"the plan places {len(row)} experts in layer {layer}; it has "
                              f"{len(moe.experts)}", path=path)
        for where in row:
            try:
                expert_schemes(where.scheme)
            except KeyError as exc:
                raise ConfigError(str(exc.args[0]), path=path) from None
    if "workload" in fields:
        workload = Fields(fields.mapping("workload"), path, "plan's workload")
        for key in ("max_tokens", "batch", "prefill_chunk"):
            if key in workload:
                workload.integer(key, minimum=1)
        for key in ("prompt_tokens", "new_tokens"):
            if key in workload:
                workload.integer(key, minimum=0)
        if "kv_dtype" in workload:
            workload.string("kv_dtype", choices=KV_DTYPE_BYTES)
    return placement, {k: v for k, v in data.items() if k not in _TIMING_KEYS and k != "placement"}


def get_scheme_checked(name: str) -> str:
    """An expert scheme's canonical name (``expert_scheme_name``), or a ``ConfigError`` that
    lists the known ones."""
    try:
        return expert_scheme_name(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None


def dense_scheme_checked(name: str) -> str:
    """``auto`` or a scheme's canonical name, else a ``ConfigError``."""
    try:
        return dense_scheme_name(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None


def scheme_list(text: str) -> tuple[str, ...]:
    """"int8,int4_g128" -> ("int8", "int4_g128"), each checked."""
    names = tuple(get_scheme_checked(n.strip()) for n in text.split(",") if n.strip())
    if not names:
        raise ConfigError(f"no scheme in {text!r}")
    return names


def plan_dense_scheme(data: dict[str, Any], path: str) -> str | None:
    """The dense scheme a plan (``read_plan_file``) was made for (None where it is not recorded)."""
    from ktc.formats.json_fields import Fields

    options = Fields(Fields(data, path, "plan").mapping("options", default={}), path, "plan's options")
    if "dense_scheme" not in options:
        return None
    return dense_scheme_checked(options.string("dense_scheme"))


def all_on_cpu(ir: ModelIR, scheme: str | None) -> Placement:
    """Every expert on the CPU in ``scheme``; None: each layer's experts in the source's own
    block schemes where it has them (passed through), else int8."""
    from ktc.passes.planner import check_source_allows, default_expert_schemes

    _, _, per_layer = default_expert_schemes(ir)
    names = per_layer if scheme is None and per_layer else (scheme or "int8",) * len(ir.moe_layers)
    for name in set(names):
        for part in expert_schemes(name):
            if "cpu" not in part.devices:
                raise ConfigError(f"scheme {part.name} has no CPU kernels in this ktc", hint="pick another --cpu-scheme")
        check_source_allows(ir, name, every_layer=True)
    return Placement(ir.moe_layer_indices, tuple(
        tuple(ExpertPlacement(Device.CPU, expert_scheme_name(name)) for _ in layer.experts)
        for name, layer in zip(names, ir.moe_layers)))


def compile_bundle(source: str, out: str, *, plan_path: str | None = None,
                   plan_kwargs: dict[str, Any] | None = None, cpu_scheme: str | None = None,
                   gpu_scheme: str | None = None, dense_scheme: str | None = None, jobs: int = 1,
                   compress: bool = False, report_error: bool = False, hash_sources: bool = False,
                   progress: bool = False, check: bool = True, stop_after: str | None = None,
                   dump_after: str | None = None, dump: Callable[[str], None] | None = None,
                   max_tokens: int = 4096, allow_nonfinite: bool = False,
                   calibration_text: str | None = None) -> CompileResult | None:
    """Compile ``source`` into the bundle ``out``.

    The passes detect -> plan -> quantize -> layout -> emit run through ``ktc.pipeline``'s pass
    manager (``check`` verifies each pass's postconditions; ``stop_after`` and ``dump_after`` name
    a pass). The placement comes from ``plan_path`` (a ``ktc plan -o`` file), from the planner
    when ``plan_kwargs`` has a budget (``vram=...``), or puts every expert on the CPU. Nothing is
    left at ``out`` unless the whole bundle was written. Returns None when stopped before emit.

    Every float source tensor is checked for NaN and Inf as it is converted (a ``FormatError``
    naming the tensor) unless ``allow_nonfinite``.

    The bundle also carries what running it needs (``formats.run_files``): the model's config,
    generation config and tokenizer, and the KV capacity to allocate: the plan's ``max_tokens``
    when there is a plan, else ``max_tokens``.
    """
    from ktc.formats.checkpoint import open_checkpoint
    from ktc.formats.run_files import collect_run_files
    from ktc.passes.base import PassContext
    from ktc.passes.detect import DetectExperts
    from ktc.pipeline import PassManager

    if jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    for path, size in remove_stale_temporaries(os.path.dirname(os.path.abspath(out))):
        logging.getLogger("ktc").warning("removed %s (%.1f MiB on disk), left by a compile that was killed",
                                         path, size / 2**20)
    # None: the source's own block type, else int8 / bf16 (``default_expert_schemes``)
    cpu_schemes = scheme_list(cpu_scheme) if cpu_scheme else None
    gpu_schemes = scheme_list(gpu_scheme) if gpu_scheme else None
    plan_data = read_plan_file(plan_path) if plan_path else None
    planned_dense = None if plan_data is None else plan_dense_scheme(plan_data, plan_path or "")
    if planned_dense and dense_scheme and dense_scheme_checked(dense_scheme) != planned_dense:
        raise ConfigError(f"the plan was made for dense scheme {planned_dense}, not {dense_scheme}",
                          path=plan_path, hint="drop --dense-scheme (the plan's is used), or plan again")
    dense_scheme = planned_dense or dense_scheme_checked(dense_scheme or DENSE_AUTO)
    if calibration_text is not None and not os.path.isdir(source):
        raise ConfigError("--calibration-text runs the source model through transformers: give the "
                          "checkpoint's folder", path=source)
    if not (plan_path or plan_kwargs) and cpu_schemes and len(cpu_schemes) > 1:
        raise ConfigError(f"with every expert on the CPU there is one CPU scheme, not {len(cpu_schemes)}",
                          hint="give one, or a budget (--vram) so the planner chooses among them")

    made_plan: list[Any] = []  # the planner's Plan, when it ran

    def decide(ir: ModelIR) -> tuple[Placement, dict[str, Any]]:
        if plan_path:
            placement, plan_info = load_plan_file(plan_path, ir, plan_data)
            section = {"source": "file", **plan_info}
        elif plan_kwargs:
            from ktc.api import plan as make_plan

            made = make_plan(ir, gpu_schemes=gpu_schemes, cpu_schemes=cpu_schemes,
                             dense_scheme=dense_scheme, **plan_kwargs)
            made_plan.append(made)
            placement = made.placement
            section = {"source": "planner", **{k: v for k, v in made.to_json().items()
                                               if k not in _TIMING_KEYS and k != "placement"}}
        else:
            placement = all_on_cpu(ir, cpu_schemes[0] if cpu_schemes else None)
            section = {"source": "all experts on the CPU"}
        section["placement"] = {str(layer): [f"{p.device.value}:{p.scheme}" for p in row]
                                for layer, row in zip(placement.layers, placement.experts)}
        return placement, section

    plan_pass = UsePlacement(decide)

    def manifest_base(ir: ModelIR) -> dict[str, Any]:
        workload = dict(plan_pass.info.get("workload") or {})
        workload.setdefault("max_tokens", max_tokens)
        workload.setdefault("kv_dtype", "bf16")
        workload.setdefault("prefill_chunk", 512)
        workload.setdefault("batch", 1)
        return {
            "format": "ktc-bundle",
            "format_version": [FORMAT_MAJOR, FORMAT_MINOR],
            "model": model_section(ir),
            "plan": plan_pass.info,
            "provenance": {
                "ktc_version": __version__,
                "source_format": ir.source.format,
                "source_files": _source_files(ir, hash_sources),
                "options": {"dense_scheme": dense_scheme, "compress": compress},
            },
            "run": {**run_files.manifest_section(), "workload": workload,
                    "dense_scheme": dense_scheme},
        }

    options = BuildOptions(compress=compress, report_error=report_error, allow_nonfinite=allow_nonfinite)
    emit = Emit(out, manifest_base, jobs=jobs, options=options, progress=progress)
    with open_checkpoint(source) as ckpt:
        run_files = collect_run_files(ckpt.format, ckpt.path, dict(ckpt.raw_config), ckpt.config)
        folder = ckpt.path if os.path.isdir(ckpt.path) else os.path.dirname(os.path.abspath(ckpt.path))
        beside = [os.path.join(folder, name) for name in ("config.json", *(n for n, _ in run_files.files))]
        extra = [plan_path, *((plan_kwargs or {}).get(k) for k in ("hardware", "profile", "trace"))]
        refuse_overwriting_inputs(out, [*ckpt.files, *(beside if ckpt.format != "gguf" else ()),
                                        *(p for p in extra if p)])
        layout = LayOut(tuple(RunFile(name, data) for name, data in run_files.files))
        manager = PassManager((DetectExperts(ckpt), plan_pass, ChooseSchemes(dense_scheme), layout, emit))
        ir = manager.run(PassContext(check=check), stop_after=stop_after, dump_after=dump_after, dump=dump)
        if emit.result is None:
            return None
        measured = None if calibration_text is None else _activation_errors(source, ir, calibration_text)
    placement = ir.placement
    assert placement is not None
    devices = [p.device for row in placement.experts for p in row]
    result = emit.result
    return CompileResult(result.path, result.file_bytes, result.source_bytes, devices.count(Device.GPU),
                         len(devices) - devices.count(Device.GPU), result, made_plan[0] if made_plan else None, measured,
                         devices.count(Device.DISK))


def _activation_errors(source: str, ir: ModelIR, text_path: str) -> dict[int, dict[str, float]]:
    """Each MoE layer's output error on the calibration text's activations, at the schemes its
    experts were stored in (``passes/activation_error.py``)."""
    from ktc.api import activation_errors

    assert ir.placement is not None
    used = [tuple(dict.fromkeys(p.scheme for p in row)) for row in ir.placement.experts]
    errors = activation_errors(source, ir, text_path, tuple(dict.fromkeys(s for row in used for s in row)))
    return {layer: {s: errors[s][i] for s in schemes} for i, (layer, schemes) in
            enumerate(zip(ir.placement.layers, used))}


def refuse_overwriting_inputs(out: str, inputs: list[str]) -> None:
    """Refuse an output path that is one of the files the compile reads (the same file by inode,
    so a hard link or a path through a symlink counts too): the finished bundle would replace
    it. Checked before anything is written."""
    if not os.path.exists(out):
        return  # nothing there to replace
    for path in inputs:
        try:
            same = os.path.samefile(out, path)
        except OSError:
            continue
        if same:
            also = "" if os.path.realpath(out) == os.path.realpath(path) else f" (the same file as {path})"
            raise KtcError(f"the output path is a file this compile reads{also}; the bundle would "
                           "replace it", path=out, hint="write the bundle to another path, e.g. -o model.ktb")


def check_writable_target(out: str) -> None:
    folder = os.path.dirname(os.path.abspath(out)) or "."
    if os.path.isdir(out):
        raise KtcError("the output path is a folder; give a file name such as model.ktb", path=out)
    if not os.path.isdir(folder):
        raise KtcError("the output folder does not exist", path=folder)
