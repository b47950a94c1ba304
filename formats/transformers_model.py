"""A checkpoint as transformers sees it: its model class built from ``config.json`` on the meta
device (no memory), and the checkpoint's tensor names mapped onto that model's parameters the
way transformers' own loading maps them (its checkpoint conversion mapping for Hugging Face
names, its GGUF name map for llama.cpp's). Detection reads experts from this structure, and the
runtime fills models through the same name map.

transformers is optional (``pip install 'ktc[hf]'``): ``import_transformers`` says what to
install when it is missing or older than the experts interface ktc needs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ktc.errors import KtcError, UnsupportedModelError

MIN_TRANSFORMERS = (5, 7)  # the first release whose experts interface accepts registered names


def import_transformers() -> Any:
    """transformers, or a ``KtcError`` naming what to install."""
    try:
        import transformers
    except ImportError:
        raise KtcError("this needs transformers, which is not installed", hint="pip install 'ktc[hf]'") from None
    numbers = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    if numbers < MIN_TRANSFORMERS:
        raise KtcError(f"transformers {transformers.__version__} is older than the experts interface ktc "
                       f"plugs into ({'.'.join(map(str, MIN_TRANSFORMERS))})",
                       hint="pip install -U 'transformers>=5.7'")
    try:
        from transformers.integrations.moe import ExpertsInterface  # noqa: F401
    except ImportError as e:  # a new enough release whose experts module does not import here
        raise KtcError(f"transformers {transformers.__version__}'s experts interface does not import: {e}",
                       hint="a module of the same name as one transformers imports may come first on sys.path "
                            "(the script's own folder, or the current one)") from e
    return transformers


def transformers_available() -> bool:
    try:
        import_transformers()
    except KtcError:
        return False
    return True


def config_from_dict(transformers: Any, raw: Mapping[str, Any], path: str | None = None) -> Any:
    """transformers' config object of a ``config.json`` dict."""
    model_type = raw.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise UnsupportedModelError(f"transformers {transformers.__version__} does not know model type "
                                    f"{model_type!r}", path=path)
    return transformers.CONFIG_MAPPING[model_type].from_dict(dict(raw))


def meta_model(transformers: Any, config: Any, *, dtype: Any = None, experts_implementation: str | None = None,
               buffers: bool = False, path: str | None = None) -> Any:
    """The causal-LM model class of ``config`` on the meta device (nothing allocated, whatever
    the model's size), in eval mode. With ``buffers`` the tables a model computes rather than
    loads (rotary frequencies) are made real on the CPU, by transformers' own initialisation
    (what ``from_pretrained`` does for them)."""
    import torch
    from transformers.initialization import no_init_weights

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device("meta"), no_init_weights():
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError as exc:
            raise UnsupportedModelError(f"transformers cannot build a causal LM of model type "
                                        f"{config.model_type!r} ({exc})", path=path) from None
    if buffers:
        computed = []
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device.type == "meta" and name in module._non_persistent_buffers_set:
                    module._buffers[name] = torch.empty_like(buf, device="cpu")
                    if not computed or computed[-1] is not module:
                        computed.append(module)
        with torch.no_grad():
            for module in computed:
                model._init_weights(module)
    return model.eval()


def is_experts_module(module: Any) -> bool:
    """Whether ``module`` is an experts class decorated with ``@use_experts_implementation``
    (the attributes the decorator sets in every transformers since 5.7; ``_is_expert_parallel``
    came later and is not needed)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def hf_name_map(model: Any) -> Any:
    """A function from a Hugging Face checkpoint name to (the model's parameter or buffer name,
    the converter source pattern that matched or None), by transformers' conversion mapping."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict(keep_vars=True)

    def rename(name: str) -> tuple[str, str | None]:
        return rename_source_key(name, renamings, converters, model.base_model_prefix, meta)

    return rename


def gguf_name_map(model: Any, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by transformers' GGUF name map."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    # The GGUF architecture, not the model's type: llama.cpp writes Mixtral as "llama".
    names = get_gguf_hf_weights_map(model, gguf_processor(model, architecture), model_type=architecture)
    # A parameter named without a .weight or .bias suffix (gpt-oss's attention sinks, self_attn.sinks;
    # DeepSeek-V3's e_score_correction_bias) is keyed here without one too, where llama.cpp's
    # converter writes it with one (blk.N.attn_sinks.weight, blk.N.exp_probs_b.bias): a gpt-oss
    # GGUF's bundle refused to load without its sinks.
    for gguf_name, hf_name in list(names.items()):
        if not gguf_name.endswith((".weight", ".bias")):
            names.setdefault(gguf_name + ".weight", hf_name)
            names.setdefault(gguf_name + ".bias", hf_name)
    # DeepSeek-V3's router bias, e_score_correction_bias, which llama.cpp's converter renames
    # e_score_correction.bias before mapping it (blk.N.exp_probs_b.bias): transformers' map has
    # no name for it
    import gguf

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch is not None:
        tensor_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
        mapped = set(names.values())
        for hf_name in model.state_dict():
            if hf_name.endswith("_bias") and hf_name not in mapped:
                found = tensor_map.get_name(hf_name[: -len("_bias")])
                if found is not None:
                    names.setdefault(found + ".bias", hf_name)
    return names


def gguf_processor(model: Any, architecture: str) -> Any:
    """transformers' tensor processor for a GGUF architecture (what reorders llama's Q/K rows)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
