"""``ktc perplexity`` beside ``llama-perplexity`` on the same GGUF bytes and the same text: the
trained demo model (``ktc demo``'s, cached) converted by llama.cpp's own converter to an f32 GGUF,
quantized by ``llama-quantize --pure`` (Q8_0, Q4_0, Q6_K, Q4_K_M, MXFP4_MOE; where a matrix's
rows do not fit a type's blocks, llama-quantize picks another, as for any model), each file
compiled by ktc (its tensors pass through: both tools read the same bytes), then both tools score
the demo's held-out text with windows of ``--ctx`` tokens, and ktc's quantized bundles against
its f32 one as ``llama-perplexity --kl-divergence`` scores llama.cpp's files against its f32
file's saved logits.

Printed per file: each tool's perplexity (±) and windows, their ratio; per quantized file each
tool's mean KL divergence from its f32 run and top-1 agreement. ``ktc perplexity`` follows
``llama-perplexity``'s convention (``runtime/perplexity.py``); the two should agree to the
rounding of their arithmetic (llama.cpp's matrix products on these types go through its own
quantized activations and accumulation orders).

The converter's pre-tokenizer check knows only released models' BPE tokenizers by a hash: the
demo's byte-level BPE uses GPT-2's pre-tokenizer, so the conversion names it so ("gpt-2"); the
tensors and every other field are the converter's own. ``--pre NAME`` names another of llama.cpp's
pre-tokenizers instead (the demo's merges then meet another split, and its perplexity rises, the
same text split alike by both tools or not: a check of ktc's reading of that name, as
"deepseek-v3" or "deepseek-llm").

Needs llama.cpp's tools (``../shared/tools/build-llamacpp.sh``) and transformers (the demo's
training).

    python benchmarks/perplexity_vs_llamacpp.py [--ctx 128] [--threads 2] [--types Q8_0,Q4_0,...] [--pre gpt-2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

CONVERT = "--convert-with-gpt2-pre-tokenizer"  # this file run as llama.cpp's converter, patched


def convert_main(src: str, folder: str, out: str, pre: str = "gpt-2", outtype: str = "f32") -> None:
    """llama.cpp's convert_hf_to_gguf.py on ``folder`` (``outtype``), the BPE pre-tokenizer named ``pre``."""
    import runpy

    sys.path.insert(0, src)
    sys.path.insert(1, os.path.join(src, "gguf-py"))
    from conversion import base  # llama.cpp's own package, from its source tree

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), folder, "--outfile", out, "--outtype", outtype]
    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def llama_perplexity(tool: str, gguf: str, text: str, ctx: int, threads: int, *extra: str) -> dict[str, float]:
    """``llama-perplexity``'s final figures for ``gguf`` on ``text``: ppl, its ±, the windows
    (chunks), and with ``--kl-divergence`` the mean KLD (±) and the same-top-token share."""
    done = subprocess.run([tool, "-m", gguf, "-f", text, "-c", str(ctx), "-t", str(threads), *extra],
                          capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {gguf}:\n{log[-2000:]}")
    got: dict[str, float] = {}
    if (m := re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)):
        got["ppl"], got["ppl_err"] = float(m.group(1)), float(m.group(2))
    if (m := re.search(r"calculating perplexity over (\d+) chunks", log)):
        got["windows"] = float(m.group(1))
    if (m := re.search(r"Mean\s+KLD:\s+([-\d.]+)\s+±\s+([\d.]+)", log)):
        got["kld"], got["kld_err"] = float(m.group(1)), float(m.group(2))
    if (m := re.search(r"Same top p:\s+([\d.]+)\s+±", log)):
        got["top1"] = float(m.group(1)) / 100
    return got


def ktc_perplexity(bundle: str, text: str, ctx: int, threads: int, reference: str | None = None) -> dict:
    args = [sys.executable, "-m", "ktc.cli", "perplexity", bundle, "--text", text, "--ctx", str(ctx),
            "--threads", str(threads), "--json"]
    if reference:
        args += ["--reference", reference]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ktc perplexity failed on {bundle}:\n{(done.stdout + done.stderr)[-2000:]}")
    return json.loads(done.stdout)


