"""Tiny models of every MoE family ktc runs from GGUF, converted by llama.cpp's own converter
(``convert_hf_to_gguf.py``, f32), compiled by ktc and run beside transformers' model of the same
weights: the relative difference of their logits over 32 tokens and whether both tokenizers split
a sentence alike. The tests write GGUFs with the gguf package as llama.cpp's converter writes them;
this checks that claim against the converter itself (each release of it may write a key or a
tensor differently).

DeepSeek-V3's checkpoint is given ``scoring_func: sigmoid`` as the release's config.json states it
(transformers does not save it, and without it the converter writes no gating function, which
llama.cpp, and so ktc, then reads as softmax: DeepSeek-V2's).

Needs llama.cpp's source (``../shared/tools/build-llamacpp.sh`` unpacks it) and transformers.

    python benchmarks/llamacpp_converter.py [--families qwen3_moe,mixtral,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "olmoe")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"))
    args = parser.parse_args()
    src = os.path.join(args.llamacpp, "src")
    if not os.path.exists(os.path.join(src, "convert_hf_to_gguf.py")):
        print(f"llama.cpp's source is not in {src}: run ../shared/tools/build-llamacpp.sh")
        return 1
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import torch
    from transformers import AutoTokenizer

    import model_factory as mf
    from ktc.compile import compile_bundle
    from ktc.runtime.hf import from_bundle

    text = "A Mixture-of-Experts model replaces the feed-forward block"
    worst, failed = 0.0, []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix="ktc-convert-") as tmp:
            base = mf.build_hf_model(family)
            model = type(base)(type(base.config)(**{**base.config.to_dict(), "vocab_size": 300})).eval()
            folder = os.path.join(tmp, "hf")
            model.save_pretrained(folder)
            mf.write_bpe_tokenizer(folder, 300)
            if family == "deepseek_v3":  # as the release's config.json states it
                path = os.path.join(folder, "config.json")
                config = json.load(open(path))
                config.update(scoring_func="sigmoid", topk_method="noaux_tc")
                json.dump(config, open(path, "w"))
            gguf = os.path.join(tmp, "model.gguf")
            done = subprocess.run([sys.executable, os.path.join(HERE, "perplexity_vs_llamacpp.py"),
                                   "--convert-with-gpt2-pre-tokenizer", src, folder, gguf, "gpt-2"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{family:<12} llama.cpp's converter failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
                failed.append(family)
                continue
            try:
                compile_bundle(gguf, os.path.join(tmp, "model.ktb"), cpu_scheme="f32", dense_scheme="f32")
                ids = torch.randint(3, 290, (1, 32), generator=torch.Generator().manual_seed(0))
                with from_bundle(os.path.join(tmp, "model.ktb")) as km, torch.no_grad():
                    got = km.model(ids).logits
                    same = km.tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
                with torch.no_grad():
                    want = model(ids).logits
            except Exception as exc:  # a file ktc cannot compile or run: reported, the others go on
                print(f"{family:<12} ktc failed: {type(exc).__name__}: {str(exc)[:300]}")
                failed.append(family)
                continue
            error = float((got - want).norm() / want.norm())
            worst = max(worst, error)
            print(f"{family:<12} logits against transformers' {error:.2e}, tokens {'the same' if same else 'DIFFERENT'}",
                  flush=True)
            if not same:
                failed.append(family)
    print(f"\nlargest difference {worst:.2e}; " + (f"failed: {', '.join(failed)}" if failed else "every family ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
