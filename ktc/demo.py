"""The built-in demo model: a small Qwen3-MoE-style checkpoint that ktc writes itself, trained
(with transformers installed) on ``demo_corpus.txt``, a snapshot of the prose of ktc's own
documentation, so that its text is made of words, its routing is skewed the way a trained model's
is, and a profile recorded from text changes its plan. The training is deterministic for a given
torch build and cached (``default_cache_dir()``); it takes about a minute on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import numpy as np

DEMO_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


# The text the demo tokenizer is trained on (and the demo's prompts come from): a few paragraphs
# about serving Mixture-of-Experts models, written for ktc.
DEMO_TEXT = """\
A Mixture-of-Experts model replaces the feed-forward block of a transformer layer with many
small experts and a router. For every token the router scores the experts and picks a few of
them; only the chosen experts run, so a model with hundreds of billions of weights reads a few
billion of them per token. That is why such a model can run on one GPU beside a large CPU: the
experts that are used most often live in the GPU's memory, the rest live in the CPU's memory,
and each token reads only the experts it was routed to.

Decoding one token is bound by memory bandwidth. The time of a step is the bytes it reads over
the speed at which the memory delivers them. A GPU reads its memory ten times faster than a CPU
reads its own, so every expert moved to the GPU makes the step shorter, until the GPU is full.
The key and value cache grows with the context, and it has to fit in the same memory.

Prefill is bound by arithmetic. A long prompt sends many tokens to every expert at once, and
the experts then run as matrix products instead of matrix-vector products. The CPU's vector
units and the GPU's tensor cores both matter here.

Quantization stores the weights in fewer bits: eight bits per weight halves the bytes of a
bfloat16 expert, four bits quarter them. Fewer bytes mean faster steps and more experts on the
GPU, at a small cost in accuracy that a careful compiler measures instead of guessing.

A compiler for such models reads the checkpoint, finds the experts, decides which of them go on
the GPU under a memory budget, quantizes each one for the device that will run it, and writes
one file that a small runtime maps into memory and serves. The plan is exact: the weights, the
cache and a reserve are counted byte by byte, so the model either fits or the compiler says why
it does not, and by how much.
"""


DEMO_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_corpus.txt")
HELD_OUT = 0.1  # the corpus' last paragraphs kept from training: the demo profiles and scores them
# The demo model's training: AdamW over random windows of the training text, cosine schedule.
TRAIN = {"steps": 240, "batch": 8, "seq": 128, "lr": 3e-3, "warmup": 20, "seed": 0}


def demo_corpus() -> tuple[str, str]:
    """(the training text, the held-out text): ``DEMO_TEXT`` and the corpus' paragraphs but the
    last tenth, which is held out."""
    with open(DEMO_CORPUS, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    held = max(1, int(len(paragraphs) * HELD_OUT))
    return DEMO_TEXT + "\n\n" + "\n\n".join(paragraphs[:-held]) + "\n", "\n\n".join(paragraphs[-held:]) + "\n"


def demo_tokenizer_files(vocab_size: int) -> dict[str, bytes]:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens trained on the demo's training
    text (deterministic), saved the way transformers saves one. Needs transformers (the ``hf``
    extra); without it the demo model has no tokenizer and cannot run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([demo_corpus()[0]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with tempfile.TemporaryDirectory() as folder:
        fast.save_pretrained(folder)
        return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def default_cache_dir() -> str:
    """``$KTC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ktc``, else ``~/.cache/ktc``."""
    if os.environ.get("KTC_CACHE_DIR"):
        return os.environ["KTC_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ktc")


def demo_tensors(config: dict[str, object], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights named as Hugging Face names Qwen3-MoE's, scaled like an init."""
    rng = np.random.default_rng(seed)
    h = int(config["hidden_size"])  # type: ignore[arg-type]
    inter = int(config["moe_intermediate_size"])  # type: ignore[arg-type]
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])  # type: ignore[arg-type]
    head_dim = int(config["head_dim"])  # type: ignore[arg-type]
    vocab, experts = int(config["vocab_size"]), int(config["num_experts"])  # type: ignore[arg-type]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": w(vocab, h),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": w(vocab, h),
    }
    for layer in range(int(config["num_hidden_layers"])):  # type: ignore[arg-type]
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, h)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, h)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, h)
        t[p + "self_attn.o_proj.weight"] = w(h, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "mlp.gate.weight"] = w(experts, h)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = w(inter, h)
            t[q + "up_proj.weight"] = w(inter, h)
            t[q + "down_proj.weight"] = w(h, inter)
    return t


