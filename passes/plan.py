"""What a plan is: the workload it serves, the planner's options, the plan itself and its JSON.

The planner (``passes/planner.py``) makes plans and the verifier (``passes/plan_verify.py``)
checks them; both read these types, so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ktc.errors import ConfigError, FormatError
from ktc.formats.activation_profile import ActivationProfile
from ktc.formats.hardware_profile import HardwareProfile
from ktc.formats.schemes import ExpertShape, dense_scheme_name, expert_scheme_name, expert_schemes
from ktc.ir import Device, ExpertPlacement, ModelIR, Placement


PLAN_FORMAT = "ktc-plan"
PLAN_VERSION = 1

KV_DTYPE_BYTES = {"bf16": 2, "f16": 2, "fp16": 2, "f32": 4, "fp32": 4, "fp8": 1, "fp8_e4m3": 1,
                  "fp8_e5m2": 1}

@dataclass(frozen=True)
class Workload:
    """What the model will serve: KV capacity, concurrent sequences, KV type, prefill chunk."""

    max_tokens: int = 4096  # total tokens the KV cache holds, all sequences together
    batch: int = 1  # sequences decoded together
    kv_dtype: str = "bf16"
    prefill_chunk: int = 512  # tokens per prefill step: sizes the activation workspace
    # A typical request, its prompt's tokens and the tokens generated (0 and 0: not given). With
    # one the streaming plan (``ktc.streaming``) weighs prefill against decode and may hold VRAM
    # for the prefill offload's copies in place of residents.
    prompt_tokens: int = 0
    new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.batch < 1 or self.prefill_chunk < 1:
            raise ConfigError("workload: max_tokens must be >= 0, batch and prefill_chunk >= 1")
        if self.prompt_tokens < 0 or self.new_tokens < 0:
            raise ConfigError("workload: a request's prompt and new tokens must be >= 0")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError(f"unknown KV cache dtype {self.kv_dtype!r}; known: {', '.join(KV_DTYPE_BYTES)}")

    @property
    def kv_element_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]


@dataclass(frozen=True)
class PlannerOptions:
    """Schemes each device may use (the baselines take the best one of each), pins, and knobs."""

    gpu_schemes: tuple[str, ...] = ("bf16",)
    cpu_schemes: tuple[str, ...] = ("int8",)
    dense_scheme: str = "auto"
    # Set when the schemes were not given and are the source's own expert types (passed through):
    # their names, and per MoE layer the one each layer keeps.
    from_source: str | None = None
    layer_schemes: tuple[str, ...] = ()
    pin_gpu: tuple[tuple[int, int], ...] = ()
    pin_cpu: tuple[tuple[int, int], ...] = ()
    # Seconds per step worth one unit of usage-weighted nominal error. 0: speed alone decides,
    # and among equally fast placements the more precise schemes are kept.
    quality_weight: float = 0.0
    time_limit: float = 1.5  # seconds the solver may take
    # (expert scheme, its error in each MoE layer) measured on the activations of a calibration
    # text (``passes/activation_error.py``): the quality term weighs these instead of the
    # schemes' nominal errors
    activation_errors: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # VRAM held for the device expert cache's slots (``ktc.streaming`` chooses it): counted
    # among the fixed VRAM, so the residents are solved under what the slots leave
    cache_vram: int = 0
    # VRAM held for the prefill offload's copies (``ktc.streaming`` chooses it), counted the same way
    offload_vram: int = 0

    def __post_init__(self) -> None:
        if not self.gpu_schemes or not self.cpu_schemes:
            raise ConfigError("give at least one GPU scheme and one CPU scheme")
        try:  # canonical names, so "int4" and "int4_g128" are one scheme everywhere
            object.__setattr__(self, "gpu_schemes", tuple(expert_scheme_name(n) for n in self.gpu_schemes))
            object.__setattr__(self, "cpu_schemes", tuple(expert_scheme_name(n) for n in self.cpu_schemes))
            object.__setattr__(self, "dense_scheme", dense_scheme_name(self.dense_scheme))
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None
        if self.cache_vram < 0 or self.offload_vram < 0:
            raise ConfigError("the VRAM held for cache slots and the prefill offload must be at least 0")
        if len(set(self.gpu_schemes)) != len(self.gpu_schemes) or len(set(self.cpu_schemes)) != len(self.cpu_schemes):
            raise ConfigError("a scheme is listed twice for one device")
        for device, names in (("gpu", self.gpu_schemes), ("cpu", self.cpu_schemes)):
            for name in names:
                for scheme in expert_schemes(name):
                    if device not in scheme.devices:
                        raise ConfigError(f"scheme {scheme.name} has no {device.upper()} kernels in this ktc",
                                          hint=f"pick another --{device}-schemes")
        both = set(self.pin_gpu) & set(self.pin_cpu)
        if both:
            layer, expert = sorted(both)[0]
            raise ConfigError(f"expert {layer}:{expert} is pinned to both the GPU and the CPU")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes by component on each device, against the budgets."""

    vram: tuple[tuple[str, int], ...]
    ram: tuple[tuple[str, int], ...]
    vram_budget: int
    ram_budget: int

    @property
    def vram_total(self) -> int:
        return sum(b for _, b in self.vram)

    @property
    def ram_total(self) -> int:
        return sum(b for _, b in self.ram)

    def to_json(self) -> dict[str, Any]:
        return {"vram": dict(self.vram), "ram": dict(self.ram), "vram_total": self.vram_total,
                "ram_total": self.ram_total, "vram_budget": self.vram_budget,
                "ram_budget": self.ram_budget}


