"""Whole models from a bundle, through transformers.

``from_bundle(path)`` builds the transformers model of the bundle's config on the meta device,
fills its non-expert parameters from the bundle, and serves its routed experts through ktc by
registering an implementation with transformers' experts interface
(``experts_implementation="ktc"``): routing, shared experts, attention, norms and sampling stay
transformers' own code, so every MoE family whose experts class uses
``@use_experts_implementation`` runs once ktc can read its checkpoint.

Two placements:

- ``device=None``: everything on the CPU. Non-expert matrices stay in the mapped bundle at their
  scheme and run through ktc's kernels (``runtime.linear``); experts through the Numba kernels.
- ``device="cuda"`` (or ``"cpu"``, the same code on torch's CPU device, as tests use): the
  non-expert weights, the device experts and a KV cache of the plan's capacity are allocated on
  the device, and nothing else: CPU experts run in the Numba kernels beside them.

transformers is imported here only (``pip install 'ktc[hf]'``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktc.errors import BundleError, KtcError, UnsupportedModelError
from ktc.formats.bundle import Bundle, open_bundle
from ktc.formats.hardware_profile import format_bytes
from ktc.formats.transformers_model import (
    config_from_dict, gguf_name_map, gguf_processor, hf_name_map, import_transformers, is_experts_module,
    meta_model,
)

from .device import check_device
from .experts import ExpertSet, disk_tier

EXPERTS_IMPLEMENTATION = "ktc"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def require_transformers() -> Any:
    """transformers, with ktc's experts implementation registered; a ``KtcError`` that says what
    to install when it is missing or too old."""
    transformers = import_transformers()
    from transformers.integrations.moe import ExpertsInterface

    if EXPERTS_IMPLEMENTATION not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _ktc_experts_forward)
    return transformers


def _ktc_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """transformers' experts interface: the routed experts of one layer, run by ktc."""
    experts = getattr(self, "_ktc_experts", None)
    if experts is None:
        raise KtcError('experts_implementation="ktc" serves models built by ktc.runtime.hf.from_bundle')
    return experts.forward_torch(hidden_states, top_k_index, top_k_weights)


def _device_dtype(dense_scheme: str) -> Any:
    import torch

    return {"f32": torch.float32, "f16": torch.float16}.get(dense_scheme, torch.bfloat16)