def trained_demo_tensors(config: dict[str, object] = DEMO_CONFIG, *, steps: int | None = None,
                         progress: bool = False) -> dict[str, np.ndarray]:
    """The demo model's float32 weights after training on the demo's training text (``TRAIN``;
    ``steps`` overrides its steps), named as Hugging Face names Qwen3-MoE's per expert; from the
    cache when it holds them (keyed by the text, the config, the recipe and the torch version),
    else trained and cached. Needs transformers."""
    import torch
    from safetensors.numpy import load_file, save_file

    from ktc.passes.emit import new_file_mode

    recipe = TRAIN | ({"steps": steps} if steps else {})
    text = demo_corpus()[0]
    key = hashlib.sha256(json.dumps([config, recipe, text, torch.__version__], sort_keys=True).encode()).hexdigest()
    path = os.path.join(default_cache_dir(), f"demo-trained-{key[:16]}.safetensors")
    if os.path.exists(path):
        return load_file(path)
    tensors = _train(config, recipe, text, progress)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-demo-trained-")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return tensors


def _train(config: dict[str, object], recipe: dict[str, float], text: str, progress: bool) -> dict[str, np.ndarray]:
    """Trains transformers' Qwen3-MoE of ``config`` on ``text`` (next-token loss, AdamW over
    random windows, warm-up then cosine decay) and returns its weights per expert. Written here:
    a short loop, no trainer package needed."""
    import math

    import torch
    from tokenizers import Tokenizer

    from ktc.runtime.hf import require_transformers

    transformers = require_transformers()
    tokenizer = Tokenizer.from_str(demo_tokenizer_files(int(config["vocab_size"]))["tokenizer.json"].decode())  # type: ignore[arg-type]
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int64)
    steps, batch, seq = int(recipe["steps"]), int(recipe["batch"]), int(recipe["seq"])
    torch.manual_seed(int(recipe["seed"]))
    settings = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings)).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(recipe["lr"]), betas=(0.9, 0.95), weight_decay=0.0)
    warmup = int(recipe["warmup"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = np.random.default_rng(int(recipe["seed"]))
    deterministic = torch.are_deterministic_algorithms_enabled()
    # the experts' scatter-adds sum in thread order otherwise: weights differed by 5e-4 in 6 steps
    torch.use_deterministic_algorithms(True)
    try:
        _steps(model, optimizer, schedule, ids, rng, steps, batch, seq, progress)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return _per_expert({k: v.detach().float().numpy() for k, v in model.state_dict().items()}, config)


def _steps(model: Any, optimizer: Any, schedule: Any, ids: np.ndarray, rng: np.random.Generator, steps: int,
           batch: int, seq: int, progress: bool) -> None:
    import torch
    from tqdm import tqdm

    with tqdm(total=steps, desc="training the demo model", unit="step", disable=None if progress else True,
              leave=False) as bar:
        for _ in range(steps):
            starts = rng.integers(0, len(ids) - seq - 1, batch)
            x = torch.from_numpy(np.stack([ids[a:a + seq] for a in starts]))
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.2f}")
            bar.update(1)


def _per_expert(state: dict[str, np.ndarray], config: dict[str, object]) -> dict[str, np.ndarray]:
    """transformers' fused experts (``experts.gate_up_proj`` [E, 2I, H]: gate rows then up rows;
    ``experts.down_proj`` [E, H, I]) as the per-expert tensors Qwen3-MoE checkpoints hold."""
    inter = int(config["moe_intermediate_size"])  # type: ignore[arg-type]
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :inter])
                out[f"{prefix}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, inter:])
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            out[name] = np.ascontiguousarray(value)
    return out


def write_demo_model(folder: str, *, seed: int = 0, trained: bool = False, progress: bool = False,
                     config: dict[str, object] | None = None) -> str:
    """Write the demo checkpoint (``model.safetensors``, ``config.json``, and with transformers
    installed a tokenizer) into ``folder``: random weights (``seed``), or with ``trained`` the
    weights ``trained_demo_tensors`` gives (``progress``: a bar while it trains). ``config``:
    another Qwen3-MoE shape than ``DEMO_CONFIG`` (random weights only; ``ktc doctor
    --calibrate`` times such models).

    Files are written beside their final names and renamed into place, so an interrupted run
    never leaves a half-written model that a later run would take as complete.
    """
    from safetensors.numpy import save_file

    from ktc.passes.emit import new_file_mode

    os.makedirs(folder, exist_ok=True)
    model_path = os.path.join(folder, "model.safetensors")
    config_path = os.path.join(folder, "config.json")
    if trained and config is not None:
        raise ValueError("the trained demo model has the demo's shape")
    config = DEMO_CONFIG if config is None else config
    tensors = trained_demo_tensors(progress=progress) if trained else demo_tensors(config, seed)
    writers = [
        (model_path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})),
        (config_path, lambda tmp: _write_json(tmp, config)),
    ]
    try:
        files = demo_tokenizer_files(int(config["vocab_size"]))  # type: ignore[arg-type]
    except ImportError:
        files = {}
    for name, data in files.items():
        writers.append((os.path.join(folder, name), lambda tmp, data=data: _write_bytes(tmp, data)))
    for final, write in writers:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(final))
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, new_file_mode())  # mkstemp's files are private; a model's are not
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return folder


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_json(path: str, value: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")


def _hf_tensor_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a Mixtral, Qwen-MoE or DeepSeek-V3 model."""
    get = lambda key, default=0: int(config.get(key) or default)  # type: ignore[arg-type]  # noqa: E731
    h, layers, vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads", heads)
    head_dim = get("head_dim", h // heads)
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts")
    mixtral = config.get("model_type") == "mixtral"
    moe_inter = get("moe_intermediate_size") or get("intermediate_size")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (vocab, h)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.get("kv_lora_rank"):
            q_rank, kv_rank = get("q_lora_rank"), get("kv_lora_rank")
            nope, rope, v = get("qk_nope_head_dim"), get("qk_rope_head_dim"), get("v_head_dim")
            shapes.update({p + "self_attn.q_a_proj.weight": (q_rank, h),
                           p + "self_attn.q_a_layernorm.weight": (q_rank,),
                           p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
                           p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, h),
                           p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
                           p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
                           p + "self_attn.o_proj.weight": (h, heads * v)})
        else:
            shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, h),
                           p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
                           p + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
                           p + "self_attn.o_proj.weight": (h, heads * head_dim)})
        if layer < get("first_k_dense_replace"):
            inter = get("intermediate_size")
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
            continue
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        shapes[moe + "gate.weight"] = (experts, h)
        if config.get("n_routed_experts"):
            shapes[moe + "gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            q = f"{moe}experts.{e}."
            shapes[q + names[0] + ".weight"] = (moe_inter, h)
            shapes[q + names[1] + ".weight"] = (moe_inter, h)
            shapes[q + names[2] + ".weight"] = (h, moe_inter)
        shared = get("n_shared_experts")
        if shared:
            width = moe_inter * shared
            shapes.update({moe + "shared_experts.gate_proj.weight": (width, h),
                           moe + "shared_experts.up_proj.weight": (width, h),
                           moe + "shared_experts.down_proj.weight": (h, width)})
    return shapes


def write_sparse_checkpoint(config: dict[str, object], folder: str, dtype: str = "BF16") -> int:
    """Write ``config.json`` and a ``model.safetensors`` whose header describes the model's
    full-size tensors over a sparse file (no data blocks are written): a way to plan and inspect
    a model at its real size without its weights. Returns the bytes the header describes."""
    import struct

    from ktc.ir import STORAGE_TYPES

    os.makedirs(folder, exist_ok=True)
    header: dict[str, object] = {}
    offset = 0
    for name, shape in _hf_tensor_shapes(config).items():
        nbytes = STORAGE_TYPES[dtype].nbytes(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    _write_json(os.path.join(folder, "config.json"), config)
    return offset
