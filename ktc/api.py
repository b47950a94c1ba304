"""The public Python API."""

from __future__ import annotations

import dataclasses
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


def _pins(values: object) -> tuple[tuple[int, int], ...]:
    """Pins as (layer, expert) pairs from pairs or "L:E" strings (comma lists allowed)."""
    from ktc.errors import ConfigError

    out = []
    for value in values or ():  # type: ignore[attr-defined]
        if isinstance(value, str):
            for part in value.split(","):
                layer, sep, expert = part.strip().partition(":")
                if not sep or not layer.strip().isdigit() or not expert.strip().isdigit():
                    raise ConfigError(f"cannot read pin {part!r}; write LAYER:EXPERT, e.g. 3:17")
                out.append((int(layer), int(expert)))
        else:
            layer, expert = value  # type: ignore[misc]
            out.append((int(layer), int(expert)))
    return tuple(out)


def plan(model: str | os.PathLike[str] | ModelIR, *, vram: str | int | None = None,
         ram: str | int | None = None, hardware: str | None = None, reserve: str | int | None = None,
         max_tokens: int = 4096, batch: int = 1, kv_dtype: str = "bf16", prefill_chunk: int = 512,
         profile: str | object | None = None, gpu_schemes: tuple[str, ...] | None = None,
         cpu_schemes: tuple[str, ...] | None = None, dense_scheme: str = "auto",
         pin_gpu: object = (), pin_cpu: object = (), quality_weight: float = 0.0,
         time_limit: float = 1.5, cpu_bandwidth: str | float | None = None,
         gpu_bandwidth: str | float | None = None, pcie_bandwidth: str | float | None = None,
         sync_us: float | None = None, disk_bandwidth: str | float | None = None, source_types: bool = False,
         device_step_us: float | None = None,
         calibration_text: str | os.PathLike[str] | None = None, calibration_tokens: int = 1024,
         trace: str | os.PathLike[str] | None = None, request: tuple[int, int] | None = None):
    """Plan which experts live on the GPU: returns a ``ktc.passes.planner.Plan``.

    ``vram``/``ram`` take sizes like "24GiB"; ``hardware`` a profile JSON (flags override it).
    ``profile`` is an activation profile path (ktc JSON or a KTransformers/SGLang ``.pt``), an
    ``ActivationProfile``, or None for uniform routing. ``gpu_schemes``/``cpu_schemes`` left
    None: the source's own expert type where it is a block scheme (a GGUF's Q4_K, say: passed
    through), else bf16 on the GPU and int8 on the CPU (``default_expert_schemes``); with
    ``source_types`` the source's own types even where they are floats (what llama.cpp loads).
    The plan's ``streaming`` (``ktc.streaming``) holds the device cache's slots, the prefill
    offload's threshold and the disk tier; ``trace`` (a ``ktc profile --trace`` file) lets the
    planner trade residents for cache slots where the recorded routing says they gain;
    ``request`` (a typical request's prompt and new tokens) lets it hold VRAM for the prefill
    offload's copies in place of residents where that makes such a request faster.

    >>> p = ktc.plan("./Qwen3-30B-A3B", vram="24GiB", ram="64GiB", max_tokens=32768)
    >>> p.predicted_ms_per_token, p.placement.gpu_experts_per_layer()
    """
    from ktc.formats.activation_profile import ActivationProfile, load_activation_profile
    from ktc.formats.hardware_profile import make_hardware_profile
    from ktc.passes.plan import PlannerOptions, Workload
    from ktc.passes.planner import default_expert_schemes, plan_placement

    ir = model if isinstance(model, ModelIR) else load_model(model)
    hw = make_hardware_profile(profile_path=hardware, vram=vram, ram=ram, reserve=reserve,
                               cpu_bandwidth=cpu_bandwidth, gpu_bandwidth=gpu_bandwidth,
                               pcie_bandwidth=pcie_bandwidth, sync_us=sync_us, disk_bandwidth=disk_bandwidth,
                               device_step_us=device_step_us)
    if isinstance(profile, (str, os.PathLike)):
        activation = load_activation_profile(os.fspath(profile), moe_layers=ir.moe_layer_indices,
                                             num_layers=ir.config.num_layers,
                                             num_experts=ir.config.num_experts)
    else:
        activation = profile if isinstance(profile, ActivationProfile) else None
    default_gpu, default_cpu, per_layer = default_expert_schemes(ir, floats=source_types)
    # Neither list given and the source stores its experts in block schemes: each layer keeps its own.
    own = not gpu_schemes and not cpu_schemes and bool(per_layer)
    options = PlannerOptions(gpu_schemes=tuple(gpu_schemes or default_gpu),
                             cpu_schemes=tuple(cpu_schemes or default_cpu), dense_scheme=dense_scheme,
                             from_source=", ".join(default_gpu) if own else None,
                             layer_schemes=per_layer if own else (),
                             pin_gpu=_pins(pin_gpu), pin_cpu=_pins(pin_cpu),
                             quality_weight=quality_weight, time_limit=time_limit)
    if calibration_text is not None:
        options = dataclasses.replace(options, activation_errors=tuple(activation_errors(
            model, ir, os.fspath(calibration_text), options.gpu_schemes + options.cpu_schemes,
            calibration_tokens).items()))
    prompt_tokens, new_tokens = request or (0, 0)
    workload = Workload(max_tokens=max_tokens, batch=batch, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                        prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    from ktc.streaming import plan_streaming

    static = plan_placement(ir, hw, workload, activation, options)
    chosen, streaming = plan_streaming(
        ir, static, None if trace is None else os.fspath(trace),
        replan=lambda vram, offload=0: plan_placement(ir, hw, workload, activation,
                                                      dataclasses.replace(options, cache_vram=vram,
                                                                          offload_vram=offload)))
    return dataclasses.replace(chosen, streaming=streaming)


def activation_errors(model: object, ir: ModelIR, text_path: str, schemes: tuple[str, ...],
                      tokens: int = 1024) -> dict[str, tuple[float, ...]]:
    """Per expert scheme, each MoE layer's output error on the hidden states that reach its
    experts over the text in ``text_path`` (``passes/activation_error.py``), the source
    checkpoint ``model`` run through transformers."""
    from ktc.passes.activation_error import layer_scheme_errors

    return layer_scheme_errors(ir, calibration_inputs(model, text_path, tokens), tuple(dict.fromkeys(schemes)))


def calibration_inputs(model: object, text_path: str, tokens: int = 1024) -> dict:
    """The hidden states reaching each MoE layer's experts over the text in ``text_path``, the
    source checkpoint ``model`` (a folder) run through transformers (``runtime.activations``)."""
    from ktc.errors import KtcError
    from ktc.runtime.activations import expert_inputs

    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        raise KtcError("--calibration-text needs the source checkpoint's folder (transformers runs it)",
                       path=str(model))
    try:
        with open(text_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise KtcError(f"cannot read the calibration text ({exc})", path=text_path) from None
    return expert_inputs(os.path.abspath(os.fspath(model)), text, max_tokens=tokens)


def generate_gpu_experts_masks(activation_freq, vram_budget_bytes: int, *, expert_bytes: int,
                               cpu_expert_bytes: int | None = None, top_k: int = 8, batch: int = 1,
                               gpu_bandwidth: float = 900e9, cpu_bandwidth: float = 60e9,
                               sync_seconds: float = 50e-6):
    """A drop-in for KTransformers' ``generate_gpu_experts_masks(activation_freq, num_gpu_experts)``
    that takes a VRAM budget in bytes instead of a count and places experts optimally under
    ktc's cost model (per layer, GPU and CPU run at once; a layer with CPU experts pays a sync).

    ``activation_freq``: [num_layers, num_experts] routing counts (torch or numpy).
    ``expert_bytes``: one expert's size on the GPU; ``cpu_expert_bytes`` on the CPU (default the
    same). Returns a boolean mask of the same shape and kind (True: on the GPU).
    """
    import numpy as np

    from ktc.formats.activation_profile import ActivationProfile
    from ktc.passes.placement_solver import CPU, GPU, PlacementOption, PlacementProblem, solve_placement

    is_torch = type(activation_freq).__module__.startswith("torch")
    freq = np.asarray(activation_freq.detach().cpu().numpy() if is_torch else activation_freq, dtype=np.float64)
    profile = ActivationProfile(tuple(range(freq.shape[0])), freq, "activation_freq")
    usage = 1.0 - (1.0 - profile.selection_probability(top_k)) ** batch
    cpu_bytes = expert_bytes if cpu_expert_bytes is None else cpu_expert_bytes
    options = (PlacementOption(GPU, "gpu", int(expert_bytes), 0, expert_bytes / gpu_bandwidth),
               PlacementOption(CPU, "cpu", 0, int(cpu_bytes), cpu_bytes / cpu_bandwidth))
    problem = PlacementProblem(usage=usage, options=options,
                               allowed=np.ones(usage.shape + (2,), dtype=bool),
                               vram_budget=int(vram_budget_bytes), ram_budget=2**62,
                               sync_seconds=np.full(usage.shape[0], sync_seconds))
    mask = solve_placement(problem).choice == 0
    if is_torch:
        import torch

        return torch.from_numpy(mask)
    return mask