def _kv_dtype(name: str) -> Any:
    import torch

    return {"f32": torch.float32, "fp32": torch.float32, "f16": torch.float16, "fp16": torch.float16,
            "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2}.get(name, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Bundle tensors -> model parameters


def _source_keys(model: Any, bundle: Bundle) -> dict[str, str]:
    """Model parameter/buffer name -> bundle tensor, for every non-expert tensor of the bundle.

    Bundles keep the checkpoint's names; they go through transformers' own name maps
    (``formats.transformers_model``: Mixtral's ``block_sparse_moe`` is ``mlp`` in the module
    tree, GGUF's ``blk.N.attn_q`` is ``model.layers.N.self_attn.q_proj``, and so on).
    """
    meta = model.state_dict(keep_vars=True)
    sources = {t.source or t.name: t.name for t in bundle.tensors.values() if t.role != "expert"}
    out: dict[str, str] = {}
    if bundle.manifest["provenance"]["source_format"] == "gguf":
        names = gguf_name_map(model, bundle.manifest["model"]["architecture"])
        keys = {source: names.get(source) for source in sources}
    else:
        rename = hf_name_map(model)
        keys = {source: rename(source)[0] for source in sources}
    for source, tensor in sources.items():
        if keys[source] is not None and keys[source] in meta:
            out[keys[source]] = tensor
    return out


def _gguf_row_order(bundle: Bundle, tensor: str, processor: Any) -> np.ndarray | None:
    """Rows of a GGUF tensor reordered the way transformers' GGUF loader reorders them (llama.cpp
    permutes llama-style Q and K rows for its rope): the permutation, or None when the rows stay.
    Found by passing row numbers through transformers' own tensor ``processor``."""
    t = bundle.tensors[tensor]
    rows = np.arange(t.shape[0], dtype=np.float64)
    probe = rows.reshape(-1, 1) if len(t.shape) > 1 else rows
    result = processor.process(weights=probe, name=t.source or t.name)
    if result.weights is probe:
        return None
    order = np.asarray(result.weights).reshape(-1)
    if order.shape != rows.shape or not np.array_equal(np.sort(order), rows):
        raise UnsupportedModelError(f"transformers transforms GGUF tensor '{t.source}' in a way ktc does not "
                                    "apply yet", path=bundle.path)
    return order.astype(np.int64)


# ----------------------------------------------------------------------------------------------
# The KV cache


def _kv_shapes(config: Any) -> list[tuple[int, int, int]] | None:
    """(heads, key dim, value dim) per layer of the keys and values transformers' attention
    caches, from the config; None for layers other than attention (linear attention, SSMs)."""
    text = config.get_text_config(decoder=True)
    kinds = getattr(text, "layer_types", None) or ()
    if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
        return None
    layers = int(text.num_hidden_layers)
    if getattr(text, "kv_lora_rank", None):  # MLA: the compressed latent and the shared rope key
        return [(1, int(text.kv_lora_rank), int(text.qk_rope_head_dim))] * layers
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return [(heads, head_dim, head_dim)] * layers


def _filled_part(buffer: str) -> property:
    """A preallocated cache layer's keys or values: the filled part of its ``buffer``, which is
    not replaced from outside (DynamicLayer's ``__init__`` sets None, which is let pass)."""

    def refuse(layer: Any, value: Any) -> None:
        if value is not None:
            raise KtcError("ktc's KV cache is allocated up front: its keys and values are not replaced "
                           "(offloading, beam reordering and batch edits are not supported)")

    return property(lambda layer: getattr(layer, buffer)[:, :, :layer.length], refuse)


def make_cache(config: Any, capacity: int, *, device: Any, dtype: Any, compute_dtype: Any) -> Any:
    """A transformers ``Cache`` whose keys and values are allocated up front for ``capacity``
    tokens (one sequence), so memory is what the plan counted and a longer request fails with a
    clear message instead of growing; attention reads only the filled part."""
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    shapes = _kv_shapes(config)
    if shapes is None:
        return DynamicCache(config=config)

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, heads: int, k_dim: int, v_dim: int) -> None:
            super().__init__()
            import torch

            self.capacity = capacity
            self.device = device
            self.key_buffer = torch.zeros((1, heads, capacity, k_dim), dtype=dtype, device=device)
            self.value_buffer = torch.zeros((1, heads, capacity, v_dim), dtype=dtype, device=device)
            self.length = 0
            self.is_initialized = True

        # The filled part of the buffers, sliced when read: a decode step of
        # runtime.fast_decode advances the length without torch (two slices cost 50 us a layer
        # there, among streaming weights).
        keys = _filled_part("key_buffer")
        values = _filled_part("value_buffer")

        @property
        def nbytes(self) -> int:
            return sum(b.numel() * b.element_size() for b in (self.key_buffer, self.value_buffer))

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:  # allocated already
            pass

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            new = key_states.shape[-2]
            if key_states.shape[0] != 1 or key_states.shape[1:2] + key_states.shape[3:] != \
                    self.key_buffer.shape[1:2] + self.key_buffer.shape[3:] or \
                    value_states.shape[-1] != self.value_buffer.shape[-1]:
                raise KtcError(f"attention keys {tuple(key_states.shape)} do not fit the KV cache "
                               f"allocated from the config {tuple(self.key_buffer.shape)}")
            self.check_room(new)
            end = self.length + new
            self.key_buffer[:, :, self.length:end] = key_states.to(self.key_buffer.dtype)
            self.value_buffer[:, :, self.length:end] = value_states.to(self.value_buffer.dtype)
            self.advance(new)
            keys, values = self.keys, self.values
            if keys.dtype != compute_dtype:
                return keys.to(compute_dtype), values.to(compute_dtype)
            return keys, values

        def check_room(self, new: int) -> None:
            """``KtcError`` unless ``new`` more positions fit the buffers."""
            if self.length + new > self.capacity:
                raise KtcError(f"the KV cache holds {self.capacity} tokens; this step would need "
                               f"{self.length + new}")

        def advance(self, new: int) -> None:
            """``new`` more positions hold keys and values (written into the buffers by
            ``runtime.fast_decode``)."""
            self.length += new

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return self.capacity

        def reset(self) -> None:
            self.length = 0

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:  # the legacy form: the length to keep
                self.length = min(self.length, tokens_to_remove)
            else:
                self.length = max(0, self.length + tokens_to_remove)

    return Cache(layers=[PreallocatedLayer(*shape) for shape in shapes])


def cache_bytes(cache: Any) -> int:
    return sum(getattr(layer, "nbytes", 0) for layer in getattr(cache, "layers", ()))


# ----------------------------------------------------------------------------------------------
# The model


