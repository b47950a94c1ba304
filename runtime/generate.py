"""Text generation from a bundle's model (``ktc run``): prefill in chunks of the plan's prefill
size, then one token per step with the preallocated KV cache, sampling, streaming text, and the
timings users compare with llama.cpp's (prompt tokens/s, generated tokens/s, time to first token).

The loop calls the transformers model's forward directly rather than ``generate()`` (which
works too): a decode step then costs the model's forward and a sample, nothing else, and the
timings measure exactly that.
"""

from __future__ import annotations

import inspect
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktc.errors import KtcError

from .hf import KtcModel


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature`` is 0, else softmax sampling at
    ``temperature`` among the ``top_k`` most likely (0: all) within top-p mass ``top_p``."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise KtcError(f"--temperature must be a number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise KtcError(f"--top-k must be >= 0 (0: no limit), not {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise KtcError(f"--top-p must be in (0, 1], not {self.top_p}")


@dataclass
class Generation:
    """What one generation did: the token ids, the text, and its timings (seconds)."""

    prompt_tokens: int
    generated_tokens: list[int] = field(default_factory=list)
    text: str = ""
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0  # the decode steps' forwards and samples (not printing)
    load_seconds: float = 0.0  # the first generation's load of ktc's compiled decode step (FastDecode.warm)
    stopped: str = "length"  # "eos" or "length"

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(self.generated_tokens) - 1, 0)  # the first token comes from the prefill
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def sample(logits: Any, sampling: Sampling, generator: Any) -> int:
    """One token id from ``logits`` [vocab] (float32; a torch tensor or, from ktc's own decode
    step, a numpy array)."""
    import torch

    if sampling.temperature == 0:  # numpy: one thread, no parallel region to wake
        # a numpy array as it is: inside a decode step torch's conversions took 0.1-0.2 ms a token
        # (their code evicted from the caches by the weights)
        return int(np.argmax(logits if isinstance(logits, np.ndarray) else logits.detach().float().numpy()))
    if isinstance(logits, np.ndarray):
        logits = torch.from_numpy(logits)
    scores = logits.float().reshape(-1) / sampling.temperature
    # The candidates in descending order: the top_k of them when there is a limit (sorting and
    # drawing from all of a 151936-token vocabulary took 7 ms a token here, 0.5 ms now: more
    # than the kernels of a one-layer decode step), all of them when top-p needs an order, else
    # the scores as they are.
    order = None
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        scores, order = torch.topk(scores, sampling.top_k)
    elif sampling.top_p < 1:
        scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        keep = torch.cumsum(probs, dim=-1) - probs < sampling.top_p  # always keeps the first
        probs = probs * keep
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return choice if order is None else int(order[choice])


class Detokenizer:
    """Text of a growing list of token ids, handed out as it becomes final: a token that ends
    inside a multi-byte character is held until the character is complete."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def eos_ids(km: KtcModel) -> set[int]:
    """Token ids that end a generation (the generation config's, else the model config's)."""
    ids: set[int] = set()
    for source in (getattr(km.model, "generation_config", None), km.model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
        if ids:
            break
    if not ids and getattr(km.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(km.tokenizer.eos_token_id))
    return ids


def encode_prompt(model: KtcModel | Any, prompt: str, *, chat: bool = False) -> list[int]:
    """The prompt's token ids (through the chat template with ``chat``); ``model`` is a
    ``KtcModel`` or a tokenizer."""
    tokenizer = model.tokenizer if isinstance(model, KtcModel) else model
    if not prompt or not prompt.strip():
        raise KtcError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise KtcError("--chat: the bundle's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise KtcError("the prompt encodes to no tokens")
    return ids


def generate(km: KtcModel, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling = Sampling(),
             on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_text`` receives the
    text as it is generated, ``on_token`` each token id (both outside the timed steps). A
    request longer than the KV capacity is refused before anything runs."""
    import torch

    if max_new_tokens < 1:
        raise KtcError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    if not prompt_ids:
        raise KtcError("the prompt is empty")
    km.check_capacity(len(prompt_ids), max_new_tokens)
    model = km.model
    forward_kwargs = {"use_cache": True}
    parameters = inspect.signature(model.forward).parameters
    if "logits_to_keep" in parameters:
        forward_kwargs["logits_to_keep"] = 1
    cache_arg = km.cache_argument
    generator = torch.Generator()
    if sampling.seed is not None:
        generator.manual_seed(sampling.seed)
    stops = eos_ids(km) if stop_at_eos else set()
    detok = Detokenizer(km.tokenizer)
    result = Generation(prompt_tokens=len(prompt_ids))
    device = km.input_device
    if km.fast is not None and not km.fast.warmed:  # outside the timings, which it would swell
        began = time.perf_counter()
        km.fast.warm(km.experts)
        result.load_seconds = time.perf_counter() - began
    cache = km.new_cache()
    with torch.inference_mode():
        started = time.perf_counter()
        # the prompt in prefill chunks into the cache, the last position's logits only
        last = km.forward_window(np.asarray(prompt_ids, dtype=np.int64), len(prompt_ids) - 1, len(prompt_ids))
        result.prefill_seconds = time.perf_counter() - started
        token = sample(torch.from_numpy(last[0]), sampling, generator)
        result.ttft_seconds = time.perf_counter() - started
        ids = torch.zeros((1, 1), dtype=torch.long)
        step_kwargs = {cache_arg: cache, **forward_kwargs}
        while True:
            result.generated_tokens.append(token)
            if on_token is not None:
                on_token(token)
            if on_text is not None:
                piece = detok.add(token)
                if piece:
                    on_text(piece)
            else:
                detok.ids.append(token)
            if token in stops:
                result.stopped = "eos"
                break
            if len(result.generated_tokens) >= max_new_tokens:
                break
            step = time.perf_counter()
            if km.fast is not None:  # ktc's own decode step (runtime.fast_decode), numpy logits
                token = sample(km.fast.step(token), sampling, generator)
            else:
                ids[0, 0] = token  # one input tensor for every step (host memory, copied if on a device)
                logits = model(input_ids=ids.to(device), **step_kwargs).logits[0, -1]
                token = sample(logits if logits.device.type == "cpu" else logits.cpu(), sampling, generator)
            result.decode_seconds += time.perf_counter() - step
    result.text = detok.text()
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_device_bytes(km: KtcModel) -> int | None:
    """Peak bytes allocated on a CUDA device (torch's allocator), None elsewhere."""
    if km.device is None or getattr(km.device, "type", "") != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(km.device))
