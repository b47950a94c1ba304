"""Perplexity of a bundle's model over a text, and its KL divergence from a reference model's
token distributions, computed as ``llama-perplexity`` (and its ``--kl-divergence``) computes them
so that the two tools' figures compare on the same text and tokenizer.

The convention: the text is tokenized once, cut into non-overlapping windows of ``ctx`` tokens
(the last partial window dropped); where the tokenizer starts a text with BOS, each window's first
token is replaced by BOS. Each window runs from an empty KV cache, and only its second half is
scored: the logits at positions ``ctx // 2`` to ``ctx - 2`` against the tokens one position later
(``ctx - 1 - ctx // 2`` tokens a window), so every scored token has at least half a window of
context. Perplexity is ``exp`` of the mean negative log-likelihood, its ± the standard error of
that mean carried through ``exp`` (``llama-perplexity``'s ``PPL = x +/- y``).

Against a reference (another bundle, a checkpoint transformers runs, or log-probabilities saved
by ``save_logprobs``), on the same windows and scored positions: per token the KL divergence
``sum p_ref (log p_ref - log p)`` over the vocabulary, whether both models' most likely tokens
agree, and the change of the correct token's probability ``p - p_ref``; reported as mean (±
standard error), median, 99th percentile and maximum KLD, top-1 agreement (±), and the RMS of the
probability change (±), as ``llama-perplexity --kl-divergence`` reports them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktc.errors import FormatError, KtcError

LOGPROBS_FORMAT = "ktc-logprobs"
LOGPROBS_VERSION = 1
_MAGIC = b"KTCLOGP\x01"
_ALIGN = 64


@dataclass(frozen=True)
class Windows:
    """The text's windows: ``tokens`` [windows, ctx] (BOS first where the tokenizer adds it)."""

    tokens: np.ndarray
    ctx: int

    @property
    def first(self) -> int:
        """The first scored logit's position in a window."""
        return self.ctx // 2

    @property
    def scored(self) -> int:
        """Tokens scored a window."""
        return self.ctx - 1 - self.first

    def targets(self, w: int) -> np.ndarray:
        """The tokens window ``w``'s scored logits predict."""
        return self.tokens[w, self.first + 1:]


def make_windows(ids: list[int] | np.ndarray, ctx: int, *, bos: int | None = None,
                 max_windows: int | None = None) -> Windows:
    """``ids`` cut into ``len(ids) // ctx`` windows of ``ctx`` (at most ``max_windows``)."""
    if ctx < 4:
        raise KtcError(f"--ctx must be at least 4 tokens, not {ctx}")
    ids = np.asarray(ids, dtype=np.int64)
    count = len(ids) // ctx
    if max_windows is not None:
        count = min(count, max_windows)
    if count < 1:
        raise KtcError(f"the text has {len(ids)} tokens: fewer than one window of --ctx {ctx}",
                       hint="give a longer text or a smaller --ctx")
    tokens = ids[:count * ctx].reshape(count, ctx).copy()
    if bos is not None:
        tokens[:, 0] = bos
    return Windows(tokens, ctx)


