"""Whole-model generation (``ktc run``) on one-layer models at real shapes, beside llama.cpp.

For Mixtral-8x7B's and Qwen3-30B-A3B's shapes (their published configs with one decoder layer,
built by transformers in bf16 with its random initialisation), each compiled to int8, q8_0,
q4_0, int4_g128 and mxfp4 with the dense scheme to match, this measures in interleaved rounds
(each round measures the read bandwidth first, then every case once):

- prefill and decode tokens/s of ``ktc run`` (``runtime.generate``: the bundle's whole model on
  the CPU, greedy, a random prompt);
- the weight bytes a decode step reads (every non-expert matrix but the embedding table, one
  embedding row, the top-k experts) times decode tokens/s, over the round's read bandwidth;
- the framework's own share of a decode step: the step's time minus the time spent in ktc's
  kernels (the Numba kernels and GEMMs, not ktc's Python around them) and in torch's
  attention, read two ways: attention as the sdpa call alone, and as the attention module
  (its norms, rotary embedding and cache update too).

Where llama.cpp's tools are built (``../shared/tools/build-llamacpp.sh``; ``--llamacpp DIR``),
the same checkpoint is converted with llama.cpp's converter and quantized with llama-quantize
(Q8_0 for int8 and q8_0, Q4_0 for q4_0 and int4_g128, MXFP4_MOE for mxfp4), and ``llama-bench``
runs in the same rounds with the same prompt and generation lengths and threads (its decode
after the prompt, ``-d``: ``run_llama``).

Every figure printed is the median over rounds; ratios are medians of per-round ratios.

    python benchmarks/generate.py [--rounds 5] [--shapes mixtral,qwen3] [--schemes int8,q4_0]
                                  [--prompt 64] [--new 32] [--threads 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(os.path.dirname(ROOT), "shared", "configs")
# published configs: ../shared/configs' and, gpt-oss-20b's (without its quantization section:
# the models here are built in bf16) and Moonlight-16B-A3B's (DeepSeek-V3's architecture,
# multi-head latent attention, at a size this machine builds; without its auto_map: transformers
# has the architecture), this folder's configs/
SHAPES = {"mixtral": "mixtral-8x7b.json", "qwen3": "qwen3-30b-a3b.json",
          "gpt-oss": os.path.join(ROOT, "benchmarks", "configs", "gpt-oss-20b.json"),
          "moonlight": os.path.join(ROOT, "benchmarks", "configs", "moonlight-16b-a3b.json")}
# model types whose llama.cpp converter reads only a BPE tokenizer.json, whose pre-tokenizer it
# must know: converted by perplexity_vs_llamacpp.py's patched run of it (``llama_gguf``)
BPE_ONLY = ("gpt_oss", "deepseek_v3")
SCHEMES = ("int8", "q8_0", "q4_0", "int4_g128", "mxfp4")
# llama.cpp's file type for each ktc scheme: the same bytes where one exists, else the nearest.
LLAMA_TYPES = {"int8": "Q8_0", "q8_0": "Q8_0", "q4_0": "Q4_0", "int4_g128": "Q4_0", "mxfp4": "MXFP4_MOE"}


# ----------------------------------------------------------------------------------------------
# Models


def build_checkpoint(shape: str, folder: str, layers: int = 1) -> str:
    """The shape's published config with ``layers`` decoder layers, built by transformers in bf16."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import model_factory as mf

    raw = json.load(open(os.path.join(CONFIGS, SHAPES[shape])))
    raw["num_hidden_layers"] = layers
    if "layer_types" in raw:  # gpt-oss: sliding and full attention in turn, the first ``layers`` of them
        raw["layer_types"] = raw["layer_types"][:layers]
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    print(f"building the {layers}-layer {shape} model (bf16, transformers' initialisation)...", flush=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    mf.write_bpe_tokenizer(tmp, 1024)  # tokens do not matter for speed; ids stay below 1024
    os.replace(tmp, folder)
    return folder


def compile_case(checkpoint: str, scheme: str, out: str) -> str:
    if not os.path.exists(out):
        from ktc.compile import compile_bundle

        print(f"compiling {os.path.basename(out)}...", flush=True)
        compile_bundle(checkpoint, out, cpu_scheme=scheme, dense_scheme=scheme, max_tokens=4096)
    return out


def llama_gguf(llama: str, checkpoint: str, shape: str, qtype: str, workdir: str, pure: bool = False) -> str:
    """The checkpoint converted by llama.cpp's converter (bf16) and quantized to ``qtype``; with
    ``pure`` every matrix in that type (``llama-quantize --pure``: no Q6_K output matrix)."""
    out = os.path.join(workdir, f"{shape}-{qtype}{'-pure' if pure else ''}.gguf")
    if os.path.exists(out):
        return out
    base = os.path.join(workdir, f"{shape}-bf16.gguf")
    if not os.path.exists(base) and json.load(open(os.path.join(checkpoint, "config.json")))["model_type"] in BPE_ONLY:
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "perplexity_vs_llamacpp.py"),
                        "--convert-with-gpt2-pre-tokenizer", os.path.join(llama, "src"), checkpoint, base, "gpt-2",
                        "bf16"], check=True, capture_output=True)
    if not os.path.exists(base):
        folder = checkpoint + "-sp"  # the converter reads a SentencePiece tokenizer.model
        if not os.path.exists(os.path.join(folder, "tokenizer.model")):  # (a failed run's folder made again)
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            for name in os.listdir(checkpoint):
                if name.endswith((".safetensors", ".json")) and not name.startswith("tokenizer"):
                    os.symlink(os.path.join(checkpoint, name), os.path.join(folder, name))
            import sentencepiece as spm
            from ktc.demo import DEMO_TEXT

            text = os.path.join(folder, "text.txt")
            open(text, "w").write(DEMO_TEXT)
            spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(folder, "tokenizer"),
                                           vocab_size=256, model_type="bpe", minloglevel=2)
        tool = os.path.join(os.path.dirname(ROOT), "shared", "tools", "convert-hf-to-gguf.py")
        subprocess.run([sys.executable, tool, os.path.join(llama, "src"), folder, base, "--outtype", "bf16"],
                       check=True, capture_output=True)
    _query_rank_key(base)
    quantize = os.path.join(llama, "build", "bin", "llama-quantize")
    subprocess.run([quantize, *(["--pure"] if pure else []), base, out, qtype], check=True, capture_output=True)
    return out