@dataclass(frozen=True)
class BaselineResult:
    name: str
    description: str
    feasible: bool
    predicted_ms_per_step: float | None
    gpu_experts: int
    setting: str  # the flag value a user would type: "--n-cpu-moe 12", "N=3 per layer", ...
    placement: Placement | None = field(default=None, repr=False)
    schemes: str = ""  # the one scheme per device it was measured at: "gpu bf16, cpu int8"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "feasible": self.feasible,
                "predicted_ms_per_step": self.predicted_ms_per_step, "gpu_experts": self.gpu_experts,
                "setting": self.setting, "schemes": self.schemes}


@dataclass(frozen=True)
class SolveInfo:
    seconds: float
    optimal: bool
    gap: float
    lower_bound_ms: float
    method: str


@dataclass(frozen=True)
class ModelFacts:
    """What a plan records about its model, to refuse being used with another."""

    family: str
    architecture: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    expert_biases: bool = False


def expert_shape_from_facts(facts: ModelFacts) -> ExpertShape:
    return ExpertShape(facts.hidden_size, facts.expert_intermediate_size, facts.expert_biases)


@dataclass(frozen=True, eq=False)
class Plan:
    """A placement with its memory breakdown, predicted speed and the baselines beside it."""

    model: ModelFacts
    hardware: HardwareProfile
    workload: Workload
    options: PlannerOptions
    placement: Placement
    memory: MemoryBreakdown
    constant_ms: float  # non-expert weights read per step
    expert_ms: float  # routed experts per step
    baselines: tuple[BaselineResult, ...]
    solve: SolveInfo
    profile: ActivationProfile = field(repr=False)
    usage: np.ndarray = field(repr=False)  # [moe layers, experts] per-step use probability
    layer_ms: tuple[float, ...] = ()
    # ktc's own placement at one scheme per device, when the lists allow more than one: the
    # baselines against it show what placement gains, it against the plan what mixing adds.
    single_scheme: BaselineResult | None = None
    # the streaming plan beside the placement (``ktc.streaming.StreamingPlan``: cache slots, the
    # prefill offload's threshold, the disk tier), where the planner was asked for one
    streaming: Any = None

    @property
    def predicted_ms_per_step(self) -> float:
        return self.constant_ms + self.expert_ms

    @property
    def predicted_ms_per_token(self) -> float:
        return self.predicted_ms_per_step / self.workload.batch

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.workload.batch / self.predicted_ms_per_step

    def baseline(self, name: str) -> BaselineResult:
        return next(b for b in self.baselines if b.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "feasible": True,
            "model": {**asdict(self.model), "moe_layers": list(self.model.moe_layers)},
            "hardware": self.hardware.to_json(),
            "workload": asdict(self.workload),
            "options": {**asdict(self.options), "pin_gpu": [list(p) for p in self.options.pin_gpu],
                        "pin_cpu": [list(p) for p in self.options.pin_cpu]},
            "predicted_ms_per_step": self.predicted_ms_per_step,
            "predicted_ms_per_token": self.predicted_ms_per_token,
            "tokens_per_second": self.tokens_per_second,
            "constant_ms": self.constant_ms,
            "expert_ms": self.expert_ms,
            "layer_ms": list(self.layer_ms),
            "memory": self.memory.to_json(),
            "gpu_experts_per_layer": dict(zip(map(str, self.placement.layers),
                                              self.placement.gpu_experts_per_layer())),
            "placement": {str(layer): [f"{p.device.value}:{p.scheme}" for p in row]
                          for layer, row in zip(self.placement.layers, self.placement.experts)},
            "baselines": {b.name: {**b.to_json(), "predicted_ms_per_token": (
                None if b.predicted_ms_per_step is None else b.predicted_ms_per_step / self.workload.batch),
                "ktc_speedup": (None if b.predicted_ms_per_step is None
                                else b.predicted_ms_per_step / self.predicted_ms_per_step)}
                for b in self.baselines},
            "single_scheme": None if self.single_scheme is None else self.single_scheme.to_json(),
            "solve_seconds": self.solve.seconds,
            "solver": asdict(self.solve),
            **({} if self.streaming is None else
               {"streaming": {**self.streaming.to_json(), "cache_vram_bytes": self.options.cache_vram}}),
        }