def tokenize(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """(the text's token ids, BOS first where the tokenizer starts a text with one, as
    llama-perplexity tokenizes it; that BOS id, else None)."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        probe_with = tokenizer("a").input_ids
        probe_without = tokenizer("a", add_special_tokens=False).input_ids
        if not (len(probe_with) > len(probe_without) and probe_with[0] == bos):
            bos = None
    return ([bos] if bos is not None else []) + ids, bos


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, returned as float32."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z.astype(np.float32)


# A model's scored log-probabilities of one window: window tokens [ctx] -> float32 [scored, vocab]
WindowFn = Callable[[np.ndarray], np.ndarray]


@contextmanager
def bundle_scorer(path: str, windows_ctx: int, *, threads: int | None = None, batch: int | None = None,
                  tokenizer: Any = None) -> Iterator[WindowFn]:
    """Log-probabilities of a window's scored positions by the bundle at ``path``: each window
    from an empty KV cache, ``batch`` tokens a forward (default: the bundle's prefill chunk)."""
    from .hf import from_bundle

    with from_bundle(path, threads=threads, tokenizer=tokenizer) as km:
        km.check_capacity(windows_ctx, 0)
        first = windows_ctx // 2
        yield lambda window: log_softmax(km.forward_window(window, first, len(window) - 1, batch))


@contextmanager
def checkpoint_scorer(path: str, windows_ctx: int) -> Iterator[WindowFn]:
    """The same for a checkpoint transformers loads (``from_pretrained``, float32), each window
    in one forward without a cache."""
    import torch

    from .hf import require_transformers

    transformers = require_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as exc:  # transformers raises many types for a checkpoint it cannot load
        raise KtcError(f"transformers cannot load the reference ({type(exc).__name__}: {exc})", path=path) from None
    first = windows_ctx // 2

    def run(window: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = model(input_ids=torch.as_tensor(window[None, :]), use_cache=False).logits[0]
        return log_softmax(logits[first:-1].float().numpy())

    yield run


# ----------------------------------------------------------------------------------------------
# Saved log-probabilities (llama-perplexity's --kl-divergence-base)


class LogprobWriter:
    """Writes a reference's log-probabilities window by window into ``path`` (a temporary file
    beside it, renamed at ``close``: an interrupted run leaves no partial file)."""

    def __init__(self, path: str, windows: Windows, vocab: int, source: str) -> None:
        self.path = path
        self.tmp = f"{path}.ktc-{os.getpid()}.tmp"
        header = json.dumps({"format": LOGPROBS_FORMAT, "version": LOGPROBS_VERSION, "ctx": windows.ctx,
                             "windows": int(windows.tokens.shape[0]), "vocab": vocab, "source": source,
                             "tokens": windows.tokens.reshape(-1).tolist()}).encode()
        start = len(_MAGIC) + 8 + len(header)
        pad = (-start) % _ALIGN
        self.file = open(self.tmp, "wb")
        self.file.write(_MAGIC + struct.pack("<Q", len(header) + pad) + header + b" " * pad)

    def add(self, logprobs: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(logprobs, dtype="<f4").tobytes())

    def close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def read_logprobs(path: str) -> tuple[dict[str, Any], np.ndarray]:
    """(header, log-probabilities [windows, scored, vocab] mapped from ``path``)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_MAGIC))
            if magic != _MAGIC:
                raise FormatError("not a ktc log-probabilities file (written by ktc perplexity --save-logits)",
                                  path=path)
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 1 << 32:
                raise FormatError("log-probabilities header too long", path=path)
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise FormatError(f"cannot read the log-probabilities: {exc}", path=path) from None
    if header.get("format") != LOGPROBS_FORMAT or header.get("version") != LOGPROBS_VERSION:
        raise FormatError(f"not a version {LOGPROBS_VERSION} {LOGPROBS_FORMAT} file", path=path)
    ctx, count, vocab = int(header["ctx"]), int(header["windows"]), int(header["vocab"])
    scored = ctx - 1 - ctx // 2
    offset = len(_MAGIC) + 8 + length
    expected = offset + count * scored * vocab * 4
    if os.path.getsize(path) != expected:
        raise FormatError(f"log-probabilities file is {os.path.getsize(path)} bytes; its header says {expected}",
                          path=path)
    data = np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=(count, scored, vocab))
    return header, data


# ----------------------------------------------------------------------------------------------
# Statistics


@dataclass
class Scores:
    """Running sums over scored tokens."""

    nll: list[float] = field(default_factory=list)
    ref_nll: list[float] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    same_top: list[bool] = field(default_factory=list)
    delta_p: list[float] = field(default_factory=list)

    def add(self, logprobs: np.ndarray, targets: np.ndarray, reference: np.ndarray | None = None) -> None:
        rows = np.arange(len(targets))
        self.nll.extend((-logprobs[rows, targets].astype(np.float64)).tolist())
        if reference is None:
            return
        ref = np.asarray(reference, dtype=np.float64)
        mine = logprobs.astype(np.float64)
        self.ref_nll.extend((-ref[rows, targets]).tolist())
        self.kld.extend(np.maximum((np.exp(ref) * (ref - mine)).sum(axis=-1), 0.0).tolist())
        self.same_top.extend((ref.argmax(axis=-1) == mine.argmax(axis=-1)).tolist())
        self.delta_p.extend((np.exp(mine[rows, targets]) - np.exp(ref[rows, targets])).tolist())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": len(self.nll)}
        out |= _perplexity(self.nll)
        if self.kld:
            ref = _perplexity(self.ref_nll)
            kld = np.array(self.kld)
            same = np.array(self.same_top, dtype=np.float64)
            dp = np.array(self.delta_p)
            n = len(kld)
            out["reference"] = {
                "perplexity": ref["perplexity"], "perplexity_error": ref["perplexity_error"],
                "kld_mean": float(kld.mean()), "kld_mean_error": _error(kld),
                "kld_median": float(np.median(kld)), "kld_p99": float(np.percentile(kld, 99)),
                "kld_max": float(kld.max()),
                "top1_agreement": float(same.mean()),
                "top1_agreement_error": float(math.sqrt(same.mean() * (1 - same.mean()) / (n - 1))) if n > 1 else 0.0,
                "rms_delta_p": float(math.sqrt((dp ** 2).mean())),
                "rms_delta_p_error": _rms_error(dp),
            }
        return out


def _error(values: np.ndarray) -> float:
    """The standard error of the mean of ``values``."""
    n = len(values)
    return float(values.std() / math.sqrt(n - 1)) if n > 1 else 0.0


def _rms_error(values: np.ndarray) -> float:
    """The standard error of sqrt(mean(values²)), carried from that of the mean of squares."""
    rms = math.sqrt((values ** 2).mean())
    return _error(values ** 2) / (2 * rms) if rms > 0 else 0.0


def _perplexity(nll: list[float]) -> dict[str, float]:
    values = np.array(nll, dtype=np.float64)
    mean = float(values.mean())
    ppl = math.exp(mean)
    return {"perplexity": ppl, "nll_mean": mean, "perplexity_error": ppl * _error(values)}


# ----------------------------------------------------------------------------------------------
# The measurement


def measure(bundle: str, text: str, *, ctx: int = 512, batch: int | None = None, threads: int | None = None,
            max_windows: int | None = None, reference: str | None = None, logits: str | None = None,
            save_logits: str | None = None, progress: bool = False) -> dict[str, Any]:
    """The perplexity of ``bundle`` over ``text`` (module docstring), with the KL divergence
    statistics against ``reference`` (a bundle or a checkpoint folder transformers loads) or the
    log-probabilities saved in ``logits``; ``save_logits`` saves this bundle's, for a later
    ``logits``. Returns the JSON-ready figures."""
    from .hf import tokenizer_from_bundle

    if reference is not None and logits is not None:
        raise KtcError("give the reference as a model (--reference) or as saved log-probabilities (--logits), "
                       "not both")
    tokenizer = tokenizer_from_bundle(bundle)
    ids, bos = tokenize(tokenizer, text)
    windows = make_windows(ids, ctx, bos=bos, max_windows=max_windows)
    count = windows.tokens.shape[0]
    base = None
    temporary = None
    try:
        if reference is not None:  # a first pass: one model in memory at a time
            import tempfile

            handle, temporary = tempfile.mkstemp(prefix="ktc-reference-", suffix=".logprobs")
            os.close(handle)
            _score_windows(reference, windows, threads=threads, batch=batch, tokenizer=tokenizer,
                           save=temporary, progress=progress, label="reference")
            logits = temporary
        if logits is not None:
            base = _matching_logprobs(logits, windows)
        scores = _score_windows(bundle, windows, threads=threads, batch=batch, tokenizer=tokenizer,
                                save=save_logits, progress=progress, label="model", base=base)
    finally:
        del base
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
    out = {"bundle": bundle, "ctx": ctx, "windows": count, "scored_per_window": windows.scored,
           "bos_first": bos is not None, "text_tokens": len(ids),
           "convention": "llama-perplexity: non-overlapping windows of ctx tokens, each from an empty cache, "
                         "the second half of each scored"}
    out |= scores.summary()
    if reference is not None or logits is not None:
        out["reference"]["source"] = reference if reference is not None else logits
    return out


def _matching_logprobs(path: str, windows: Windows) -> np.ndarray:
    """The saved log-probabilities of ``windows``' windows (the first ones where it holds more),
    after checking that they were computed on the same tokens and ``ctx``."""
    header, data = read_logprobs(path)
    count, ctx = windows.tokens.shape
    saved = np.asarray(header["tokens"], dtype=np.int64)
    if header["ctx"] != ctx or header["windows"] < count or \
            not np.array_equal(saved.reshape(header["windows"], header["ctx"])[:count], windows.tokens):
        raise KtcError(f"the saved log-probabilities were computed on other windows ({header['windows']} of "
                       f"--ctx {header['ctx']}; these are {count} of --ctx {ctx})", path=path,
                       hint="use the same text, tokenizer and --ctx as when they were saved")
    return data[:count]


def _score_windows(model: str, windows: Windows, *, threads: int | None, batch: int | None, tokenizer: Any,
                   save: str | None, progress: bool, label: str, base: np.ndarray | None = None) -> Scores:
    """Runs ``model`` (a bundle, or a checkpoint transformers loads) over the windows: their
    scores (against ``base`` where given), their log-probabilities written to ``save``."""
    from tqdm import tqdm

    from ktc.formats.bundle import is_bundle_file

    scores = Scores()
    count = windows.tokens.shape[0]
    with _scorer(model, windows.ctx, threads=threads, batch=batch, tokenizer=tokenizer,
                 bundle=is_bundle_file(model)) as run:
        writer = None
        bar = tqdm(total=count, unit="window", desc=label, disable=None if progress else True, leave=False)
        try:
            for w in range(count):
                lp = run(windows.tokens[w])
                if base is not None and lp.shape != base.shape[1:]:
                    raise KtcError(f"the reference's vocabulary has {base.shape[2]} tokens; the model's "
                                   f"{lp.shape[1]}", hint="compare models that share a tokenizer")
                if save is not None:
                    if writer is None:
                        writer = LogprobWriter(save, windows, lp.shape[1], model)
                    writer.add(lp)
                scores.add(lp, windows.targets(w), None if base is None else base[w])
                bar.update(1)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            bar.close()
        if writer is not None:
            writer.close()
    return scores


@contextmanager
def _scorer(model: str, ctx: int, *, threads: int | None, batch: int | None, tokenizer: Any,
            bundle: bool) -> Iterator[WindowFn]:
    if bundle:
        with bundle_scorer(model, ctx, threads=threads, batch=batch, tokenizer=tokenizer) as run:
            yield run
    else:
        with checkpoint_scorer(model, ctx) as run:
            yield run