def _query_rank_key(path: str) -> None:
    """A deepseek2 GGUF without query compression (Moonlight's: the converter writes no
    ``attention.q_lora_rank``) is read by llama.cpp only at the layer counts of the released
    models without it (26 or 27 layers); a model cut to fewer layers gets the key as 0, which
    llama.cpp reads as no compression. Rewritten in place (a copy with the key, then renamed)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(path)
    arch = reader.fields.get("general.architecture")
    key = "deepseek2.attention.q_lora_rank"
    if arch is None or bytes(arch.parts[arch.data[0]]).decode() != "deepseek2" or key in reader.fields:
        return
    writer = gguf.GGUFWriter(path + ".tmp", "deepseek2", endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {key: MetadataDetails(gguf.GGUFValueType.UINT32, 0)}, [])
    del reader
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------
# Measuring


class KernelClock:
    """Seconds spent in ktc's kernels (the matrix-vector and multi-expert kernels, the products of
    the interleaved copies, the compiled one-token expert calls, which include the activations' quantization and the activation
    function, the GEMMs and decoders of the batched paths, the embedding row decode, the fast
    decode step's compiled layer calls, or its one call of every layer, with the few lines of
    Python around each, and its MoE call where the layer is not one call) and in torch's
    attention, accumulated by wrapping
    those functions where the runtime looks them up from Python (never a function that compiled
    code calls: Numba could not compile a caller against the wrapper). ktc's own Python around
    them (dispatching experts, the activation between gate/up and down where it is not compiled,
    the fast step's attention where its layer is not compiled) is not kernel time: it counts as
    framework, with transformers' code."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0
        self.attention_rest = 0.0  # the attention modules' time outside the kernels above

    def watch_attention(self, model) -> None:  # type: ignore[no-untyped-def]
        """Also time each attention module (``*.self_attn``): projections (ktc kernels), norms,
        rotary embedding, the cache update and sdpa, for the second reading of the share."""
        clock = self
        started: list[tuple[float, float]] = []

        def before(module, args):  # type: ignore[no-untyped-def]
            started.append((time.perf_counter(), clock.seconds))

        def after(module, args, output):  # type: ignore[no-untyped-def]
            t0, k0 = started.pop()
            clock.attention_rest += (time.perf_counter() - t0) - (clock.seconds - k0)

        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                module.register_forward_pre_hook(before)
                module.register_forward_hook(after)

    def wrap(self, fn):  # type: ignore[no-untyped-def]
        clock = self

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            if clock.depth:
                return fn(*args, **kwargs)
            clock.depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - started
                clock.depth -= 1

        return timed

    def install(self) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ktc.runtime import fast_decode, interleave, kernels, moe, rows
        from ktc.runtime.linear import BundleEmbedding

        for name in ("matvec", "_int8_rows_many", "_int8_gemm", "_bf16_gemm", "matmul_t", "decode"):
            setattr(kernels, name, self.wrap(getattr(kernels, name)))
        # the interleaved copies' products (q4_0, q8_0, mxfp4 and q4_k matrices on a VNNI CPU: the
        # output matrix's one-token product of a decode step among them)
        for name in ("matvec", "matmul"):
            setattr(interleave, name, self.wrap(getattr(interleave, name)))
        setattr(rows, "experts_rows", self.wrap(rows.experts_rows))
        for name in ("token", "chosen_experts_token"):
            setattr(rows, name, self.wrap(getattr(rows, name)))
        BundleEmbedding.rows = self.wrap(BundleEmbedding.rows)
        moe._moe_token = self.wrap(moe._moe_token)  # the fast decode step's MoE block, one call
        layer_step = fast_decode.FastDecode._layer_step
        timed_layer = self.wrap(layer_step)

        def fast_layer(layer, *args):  # type: ignore[no-untyped-def]
            # a compiled layer (one or two calls) counts whole; a step-by-step one by its kernels
            return (timed_layer if layer.compiled is not None else layer_step)(layer, *args)

        fast_decode.FastDecode._layer_step = staticmethod(fast_layer)
        # the whole stack in one compiled call, where every layer takes it (FastDecode._every_layer)
        fast_decode.FastDecode._layers_step = self.wrap(fast_decode.FastDecode._layers_step)
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = self.wrap(sdpa_attention_forward)


def decode_bytes_per_token(bundle) -> int:  # type: ignore[no-untyped-def]
    """Weight bytes one decode step reads: every non-expert tensor but the embedding table, one
    embedding row, and top-k experts of each MoE layer."""
    total = 0
    for t in bundle.tensors.values():
        if t.role == "expert":
            continue
        if t.role == "embeddings" and t.segment == "host":
            total += t.nbytes // t.shape[0]
        else:
            total += t.nbytes
    for info in bundle.manifest["model"]["moe_layers"]:
        prefix = f"layers.{info['layer']}.experts.0."
        expert = sum(t.nbytes for name, t in bundle.tensors.items() if name.startswith(prefix))
        total += info["top_k"] * expert
    return total


def gguf_bytes_per_token(path: str) -> int:
    """The same for a GGUF: every tensor but token_embd (one row of it), top-k of E experts."""
    from ktc.formats.gguf_reader import read_gguf_header

    metadata, tensors = read_gguf_header(path)
    arch = metadata["general.architecture"]
    k, experts = metadata[f"{arch}.expert_used_count"], metadata[f"{arch}.expert_count"]
    total = 0
    for name, ref in tensors.items():
        nbytes = ref.location.nbytes
        if name == "token_embd.weight":
            total += nbytes // ref.stored_shape[0]
        elif "_exps." in name:
            total += nbytes * k // experts
        else:
            total += nbytes
    return total


@dataclass
class Case:
    shape: str
    scheme: str
    bundle: str
    gguf: str | None = None
    rows: list[dict] = field(default_factory=list)


def run_ktc(case: Case, clock: KernelClock, prompt: list[int], new: int, threads: int | None) -> dict:
    from ktc.formats.bundle import open_bundle
    from ktc.runtime import vnni
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle

    with open_bundle(case.bundle) as bundle:
        per_token = decode_bytes_per_token(bundle)
    with from_bundle(case.bundle, threads=threads) as km:
        clock.watch_attention(km.model)
        # warm, as llama-bench warms up: the decode steps, and a prefill of the whole prompt (the first
        # of each size loads its kernels and touches its buffers: 199 against 561 tok/s for the next
        # at Mixtral's shape, Q4_0, 512 tokens)
        generate(km, prompt[:4], max_new_tokens=2, sampling=Sampling(temperature=0), stop_at_eos=False)
        generate(km, prompt, max_new_tokens=1, sampling=Sampling(temperature=0), stop_at_eos=False)
        # and every page of the bundle mapped, as llama.cpp's load reads its file: the prefill runs
        # the last layer's experts for one token, so the decode would otherwise read those from
        # disk where the page cache cannot hold every case's files (two-layer Mixtral, Q4_K_M:
        # 14 tok/s in a run, 54-71 warm)
        int(km.bundle.file_view()[::4096].sum())
        marks: list[tuple[float, float]] = []
        parts: list[dict[str, float]] = []

        def on_token(_: int) -> None:
            marks.append((clock.seconds, clock.attention_rest))
            parts.append(vnni.stamp_parts(vnni.STAMPS, per_cycle))
            vnni.STAMPS[:] = 0

        per_cycle = _seconds_per_cycle()
        vnni.STAMPS = np.zeros(vnni.STAMP_COUNT, dtype=np.int64)
        try:
            result = generate(km, prompt, max_new_tokens=new, sampling=Sampling(temperature=0), stop_at_eos=False,
                              on_token=on_token)
        finally:
            vnni.STAMPS = None
    # kernel and attention time of the decode steps (after the first token, which the prefill gave)
    kernel = clock.seconds - marks[0][0]
    attention = clock.attention_rest - marks[0][1]
    decode_parts = [p for p in parts[1:] if "block" in p]
    return {"prefill": result.prefill_tokens_per_s, "decode": result.decode_tokens_per_s,
            "bytes_per_token": per_token, "framework": 1 - kernel / result.decode_seconds,
            "framework_module": 1 - (kernel + attention) / result.decode_seconds,
            "moe_parts": ({name: median([p[name] for p in decode_parts]) for name in decode_parts[0]}
                          if decode_parts else {})}


@functools.lru_cache(maxsize=1)
def _seconds_per_cycle() -> float:
    from ktc.runtime import vnni

    return vnni.seconds_per_cycle()


def moe_parts_line(rows: list[dict[str, float]]) -> str:
    """The MoE block's parts in a model's decode step (``run_ktc``'s ``moe_parts``, one layer's
    stamps a token: the last MoE layer's), medians over rounds, and what is beside its kernels
    as a share of the block."""
    rows = [r for r in rows if r]
    if not rows:
        return "MoE block's parts: not stamped (its experts do not run as one compiled call)"
    got = {name: median([r[name] for r in rows]) for name in rows[0]}
    # The router's product is a product of weights read from memory, as the kernels' are (its
    # 0.5 MB at Qwen3-30B-A3B's shape take as long as a plain read of them: docs/runtime.md), so
    # the target's share counts it among them: what is beside them is the dispatch (the top k,
    # the quantizations, the activation, the combination). The share with it beside them follows.
    shares = [1 - (r["kernels"] + r["router"]) / r["block"] for r in rows]
    with_router = [1 - r["kernels"] / r["block"] for r in rows]
    rest = median([r["routing"] - r["router"] for r in rows])
    # long down rows are summed inside their region (rows.SPAN_BYTES), short ones after it
    inside = " (inside the down rows' region)" if got["combine"] == 0 else ""
    return (f"MoE block {1e6 * got['block']:.0f} us: kernels {1e6 * got['kernels']:.0f} and the router's product "
            f"{1e6 * got['router']:.0f}; beside them routing's top k {1e6 * rest:.0f}, activations' quantization "
            f"{1e6 * got['quantize']:.0f}, activation {1e6 * got['activation']:.0f}, combination "
            f"{1e6 * got['combine']:.0f} us{inside}: {100 * median(shares):.1f}% of the block (target under 5%; "
            f"no worker-thread hand-off: every expert on the CPU; rounds {_percents(shares)}); "
            f"{100 * median(with_router):.1f}% with the router's product counted beside the kernels (rounds "
            f"{_percents(with_router)})")


def _percents(shares: list[float]) -> str:
    """Each round's share, in percent: the share moves with the machine's bandwidth phase (in a
    fast one the kernels' time falls and the steps beside them, from memory's latency, do not)."""
    return " ".join(f"{100 * share:.1f}" for share in shares)


def cpu_flags() -> str:
    """The CPU's feature flags line (Linux), or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def run_llama(llama: str, gguf: str, prompt: int, new: int, threads: int) -> dict:
    """llama-bench's prefill of ``prompt`` tokens and its decode of ``new`` tokens after them
    (``-d``: at the depth ktc's decode runs at, after the same prompt: from an empty cache, as a
    plain ``-p P -n N`` runs it, its steps read no keys and values)."""
    prefill = _llama_bench(llama, gguf, ["-p", str(prompt), "-n", "0"], threads)
    decode = _llama_bench(llama, gguf, ["-p", "0", "-n", str(new), "-d", str(prompt)], threads)
    pp = next(r["avg_ts"] for r in prefill if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in decode if r["n_gen"] > 0)
    return {"prefill": pp, "decode": tg, "bytes_per_token": gguf_bytes_per_token(gguf)}


def _llama_bench(llama: str, gguf: str, test: list[str], threads: int) -> list[dict]:
    bench = os.path.join(llama, "build", "bin", "llama-bench")
    done = subprocess.run([bench, "-m", gguf, *test, "-t", str(threads), "-r", "1", "-o", "json"],
                          capture_output=True, text=True)
    if done.returncode in (-signal.SIGILL, -signal.SIGSEGV) and "amx" in cpu_flags():
        # Seen on a virtual machine whose CPU reports AMX that the hypervisor does not run: a
        # native build of ggml takes its AMX matrix products, and the first prompt faults.
        raise SystemExit(f"llama-bench died ({signal.Signals(-done.returncode).name}) on a CPU that reports AMX: "
                         "rebuild llama.cpp's tools without it (cmake -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON "
                         "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON "
                         "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF "
                         "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF, with build-llamacpp.sh's other options)")
    done.check_returncode()
    return json.loads(done.stdout)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="mixtral,qwen3")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="generated tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-generate"))
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"),
                        help="llama.cpp built by build-llamacpp.sh (skipped when its tools are missing)")
    args = parser.parse_args()
    from ktc.runtime.bandwidth import read_bandwidth

    os.makedirs(args.workdir, exist_ok=True)
    llama = args.llamacpp if os.path.exists(os.path.join(args.llamacpp, "build", "bin", "llama-bench")) else None
    cases = []
    for shape in args.shapes.split(","):
        checkpoint = build_checkpoint(shape, os.path.join(args.workdir, shape))
        for scheme in args.schemes.split(","):
            case = Case(shape, scheme, compile_case(checkpoint, scheme, os.path.join(args.workdir, f"{shape}-{scheme}.ktb")))
            if llama:
                case.gguf = llama_gguf(llama, checkpoint, shape, LLAMA_TYPES[scheme], args.workdir)
            cases.append(case)
    clock = KernelClock()
    clock.install()
    prompt = [int(i) for i in np.random.default_rng(0).integers(3, 1000, args.prompt)]
    print(f"{args.rounds} rounds, {args.threads} threads, prompt {args.prompt} tokens, {args.new} generated; "
          f"llama.cpp: {'llama-bench at ' + llama if llama else 'not built (skipped)'}", flush=True)
    bandwidths = []
    for round_index in range(args.rounds):
        bandwidth = read_bandwidth()
        bandwidths.append(bandwidth)
        for case in cases:
            row = {"bandwidth": bandwidth, "ktc": run_ktc(case, clock, prompt, args.new, args.threads)}
            if case.gguf:
                row["llama"] = run_llama(llama, case.gguf, args.prompt, args.new, args.threads)
            case.rows.append(row)
        print(f"round {round_index + 1}: read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    print(f"\nmedians over {args.rounds} rounds (read bandwidth median {median(bandwidths) / 1e9:.1f} GB/s):")
    for case in cases:
        k = [r["ktc"] for r in case.rows]
        frac = [r["ktc"]["decode"] * r["ktc"]["bytes_per_token"] / r["bandwidth"] for r in case.rows]
        line = (f"{case.shape:<8} {case.scheme:<10} ktc: prefill {median([x['prefill'] for x in k]):7.1f} tok/s, "
                f"decode {median([x['decode'] for x in k]):6.1f} tok/s = {median(frac) * 100:3.0f}% of the bandwidth "
                f"({k[0]['bytes_per_token'] / 1e6:.0f} MB/token), framework {median([x['framework'] for x in k]) * 100:4.1f}%"
                f" of a decode step ({median([x['framework_module'] for x in k]) * 100:4.1f}% with the attention module"
                " as attention)")
        print(line)
        if case.gguf:
            lm = [r["llama"] for r in case.rows]
            lfrac = [r["llama"]["decode"] * r["llama"]["bytes_per_token"] / r["bandwidth"] for r in case.rows]
            ratio_d = [r["ktc"]["decode"] / r["llama"]["decode"] for r in case.rows]
            ratio_p = [r["ktc"]["prefill"] / r["llama"]["prefill"] for r in case.rows]
            print(f"{'':<19} llama.cpp {LLAMA_TYPES[case.scheme]}: prefill {median([x['prefill'] for x in lm]):7.1f} "
                  f"tok/s, decode {median([x['decode'] for x in lm]):6.1f} tok/s = {median(lfrac) * 100:3.0f}% of the "
                  f"bandwidth ({lm[0]['bytes_per_token'] / 1e6:.0f} MB/token); ktc/llama.cpp: prefill "
                  f"{median(ratio_p):.2f}x, decode {median(ratio_d):.2f}x")
    for key, reading in (("framework", "attention = the sdpa call"),
                         ("framework_module", "attention = the attention module")):
        worst = max(median([r["ktc"][key] for r in c.rows]) for c in cases)
        print(f"framework share of a decode step ({reading}), worst case: {worst * 100:.1f}% "
              f"(target under 10%): {'met' if worst < 0.10 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