@dataclass
class KtcModel:
    """A bundle running as a transformers model. ``model`` is the transformers model (its
    ``generate()`` works), ``tokenizer`` the bundle's tokenizer; ``close()`` (or leaving a
    ``with`` block) releases the bundle, every map and the device memory."""

    model: Any
    tokenizer: Any
    bundle: Bundle
    device: Any  # None: CPU only
    dtype: Any
    max_tokens: int
    prefill_chunk: int
    device_bytes: dict[str, int] = field(default_factory=dict)
    plan_device_bytes: dict[str, int] = field(default_factory=dict)
    experts: list[ExpertSet] = field(default_factory=list)
    cache: Any = None
    threads: int = 0  # the kernels' CPU threads
    fast: Any = None  # runtime.fast_decode.FastDecode where it computes the decode steps
    prefetcher: Any = None  # runtime.prefetch.Prefetcher (``prefetch=True``)
    offload: Any = None  # runtime.offload.PrefillOffload (``prefill_offload=True``)
    pinning: Any = None  # a disk-tier plan: (method, bytes, why the fallback) of its RAM set's reading in

    def __enter__(self) -> KtcModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device_total(self) -> int:
        return sum(self.device_bytes.values())

    @property
    def plan_device_total(self) -> int:
        return sum(self.plan_device_bytes.values())

    def check_capacity(self, prompt_tokens: int, new_tokens: int) -> None:
        """``KtcError`` unless ``prompt_tokens + new_tokens`` fit the KV cache the plan sized."""
        check_capacity(prompt_tokens, new_tokens, self.max_tokens, self.bundle.path)

    def new_cache(self) -> Any:
        """The model's KV cache, emptied (one is allocated at load and reused)."""
        if self.cache is None:
            raise KtcError("the model is closed")
        self.cache.reset()
        return self.cache

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """transformers' ``generate`` with the preallocated cache; refuses a request longer
        than the KV capacity before anything runs."""
        import torch

        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None, :]
        if input_ids.shape[0] != 1:
            raise KtcError("one sequence at a time: the KV cache is sized for one")
        new = int(kwargs.get("max_new_tokens") or 0)
        self.check_capacity(int(input_ids.shape[1]), new)
        if "cache" not in kwargs and "past_key_values" not in kwargs:
            kwargs[self.cache_argument] = self.new_cache()
        with torch.inference_mode():
            return self.model.generate(input_ids.to(self.input_device), **kwargs)

    def forward_window(self, ids: np.ndarray, lo: int, hi: int, batch: int | None = None) -> np.ndarray:
        """Runs the token ids ``ids`` from an empty KV cache, ``batch`` tokens a forward (default:
        the prefill chunk), and returns the float32 logits [hi - lo, vocab] of positions lo to
        hi - 1 (none where lo == hi; transformers then computes the last position's only). The
        last layer's experts run for the positions whose logits a chunk keeps
        (``last_layer_experts``)."""
        import inspect

        import torch

        self.check_capacity(len(ids), 0)
        step = batch or self.prefill_chunk
        keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        cache = self.new_cache()
        kept = []
        final = self.last_layer_experts
        with torch.inference_mode():
            for start in range(0, len(ids), step):
                end = min(len(ids), start + step)
                first, last = max(start, lo), min(end, hi)  # the positions wanted in this chunk
                chunk = torch.as_tensor(np.asarray(ids[start:end], dtype=np.int64)[None, :], device=self.input_device)
                options = {"logits_to_keep": max(end - first, 1)} if keeps else {}  # the last n
                if final is not None:  # the last layer's experts for those positions alone
                    final.rows_wanted = max(end - first, 1)
                try:
                    logits = self.model(input_ids=chunk, **{self.cache_argument: cache}, use_cache=True,
                                        **options).logits[0]
                finally:
                    if final is not None:
                        final.rows_wanted = None
                if last > first:
                    at = logits.shape[0] - (end - first)
                    kept.append(logits[at:at + last - first].float().cpu().numpy())
        return np.concatenate(kept) if kept else np.empty((0, 0), dtype=np.float32)

    @property
    def last_layer_experts(self) -> ExpertSet | None:
        """The experts of the model's last decoder layer (None where that layer is dense): past
        them only the final norm and the output matrix read each position, so a prefill chunk
        needs them only for the positions whose logits it keeps."""
        layers = getattr(self.model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        return next((e for e in self.experts if layers is not None and e.layer == layers - 1), None)

    @property
    def cache_argument(self) -> str:
        """The name under which this transformers takes a KV cache (``cache`` from 5.x on, where
        ``past_key_values`` is deprecated)."""
        import inspect

        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @property
    def input_device(self) -> Any:
        import torch

        return torch.device("cpu") if self.device is None else torch.device(self.device)

    def close(self) -> None:
        """Release the bundle, every map of it and every device tensor."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for experts in self.experts:
            experts.close()
        self.experts.clear()
        if self.model is not None:
            for module in self.model.modules():
                module._parameters.clear()
                module._buffers.clear()
                for attr in ("raw", "_weight", "_ktc_experts"):
                    if attr in module.__dict__:
                        module.__dict__[attr] = None
            self.model = None
        self.cache = None
        self.fast = None  # its routers are views of the bundle's map
        self.tokenizer = None
        self.bundle.close()


def check_capacity(prompt_tokens: int, new_tokens: int, max_tokens: int, path: str | None = None) -> None:
    """``KtcError`` unless ``prompt_tokens + new_tokens`` fit a KV cache of ``max_tokens``."""
    need = prompt_tokens + new_tokens
    if need > max_tokens:
        raise KtcError(
            f"{prompt_tokens} prompt tokens + {new_tokens} new tokens = {need} exceeds the KV cache of "
            f"{max_tokens} tokens this bundle was planned for", path=path,
            hint="shorten the prompt or --max-new-tokens, or compile again with a larger --max-tokens "
                 "(ktc plan shows the largest that fits the VRAM budget)")


def kv_capacity(bundle: Bundle) -> int:
    """Tokens the KV cache of a runnable bundle holds (the plan's ``max_tokens``)."""
    return int(_require_runnable(bundle)["workload"]["max_tokens"])


def _require_runnable(bundle: Bundle) -> dict[str, Any]:
    run = bundle.run_info
    if bundle.format_major < 2 or run is None:
        raise BundleError(f"this bundle (format {bundle.format_major}.x) was made by an older ktc and does not "
                          "carry the model's config and tokenizer needed to run it", path=bundle.path,
                          hint="compile it again from its source: ktc compile SOURCE -o BUNDLE")
    if run.get("config") is None or not run.get("files"):
        raise BundleError(f"the bundle cannot run: {run.get('missing') or 'it carries no config or tokenizer'}",
                          path=bundle.path)
    # The manifest's checksum guards against damage, not against a manifest written wrong.
    workload = run.get("workload") or {}
    max_tokens = workload.get("max_tokens")
    problems = []
    if not isinstance(run["config"], dict) or not isinstance(run["config"].get("model_type"), str):
        problems.append("run.config is not a model config")
    if not isinstance(run["files"], list) or not set(run["files"]) <= set(bundle.file_names()):
        problems.append("run.files names files the bundle does not carry")
    if not isinstance(workload, dict) or isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
            or max_tokens < 1:
        problems.append(f"run.workload.max_tokens is {max_tokens!r}, not a positive integer")
    if problems:
        raise BundleError("; ".join(problems), path=bundle.path)
    return run


def load_tokenizer(bundle: Bundle, transformers: Any | None = None) -> Any:
    """The bundle's tokenizer (transformers' ``AutoTokenizer`` over the files it carries)."""
    transformers = transformers or require_transformers()
    run = _require_runnable(bundle)
    with tempfile.TemporaryDirectory(prefix="ktc-tokenizer-") as folder:
        for name in bundle.file_names():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(bundle.file_bytes(name))
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(run["config"], f)
        try:
            return transformers.AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # transformers raises many types for a tokenizer it cannot read
            raise BundleError(f"the bundle's tokenizer does not load ({type(exc).__name__}: {exc})",
                              path=bundle.path) from None


def tokenizer_from_bundle(path: str | os.PathLike[str]) -> Any:
    """The tokenizer a bundle carries."""
    with open_bundle(path) as bundle:
        return load_tokenizer(bundle)


def from_bundle(path: str | os.PathLike[str], device: Any = None, threads: int | None = None, *,
                tokenizer: Any = None, cache_slots: int | dict[int, int] | None = None, cache_prior: Any = None,
                prefetch: bool = False, prefill_offload: bool | None = None, mapped: bool = True,
                interleave: bool = True, mlock: bool = False) -> KtcModel:
    """The bundle at ``path`` as a runnable transformers model with its tokenizer.

    ``device=None`` runs everything on the CPU; ``"cuda"`` puts the non-expert weights, the plan's
    device experts and the KV cache (the plan's ``max_tokens``) on the GPU. ``threads`` sets the CPU
    threads of ktc's kernels and torch (default: all cores). ``tokenizer``: the bundle's tokenizer
    when the caller loaded it already (``load_tokenizer``). ``cache_slots``: on a device, that many
    device slots per MoE layer for CPU experts (or a dict: each MoE layer's, by its number), filled
    on demand (``ExpertSet``), refused where they
    do not fit the VRAM the plan leaves free; ``cache_prior``: an ``ActivationProfile`` of the model
    (the slots' policy's prior; uniform without one). ``prefetch``: pre-gating one MoE layer ahead
    (``prefetch.Prefetcher``): the experts the next layer's router picks for this layer's input are
    paged in, and copied into its cache slots. It watches the forwards that go through the experts
    (``ExpertSet.observers``), and ktc's compiled CPU decode steps, which route inside one call a
    layer, between layers (``FastDecode.hooks``: the next layer's guess from this layer's output, a
    layer's attention ahead rather than a layer); on where the plan keeps experts on disk in a MoE
    layer after the first (no layer guesses the first), and asking only for those
    (``Prefetcher.paged``); the plan's RAM experts and the weights every step reads are then read in
    (``KtcModel.pinning``: ``MADV_WILLNEED``; with ``mlock`` locked, where the OS allows).
    ``prefill_offload``: on a device, a forward of the plan's threshold of tokens or more (32 where
    it has none) copies the CPU experts it uses to the device where the cost model says the copy is
    faster (``offload.PrefillOffload``, with the plan's PCIe and CPU bandwidths), within the VRAM
    the plan and the cache slots leave free; the offload's counters are ``KtcModel.offload``. Left
    None, both follow the plan's ``streaming`` record (``ktc.streaming``: its cache slots, and the
    offload from its threshold) on a device, and are off without one. ``mapped=False`` reads the
    whole bundle into the process's memory (huge pages where Linux gives them) instead of mapping
    it: the CPU kernels read faster there where the map reads slowly
    (``formats.bundle.open_bundle``); refused for a plan that keeps experts on disk (they are there
    because RAM cannot hold them). ``interleave``: on the CPU, q4_0, q8_0, mxfp4 and q4_k matrices
    (attention, the output matrix, and the experts of layers whose experts share one scheme where
    nothing runs on a device and none are on disk; int8 experts too, as q8_0 blocks) are multiplied
    from copies with their rows interleaved (``runtime.interleave``, as llama.cpp's ``--repack``),
    made at load; False reads them in the bundle's own layout.
    """
    transformers = require_transformers()
    dev = check_device(device)
    bundle = open_bundle(path, mapped=mapped)
    if not mapped and disk_tier(bundle):
        bundle.close()
        raise KtcError("this bundle's plan keeps experts on disk, where RAM cannot hold them; reading the whole "
                       "bundle into memory would need that RAM", path=os.fspath(path),
                       hint="run it mapped (without --no-mmap)")
    streaming = (bundle.manifest.get("plan") or {}).get("streaming") or {}
    if cache_slots is None:
        cache_slots = _planned_slots(bundle) if dev is not None else 0
    if prefill_offload is None:
        prefill_offload = dev is not None and streaming.get("prefill_min_tokens") is not None
    try:
        km = _load(transformers, bundle, dev, threads, tokenizer, cache_slots, cache_prior, prefill_offload,
                   interleave)
    except BaseException:
        bundle.close()
        raise
    try:
        _stream(km, prefetch, mlock)
    except BaseException:
        km.close()
        raise
    return km


def _planned_slots(bundle: Bundle) -> int | dict[int, int]:
    """The cache slots the plan's ``streaming`` record keeps: each MoE layer's, or (a plan made
    before it recorded them by layer) one count for every layer."""
    plan = bundle.manifest.get("plan") or {}
    streaming = plan.get("streaming") or {}
    by_layer = streaming.get("layer_slots") or []
    if not by_layer:
        return int(streaming.get("cache_slots") or 0)
    layers = [int(layer) for layer in plan.get("placement") or {}]
    if len(layers) != len(by_layer):
        raise BundleError(f"the plan records cache slots for {len(by_layer)} MoE layers and places the experts of "
                          f"{len(layers)}", path=bundle.path)
    return {layer: int(n) for layer, n in zip(layers, by_layer)}


def _stream(km: KtcModel, prefetch: bool, mlock: bool = False) -> None:
    """A disk-tier plan's RAM set read in (locked with ``mlock``) and the pre-gating prefetcher
    (``prefetch``, a plan with experts on disk in a layer a guess reaches, or the prefill
    offload, whose copies it starts a layer ahead)."""
    from .prefetch import Prefetcher, dense_ranges, expert_ranges, read_in

    if km.offload is not None:
        km.offload.lookahead = True
        prefetch = True
    bundle = km.bundle
    placement = (bundle.manifest.get("plan") or {}).get("placement") or {}
    paged = None
    if disk_tier(bundle):
        # What the plan holds in RAM: the CPU experts and the weights every step reads whole.
        in_ram = [r for layer, row in placement.items()
                  for r in expert_ranges(bundle, int(layer), [e for e, p in enumerate(row) if p.startswith("cpu:")])]
        km.pinning = read_in(bundle, in_ram + dense_ranges(bundle), lock=mlock)
        paged = {int(layer): np.array([p.startswith("disk:") for p in row]) for layer, row in placement.items()}
        # the first MoE layer has no layer before it to guess it: with disk experts there alone the
        # prefetcher has nothing to do, and its hooks would split ktc's compiled decode step
        prefetch = prefetch or any(paged[e.layer].any() for e in km.experts[1:])
    if not prefetch:
        return
    routers = [bundle.tensor_float32(f"layers.{e.layer}.router") for e in km.experts]
    top_k = int(bundle.manifest["model"]["moe_layers"][0]["top_k"])
    km.prefetcher = Prefetcher(bundle, km.experts, routers, top_k, keep_guesses=False, paged=paged)
    if km.fast is not None:  # its steps route inside compiled calls: guessed between layers
        km.fast.hooks.append(km.prefetcher.guess)


def _load(transformers: Any, bundle: Bundle, device: Any, threads: int | None, tokenizer: Any,
          cache_slots: int | dict[int, int] = 0, cache_prior: Any = None, prefill_offload: bool = False,
          interleave: bool = True) -> KtcModel:
    import torch

    from .bench import set_threads

    run = _require_runnable(bundle)
    used = set_threads(threads)
    torch.set_num_threads(used)
    if tokenizer is None:
        tokenizer = load_tokenizer(bundle, transformers)
    config = config_from_dict(transformers, run["config"], bundle.path)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    if len(tokenizer) > vocab:
        raise BundleError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}",
                          path=bundle.path, hint="the tokenizer files do not belong to this model")
    dense_scheme = run.get("dense_scheme", "bf16")
    dtype = torch.float32 if device is None else _device_dtype(dense_scheme)
    model = meta_model(transformers, config, dtype=dtype, experts_implementation=EXPERTS_IMPLEMENTATION,
                       buffers=True, path=bundle.path)
    if device is None and model.config._attn_implementation == "sdpa":  # prompts' attention a block at a time
        from .attention import register

        model.set_attn_implementation(register())
    loader = _Loader(transformers, bundle, model, device, dtype, interleave=interleave)
    if isinstance(cache_slots, dict) and not any(cache_slots.values()):
        cache_slots = 0
    if (cache_slots or prefill_offload) and device is None:
        raise KtcError("cache slots and prefill offload use device memory: they need a device (--device cuda)")
    offload = _prefill_offload(bundle) if prefill_offload else None
    experts = loader.attach_experts(cache_slots, cache_prior, offload)
    workload = run.get("workload") or {}
    max_tokens = kv_capacity(bundle)
    kv_dtype = torch.float32 if device is None else _kv_dtype(str(workload.get("kv_dtype", "bf16")))
    try:
        _check_cache_budget(bundle, experts)
        loader.fill()
        cache = make_cache(config, max_tokens, device=loader.torch_device, dtype=kv_dtype, compute_dtype=dtype)
    except BaseException:
        for expert_set in experts:  # their worker threads and device memory
            expert_set.close()
        raise
    generation = run.get("generation_config")
    if generation:
        model.generation_config = transformers.GenerationConfig.from_dict(generation)
    device_bytes: dict[str, int] = {}
    plan_bytes: dict[str, int] = {}
    if device is not None:
        device_bytes = {"non_expert": loader.device_bytes,
                        "experts": sum(e.device_bytes for e in experts), "kv_cache": cache_bytes(cache)}
        if cache_slots:
            device_bytes["expert_cache"] = sum(e.cache.nbytes for e in experts if e.cache is not None)
        vram = (bundle.manifest.get("plan", {}).get("memory") or {}).get("vram") or {}
        if vram:
            plan_bytes = {"non_expert": sum(v for k, v in vram.items()
                                            if k not in ("gpu_experts", "kv_cache", "workspace", "reserve",
                                                         *_HELD_FOR_STREAMING)),
                          "experts": int(vram.get("gpu_experts", 0)), "kv_cache": int(vram.get("kv_cache", 0))}
    km = KtcModel(model, tokenizer, bundle, device, dtype, max_tokens, int(workload.get("prefill_chunk") or 512),
                  device_bytes, plan_bytes, experts, cache, used, offload=offload)
    from .fast_decode import fast_decoder

    km.fast = fast_decoder(km)
    return km