def placement_from_json(data: dict[str, Any], path: str = "<plan>") -> Placement:
    """The placement recorded in a plan's JSON (what ``ktc compile --plan`` reads), checked:
    layer keys are layer numbers, each entry is "device:scheme" with a known device."""
    from ktc.formats.json_fields import Fields

    rows = Fields(data, path, "plan").mapping("placement")
    layers = []
    for key in rows:
        if not (isinstance(key, str) and key.isdecimal()):
            raise FormatError(f"plan: placement key {key!r} is not a layer number", path=path)
        layers.append(int(key))
    if not layers:
        raise FormatError("plan: the placement is empty", path=path)
    devices = {d.value for d in Device}
    experts = []
    for layer in sorted(layers):
        row = rows[str(layer)]
        if not isinstance(row, list) or not row:
            raise FormatError(f"plan: layer {layer}'s placement is not a list of experts", path=path)
        placed = []
        for expert, item in enumerate(row):
            device, _, scheme = item.partition(":") if isinstance(item, str) else ("", "", "")
            if device not in devices or not scheme:
                raise FormatError(f"plan: layer {layer} expert {expert} is placed at {item!r}; expected "
                                  "\"gpu:SCHEME\", \"cpu:SCHEME\" or \"disk:SCHEME\"", path=path)
            placed.append(ExpertPlacement(Device(device), scheme))
        experts.append(tuple(placed))
    return Placement(tuple(sorted(layers)), tuple(experts))


def workspace_bytes(ir: ModelIR, workload: Workload) -> int:
    """Activation workspace of one prefill chunk, in bf16: hidden states and residuals
    (4 x hidden), q/k/v, the widest MLP intermediate (x2 for gate and up), plus float32 logits
    for the decode batch. An estimate; docs/planner.md says what it leaves out."""
    cfg = ir.config
    if cfg.kv_lora_rank:
        qkv = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        qkv = (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    widest = max(cfg.dense_intermediate_size, cfg.top_k * cfg.expert_intermediate_size,
                 cfg.shared_expert_intermediate_size)
    per_token = 2 * (4 * cfg.hidden_size + qkv + 2 * widest)
    return workload.prefill_chunk * per_token + 4 * workload.batch * cfg.vocab_size
