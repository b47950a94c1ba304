"""The ``ktc`` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from ktc import __version__
from ktc.errors import KtcError

EXIT_USER_ERROR = 2


def _handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Print a ``KtcError`` in a line or two and exit non-zero; let bugs show their traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KtcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ktc")
def main() -> None:
    """ktc: plan, compile and run Mixture-of-Experts models on one GPU plus a big CPU.

    \b
    Examples:
      ktc demo                          build the demo model and inspect it
      ktc inspect ./Qwen3-30B-A3B       what the model is, where its bytes are
      ktc inspect model.gguf --json     the same, for scripts
    """


@main.command()
@click.argument("path", type=click.Path(exists=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--tensors", is_flag=True, help="Also list every tensor with its role, dtype and shape.")
@_handle_errors
def inspect(path: str, as_json: bool, tensors: bool) -> None:
    """Describe a checkpoint: family, layers, experts, bytes by component, KV cost per token.

    PATH is a Hugging Face model folder (safetensors or .bin), a single .safetensors / .bin /
    .pt file with config.json beside it, or a .gguf file. Only headers are read.

    \b
    Examples:
      ktc inspect ./Mixtral-8x7B-Instruct-v0.1
      ktc inspect ./DeepSeek-V3 --json | jq .bytes
      ktc inspect qwen3-30b-a3b-q8_0.gguf --tensors
    """
    from ktc.api import load_model
    from ktc.summary import render_text, summarize

    if not os.path.exists(path):
        raise KtcError("no such file or folder", path=path)
    started = time.perf_counter()
    ir = load_model(path)
    summary = summarize(ir)
    elapsed = time.perf_counter() - started
    if as_json:
        out = summary.to_json()
        out["inspect_seconds"] = round(elapsed, 4)
        if tensors:
            out["tensors"] = _tensor_rows(ir)
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(render_text(summary))
    if tensors:
        click.echo("")
        for row in _tensor_rows(ir):
            click.echo(f"  {row['name']:<64} {row['role']:<15} {row['dtype']:<8} {row['shape']}")


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


@main.command()
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the demo checkpoint (default: the ktc cache folder).")
@click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON.")
@_handle_errors
def demo(out: str | None, as_json: bool) -> None:
    """Build the built-in demo MoE model (Qwen3-MoE layout, safetensors) and inspect it.

    \b
    Example:
      ktc demo --out ./demo-model
    """
    from ktc.api import load_model
    from ktc.demo import default_cache_dir, write_demo_model
    from ktc.summary import render_text, summarize

    folder = out or os.path.join(default_cache_dir(), "demo-model")
    try:
        write_demo_model(folder)
    except OSError as exc:
        raise KtcError(f"cannot write the demo model: {exc.strerror}", path=folder) from None
    summary = summarize(load_model(folder))
    if as_json:
        click.echo(json.dumps(summary.to_json(), indent=1))
        return
    click.echo(f"demo model written to {folder}\n")
    click.echo(render_text(summary))
    click.echo("\nnext: planning, compiling and running the bundle are not implemented yet.")


if __name__ == "__main__":  # pragma: no cover
    main()