def _check_cache_budget(bundle: Bundle, experts: list[ExpertSet]) -> None:
    """``KtcError`` when the experts' cache slots take more device memory than the plan leaves
    free under its VRAM budget (``_free_vram``); the prefill offload gets what they leave."""
    slots = sum(e.cache.nbytes for e in experts if e.cache is not None)
    offload = next((e.offload for e in experts if e.offload is not None), None)
    budget, free = _free_vram(bundle)
    if offload is not None:  # what the slots leave
        offload.budget_bytes = max(free - slots, 0)
    if not slots:
        return
    if slots > free:
        per_layer = max(e.cache.nbytes // max(e.cache.policy.slots, 1) for e in experts if e.cache is not None)
        raise KtcError(f"the cache slots take {format_bytes(slots)} of device memory; the plan leaves "
                       f"{format_bytes(max(free, 0))} of its {format_bytes(budget)} VRAM budget free",
                       path=bundle.path,
                       hint=f"use fewer --cache-slots (one slot per layer takes up to {format_bytes(per_layer)}), "
                            "or plan with a larger --vram")


# The plan's VRAM items held for streaming (``ktc.streaming``): free for the cache's slots and
# the prefill offload's copies to take, not weights the plan put there.
_HELD_FOR_STREAMING = ("cache_slots", "prefill_offload")


def _free_vram(bundle: Bundle) -> tuple[int, int]:
    """(the plan's VRAM budget, what it leaves free of it for cache slots and the prefill
    offload: the budget less everything the plan counted on the device but what it held for
    the cache's slots and the offload's copies)."""
    plan = bundle.manifest.get("plan") or {}
    budget = int((plan.get("hardware") or {}).get("vram_bytes") or 0)
    vram = (plan.get("memory") or {}).get("vram") or {}
    return budget, budget - sum(int(v) for k, v in vram.items() if k not in _HELD_FOR_STREAMING)


def _prefill_offload(bundle: Bundle) -> Any:
    """The prefill offload of a model from ``bundle``, with its plan's bandwidths and threshold
    (the hardware profile's defaults and llama.cpp's 32 where it was not planned); its budget is
    set once the slots are known."""
    from ktc.formats.hardware_profile import HardwareProfile

    from .offload import LLAMA_CPP_MIN_TOKENS, PrefillOffload

    plan = bundle.manifest.get("plan") or {}
    hardware = plan.get("hardware") or {}
    defaults = HardwareProfile(vram_bytes=0, ram_bytes=0)
    # the plan's threshold (``ktc.streaming``) where it made one, else llama.cpp's
    min_tokens = int((plan.get("streaming") or {}).get("prefill_min_tokens") or LLAMA_CPP_MIN_TOKENS)
    return PrefillOffload(float(hardware.get("pcie_bandwidth") or defaults.pcie_bandwidth),
                          float(hardware.get("cpu_bandwidth") or defaults.cpu_bandwidth), 0, min_tokens=min_tokens)


class _Loader:
    """Fills a meta-device model from a bundle (see ``from_bundle``)."""

    def __init__(self, transformers: Any, bundle: Bundle, model: Any, device: Any, dtype: Any, *,
                 interleave: bool = True) -> None:
        import torch

        self.interleave = interleave  # HostLinear's
        self.transformers = transformers
        self.bundle = bundle
        self.model = model
        self.device = device  # None: CPU only
        self.torch_device = torch.device("cpu") if device is None else device
        self.dtype = dtype
        self.device_bytes = 0
        self.keys = _source_keys(model, bundle)
        # transformers' GGUF tensor processor (None for other sources) and its row orders.
        self._processor = (gguf_processor(model, bundle.manifest["model"]["architecture"])
                           if bundle.manifest["provenance"]["source_format"] == "gguf" else None)
        self._orders: dict[str, np.ndarray | None] = {}
        strict = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        loose = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
        self.fp32_modules = strict | loose

    # -- experts -------------------------------------------------------------------------------

    def attach_experts(self, cache_slots: int | dict[int, int] = 0, cache_prior: Any = None,
                       offload: Any = None) -> list[ExpertSet]:
        """An ``ExpertSet`` for each of the model's experts modules; ``cache_slots``: the device
        slots of every MoE layer, or of each by layer number."""
        info = {i["layer"]: i for i in self.bundle.manifest["model"]["moe_layers"]}
        priors = {} if cache_prior is None else dict(zip(cache_prior.layers, cache_prior.counts))
        found: list[ExpertSet] = []
        from transformers.integrations import moe as hf_moe

        for name, module in self.model.named_modules():
            if not is_experts_module(module):
                continue
            match = _LAYER_INDEX.search(name + ".")
            layer = int(match.group(1)) if match else None
            if layer not in info:
                raise UnsupportedModelError(f"the model's experts module '{name}' has no MoE layer in the bundle "
                                            f"(bundle MoE layers: {sorted(info)[:8]})", path=self.bundle.path)
            self._check_experts(name, module, info[layer], hf_moe)
            compute = None if self.device is None else self.dtype
            try:
                experts = ExpertSet(self.bundle, layer, device=self.device, compute_dtype=compute,
                                    cache_slots=(cache_slots.get(layer, 0) if isinstance(cache_slots, dict)
                                                 else cache_slots),
                                    cache_prior=priors.get(layer), offload=offload,
                                    interleave=self.interleave)
            except BaseException:
                for done in found:
                    done.close()
                raise
            module._ktc_experts = experts
            for pname in list(module._parameters):
                module._parameters[pname] = None
            found.append(experts)
        missing = sorted(set(info) - {e.layer for e in found})
        if missing:
            raise UnsupportedModelError(
                f"transformers' {type(self.model).__name__} does not route the experts of layers {missing[:8]} "
                "through its experts interface, so ktc cannot serve them", path=self.bundle.path)
        return found

    def _check_experts(self, name: str, module: Any, info: dict[str, Any], hf_moe: Any) -> None:
        problems = []
        if not module.has_gate:
            problems.append("experts without a gate projection")
        if getattr(module, "has_post_expert_norm", False):
            problems.append("a norm after each expert")
        custom_gate = type(module)._apply_gate is not hf_moe._default_apply_gate
        if info["activation"] == "swiglu_clamped":
            if not custom_gate:
                problems.append("plain SiLU experts for a bundle compiled with gpt-oss's clamped SwiGLU")
        elif custom_gate:
            problems.append(f"a gating function of its own ({type(module).__name__}._apply_gate)")
        else:
            act = getattr(module, "act_fn", None)
            act_name = type(act).__name__.lower()
            if "silu" not in act_name and "swish" not in act_name:
                problems.append(f"the activation {type(act).__name__}, where ktc's kernels implement SiLU")
        gate_up = module._parameters.get("gate_up_proj")
        if gate_up is not None:
            shape = tuple(gate_up.shape)
            want = {info["num_experts"], 2 * info["intermediate_size"]}
            if shape[0] != info["num_experts"] or not want <= set(shape):
                problems.append(f"experts of shape {shape}; the bundle has {info['num_experts']} experts of "
                                f"width {info['intermediate_size']}")
        if problems:
            raise UnsupportedModelError(f"'{name}' ({type(module).__name__}) has " + "; ".join(problems),
                                        path=self.bundle.path)

    # -- everything else -----------------------------------------------------------------------

    def fill(self) -> None:
        """Non-expert parameters and persistent buffers from the bundle; linear layers and the
        input embedding as ktc modules where the bundle's scheme asks for it."""
        import torch

        model = self.model
        embedding = model.get_input_embeddings()
        output = model.get_output_embeddings()
        replaced: set[str] = set()
        for name, module in list(model.named_modules()):
            if is_experts_module(module) or name in replaced:
                continue
            if module is embedding:
                self._replace(name, self._embedding(name, module))
                replaced.add(name)
            elif type(module) is torch.nn.Linear:  # subclasses (routers) have forwards of their own
                new = self._linear(name, module, tied=module is output)
                if new is not None:
                    self._replace(name, new)
                replaced.add(name)
        for name, module in model.named_modules():
            if is_experts_module(module) or name in replaced:
                continue
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                key = f"{name}.{pname}" if name else pname
                values = self._values(key, tuple(param.shape))
                module._parameters[pname] = torch.nn.Parameter(self._place(values, key), requires_grad=False)
            for bname, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                key = f"{name}.{bname}" if name else bname
                persistent = bname not in module._non_persistent_buffers_set
                if persistent and key in self.keys:
                    module._buffers[bname] = self._place(self._values(key, tuple(buf.shape)), key)
                elif buf.device.type == "meta":
                    raise BundleError(f"the bundle has no tensor for the model's buffer '{key}'",
                                      path=self.bundle.path)
                elif self.device is not None and buf.device != self.torch_device:
                    module._buffers[bname] = buf.to(self.torch_device)

    def _replace(self, name: str, new: Any) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, new)

    def _kv_b_from_split(self, name: str) -> np.ndarray | None:
        """DeepSeek's MLA key/value up-projection ``name`` (``model.layers.N.self_attn.kv_b_proj``)
        as float32 [heads * (nope + v), kv_lora_rank], from the halves llama.cpp's converter
        stores in its place since MLA's absorption: ``blk.N.attn_k_b`` (each head's key rows,
        transposed: [heads, kv_lora_rank, nope]) and ``blk.N.attn_v_b`` ([heads, v, kv_lora_rank]);
        None where the bundle has no such halves."""
        parts = name.split(".")
        if not name.endswith("self_attn.kv_b_proj") or "layers" not in parts:
            return None
        layer = parts[parts.index("layers") + 1]
        k_name, v_name = (self.bundle.by_source.get(f"blk.{layer}.attn_{half}_b.weight") for half in ("k", "v"))
        if k_name is None or v_name is None:
            return None
        config = self.model.config
        heads, lora = config.num_attention_heads, config.kv_lora_rank
        nope, v = config.qk_nope_head_dim, config.v_head_dim
        k_b = self.bundle.tensor_float32(k_name).reshape(heads, lora, nope)
        v_b = self.bundle.tensor_float32(v_name).reshape(heads, v, lora)
        return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, lora),
                                    dtype=np.float32)

    def _tensor_for(self, key: str) -> str:
        tensor = self.keys.get(key)
        if tensor is None:
            raise BundleError(f"the bundle has no tensor for the model's parameter '{key}'", path=self.bundle.path,
                              hint="the bundle was compiled from a checkpoint that does not match its config")
        return tensor

    def _row_order(self, tensor: str) -> np.ndarray | None:
        if self._processor is None:
            return None
        if tensor not in self._orders:
            self._orders[tensor] = _gguf_row_order(self.bundle, tensor, self._processor)
        return self._orders[tensor]

    def _raw(self, tensor: str) -> np.ndarray:
        """The stored rows of a tensor, zero-copy unless a GGUF row reordering applies."""
        raw = self.bundle.tensor(tensor)
        order = self._row_order(tensor)
        return raw if order is None else np.ascontiguousarray(raw[order])

    def _values(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = self._tensor_for(key)
        t = self.bundle.tensors[tensor]
        if int(np.prod(t.shape)) != int(np.prod(shape)):
            raise BundleError(f"tensor '{tensor}' has shape {list(t.shape)}; the model's '{key}' is {list(shape)}",
                              path=self.bundle.path)
        values = self.bundle.tensor_float32(tensor)
        order = self._row_order(tensor)
        if order is not None:
            values = values[order]
        return values.reshape(shape)

    def _place(self, values: np.ndarray, key: str) -> Any:
        """A float32 array as the model's tensor: zero-copy on the host, one upload otherwise."""
        import torch

        tensor = torch.from_numpy(values)
        if self.device is None:
            return tensor
        keep32 = any(part in key for part in self.fp32_modules)
        placed = tensor.to(self.torch_device, torch.float32 if keep32 else self.dtype)
        self.device_bytes += placed.numel() * placed.element_size()
        return placed

    def _linear(self, name: str, module: Any, *, tied: bool) -> Any:
        import torch

        from .linear import DeviceLinear, HostLinear

        key = f"{name}.weight"
        joined = self._kv_b_from_split(name) if key not in self.keys else None
        if joined is not None:  # f32 [out, in], made here from the two halves llama.cpp stores
            if joined.shape != (module.out_features, module.in_features):
                raise BundleError(f"the key and value halves of '{name}' make {list(joined.shape)}; the model's is "
                                  f"[{module.out_features}, {module.in_features}]", path=self.bundle.path)
            if self.device is None:
                return HostLinear(joined, "f32", module.in_features, module.out_features, None)
            module.weight = torch.nn.Parameter(self._place(joined, key), requires_grad=False)
            return module
        if key not in self.keys and tied and getattr(self.model.config, "tie_word_embeddings", False):
            embed_name = next(n for n, m in self.model.named_modules() if m is self.model.get_input_embeddings())
            key = f"{embed_name}.weight"
        tensor = self._tensor_for(key)
        t = self.bundle.tensors[tensor]
        if tuple(t.shape) != (module.out_features, module.in_features):
            raise BundleError(f"tensor '{tensor}' has shape {list(t.shape)}; the model's '{name}' is "
                              f"[{module.out_features}, {module.in_features}]", path=self.bundle.path)
        bias = None
        if module.bias is not None:
            bias_values = torch.from_numpy(self._values(f"{name}.bias", (module.out_features,)))
            bias = bias_values if self.device is None else self._place(bias_values.numpy(), f"{name}.bias")
        if self.device is None:
            linear = HostLinear(self._raw(tensor), t.scheme, module.in_features, module.out_features, bias,
                                interleave=self.interleave)
            if linear.interleaved is not None:  # the map's pages of it are no longer read
                # (a tied embedding's lookups read a row again where they need it)
                self.bundle.release(tensor)
            return linear
        if t.scheme in ("f32", "bf16", "f16"):  # a plain nn.Linear on the device
            weight = self._values(key, (module.out_features, module.in_features))
            module.weight = torch.nn.Parameter(self._place(weight, key), requires_grad=False)
            if bias is not None:
                module.bias = torch.nn.Parameter(bias, requires_grad=False)
            return module
        raw = np.ascontiguousarray(self._raw(tensor)).view(np.uint8).reshape(t.shape[0], -1)
        uploaded = torch.from_numpy(raw).to(self.torch_device)
        self.device_bytes += uploaded.numel()
        return DeviceLinear(uploaded, t.scheme, module.in_features, module.out_features, self.dtype, bias)

    def _embedding(self, name: str, module: Any) -> Any:
        from .linear import BundleEmbedding

        key = f"{name}.weight"
        tensor = self._tensor_for(key)
        t = self.bundle.tensors[tensor]
        scale = getattr(module, "embed_scale", None)  # models that scale their embeddings (Gemma)
        scale = None if scale is None else float(scale)
        return BundleEmbedding(self._raw(tensor), t.scheme, t.shape[0], t.shape[1],
                               device=self.torch_device, dtype=self.dtype, scale=scale)