def main() -> int:
    if len(sys.argv) in (6, 7) and sys.argv[1] == CONVERT:
        convert_main(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=128, help="tokens a window (llama-perplexity's -c)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="Q8_0,Q4_0,Q6_K,Q4_K_M,MXFP4_MOE", help="llama-quantize types beside f32")
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-perplexity"))
    parser.add_argument("--pre", default="gpt-2", help="the BPE pre-tokenizer the converted files name")
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"))
    args = parser.parse_args()
    bin_dir = os.path.join(args.llamacpp, "build", "bin")
    if not os.path.exists(os.path.join(bin_dir, "llama-perplexity")):
        print(f"llama.cpp's tools are not built in {args.llamacpp}: run ../shared/tools/build-llamacpp.sh")
        return 1
    from ktc.compile import compile_bundle
    from ktc.demo import demo_corpus, write_demo_model

    os.makedirs(args.workdir, exist_ok=True)
    text = os.path.join(args.workdir, "held-out.txt")
    with open(text, "w") as f:
        f.write(demo_corpus()[1])
    model = os.path.join(args.workdir, "demo-trained")
    if not os.path.exists(os.path.join(model, "config.json")):
        print("training the demo model...", flush=True)
        write_demo_model(model, trained=True, progress=True)
    stem = os.path.join(args.workdir, "demo" if args.pre == "gpt-2" else f"demo-{args.pre}")
    files = {"f32": f"{stem}-f32.gguf"}
    if not os.path.exists(files["f32"]):
        subprocess.run([sys.executable, os.path.abspath(__file__), CONVERT, os.path.join(args.llamacpp, "src"), model,
                        files["f32"], args.pre], check=True, capture_output=True)
    for qtype in [t for t in args.types.split(",") if t]:
        files[qtype] = f"{stem}-{qtype}.gguf"
        if not os.path.exists(files[qtype]):
            subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--pure", files["f32"], files[qtype], qtype],
                           check=True, capture_output=True)
    bundles = {}
    for name, gguf in files.items():  # compiled every run (seconds): a bundle of an older ktc would measure it
        bundles[name] = gguf[:-len(".gguf")] + ".ktb"
        # a float source's experts would be quantized to int8 by default: f32 kept as stored
        plain = {"cpu_scheme": "f32", "dense_scheme": "f32"} if name == "f32" else {}
        compile_bundle(gguf, bundles[name], **plain)
    tool = os.path.join(bin_dir, "llama-perplexity")
    base_logits = f"{stem}-f32.kld"
    print(f"the demo model's held-out text ({os.path.getsize(text)} bytes), windows of {args.ctx} tokens, "
          f"{args.threads} threads; the files name the pre-tokenizer {args.pre!r}")
    worst = 0.0
    for name in files:
        extra = ["--kl-divergence-base", base_logits] if name == "f32" else []
        theirs = llama_perplexity(tool, files[name], text, args.ctx, args.threads, *extra)
        ours = ktc_perplexity(bundles[name], text, args.ctx, args.threads)
        ratio = ours["perplexity"] / theirs["ppl"]
        worst = max(worst, abs(ratio - 1))
        print(f"{name:<9} ktc {ours['perplexity']:9.4f} ± {ours['perplexity_error']:.4f} ({ours['windows']} windows), "
              f"llama.cpp {theirs['ppl']:9.4f} ± {theirs['ppl_err']:.4f} ({theirs.get('windows', 0):.0f} windows): "
              f"ktc/llama.cpp {ratio:.5f}")
        if name != "f32":
            theirs_kld = llama_perplexity(tool, files[name], text, args.ctx, args.threads, "--kl-divergence-base",
                                          base_logits, "--kl-divergence")
            ours_kld = ktc_perplexity(bundles[name], text, args.ctx, args.threads, reference=bundles["f32"])
            kl = ours_kld["reference"]
            print(f"{'':<9} against f32: mean KLD ktc {kl['kld_mean']:.6f} ± {kl['kld_mean_error']:.6f}, llama.cpp "
                  f"{theirs_kld.get('kld', float('nan')):.6f} ± {theirs_kld.get('kld_err', float('nan')):.6f}; "
                  f"same top token ktc {100 * kl['top1_agreement']:.2f}%, llama.cpp "
                  f"{100 * theirs_kld.get('top1', float('nan')):.2f}%")
    print(f"\nlargest perplexity difference: {100 * worst:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
