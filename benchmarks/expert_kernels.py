"""CPU expert kernels against the memory read bandwidth measured in the same run (medians of
interleaved rounds, each round measuring the bandwidth first).

1. One token through one expert at Mixtral-8x7B's shape (hidden 4096, expert 14336), per scheme:
   weight bytes read per second as a fraction of the roofline (targets: int8 and q8_0 75%,
   int4, q4_0, mxfp4 and the K-quants q4_k, q5_k, q6_k and iq4_xs 60%; fp8_e4m3 without one;
   iq4_xs, which ktc does not quantize to, from random blocks: its speed does not depend on the
   values).
2. A whole MoE layer at Qwen3-30B-A3B's shape (hidden 2048, expert 768, 8 of 128 experts), int8,
   q8_0, q4_0 and q4_k (and fp8_e4m3, without one), routing and dispatch included (target 60%),
   with the time beside the kernels (routing, activation quantization and function,
   combination, the rest) timed separately (target: under 5% of the layer).
3. 64 and 256 tokens through one expert against torch bf16 ``F.linear`` on the same weights
   dequantized (int8, q8_0, q4_0, mxfp4, iq4_nl, q4_k, q5_k, q6_k, iq4_xs, int4_g32/g64/g128; iq4_nl and iq4_xs
   from random blocks; target: at least 1.5x torch's throughput; fp8_e4m3 too, without one), with
   each side's operations a second against this CPU's int8 and bf16 peaks, measured here as
   independent ``vpdpbusd`` and ``vdpbf16ps`` instructions on registers, on every thread (the
   fastest of 9 runs: a capacity, not a speed claim).

    python benchmarks/expert_kernels.py [--threads 2] [--quick] [--sections 123]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    return statistics.median(values)


# The instructions whose rate is this CPU's peak, and the multiply-adds each does (512-bit forms).
PEAK_INSTRUCTIONS = {"int8": "vpdpbusd", "bf16": "vdpbf16ps"}
_PEAK_PRODUCTS = {"int8": 64, "bf16": 32}
_PEAK_CHAINS = 24  # independent accumulators: enough to cover each instruction's latency


def _spin(mnemonic: str):  # type: ignore[no-untyped-def]
    """A compiled function ``spin(iterations)`` that issues ``_PEAK_CHAINS`` independent
    ``mnemonic`` instructions on zmm registers per iteration (inline assembly: llvmlite has no
    bfloat16 vector type for the bf16 intrinsic) and returns a lane of their sum."""
    import llvmlite.binding
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    llvmlite.binding.initialize_native_asmparser()  # Numba's JIT reads no inline assembly without it

    @intrinsic
    def run(typingctx, iterations):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            words = ir.VectorType(ir.IntType(32), 16)
            asm = ir.InlineAsm(ir.FunctionType(words, [words, words, words]), f"{mnemonic} $2, $1, $0",
                               "=v,v,v,0", side_effect=True)
            one = ir.Constant(words, [0x01010101] * 16)
            chains = [cgutils.alloca_once_value(builder, ir.Constant(words, [k] * 16)) for k in range(_PEAK_CHAINS)]
            with cgutils.for_range(builder, args[0]):
                for chain in chains:
                    builder.store(builder.call(asm, [one, one, builder.load(chain)]), chain)
            total = builder.load(chains[0])
            for chain in chains[1:]:
                total = builder.add(total, builder.load(chain))
            return builder.sext(builder.extract_element(total, ir.Constant(ir.IntType(32), 0)), ir.IntType(64))

        return types.int64(types.intp), codegen

    @njit(parallel=True)
    def spin(threads, iterations):  # type: ignore[no-untyped-def]
        total = 0
        for _ in prange(threads):
            total += run(iterations)
        return total

    return spin


def peak_ops(name: str, threads: int, seconds: float = 0.3) -> float:
    """Operations a second (2 a multiply-add) of PEAK_INSTRUCTIONS[name] on ``threads`` threads:
    the fastest of 9 runs of about ``seconds`` each. A peak is a capacity, what the CPU does
    when nothing slows it, so it is the best run, not the median: on this shared machine the
    median of 5 once came out at 529 bf16 GOP/s where other runs gave 870-950, below what torch's
    GEMM then reached."""
    spin = _spin(PEAK_INSTRUCTIONS[name])
    spin(threads, 1000)
    iterations = 1_000_000
    while timed(lambda: spin(threads, iterations)) < seconds / 4:
        iterations *= 2
    runs = [timed(lambda: spin(threads, iterations)) for _ in range(9)]
    return 2 * _PEAK_PRODUCTS[name] * _PEAK_CHAINS * iterations * threads / min(runs)


class StepClock:
    """Times the parts of a MoE layer's one-token forward separately, from the cycle stamps of
    the layer's compiled one-token call (``vnni.STAMPS``): routing (the router's product and
    top-k), the activations' quantization, the two multi-expert kernels, the activation function
    between them, the weighted sum of the experts' outputs. Where that call
    does not run (no VNNI) the Python functions doing those parts are wrapped instead. The
    rest is the layer's own checks and calls."""

    def __init__(self, layer) -> None:  # type: ignore[no-untyped-def]
        from ktc.runtime import kernels, rows, vnni

        self.vnni = vnni
        self.seconds: dict[str, float] = {}
        self.patched = [(vnni, "quantize_activations", "quantize"), (rows, "experts_rows", "kernels"),
                        (kernels, "_act", "activation"),
                        (kernels, "_combine", "combine"), (type(layer), "route", "routing")]
        self.saved = [getattr(owner, name) for owner, name, _ in self.patched]
        for (owner, name, part), fn in zip(self.patched, self.saved):
            setattr(owner, name, self._wrap(fn, part))
        self.per_cycle = 0.0
        if vnni.HAVE_VNNI:
            vnni.STAMPS = np.zeros(vnni.STAMP_COUNT, dtype=np.int64)
            self.per_cycle = vnni.seconds_per_cycle()

    def _wrap(self, fn, part):  # type: ignore[no-untyped-def]
        def timed_call(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started
        return timed_call

    def measure(self, layer, h) -> dict[str, float]:  # type: ignore[no-untyped-def]
        self.seconds = {}
        stamps = self.vnni.STAMPS
        if stamps is not None:
            stamps[:] = 0
        total = timed(lambda: layer.forward(h))
        if stamps is not None:  # the layer's own one-call path: its routing inside it
            self.seconds |= {part: value for part, value in self.vnni.stamp_parts(stamps, self.per_cycle).items()
                             if part != "block"}
        parts = {part: self.seconds.get(part, 0.0) for part in ("routing", "quantize", "kernels", "activation",
                                                                "combine")}
        return parts | {"total": total, "rest": total - sum(parts.values())}

    def uninstall(self) -> None:
        for (owner, name, _), fn in zip(self.patched, self.saved):
            setattr(owner, name, fn)
        self.vnni.STAMPS = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smaller expert, fewer repeats")
    parser.add_argument("--sections", default="123", help="which of the three parts to run, e.g. 2 or 13")
    parser.add_argument("--schemes", default=None,
                        help="part 3's schemes, comma-separated (default: all), e.g. int8,q4_0,int4_g128")
    parser.add_argument("--tokens", default=None, help="part 3's token counts, comma-separated (default: 64,256)")
    args = parser.parse_args()
    from ktc.formats.quantize import dequantize, quantize
    from ktc.runtime.bandwidth import read_bandwidth
    from ktc.runtime.bench import set_threads
    from ktc.runtime.kernels import expert_forward, expert_forward_batch

    threads = set_threads(args.threads)
    roofline = read_bandwidth()
    print(f"{threads} threads; read bandwidth at the start {roofline / 1e9:.1f} GB/s")
    hidden, inter = (4096, 14336) if not args.quick else (2048, 4096)
    repeat = 5 if not args.quick else 2
    rng = np.random.default_rng(0)
    w_gate_up = (rng.standard_normal((2 * inter, hidden), dtype=np.float32) * 0.02)
    w_down = (rng.standard_normal((hidden, inter), dtype=np.float32) * 0.02)
    x = rng.standard_normal(hidden).astype(np.float32)
    targets: dict[str, float | None] = {"int8": 0.75, "q8_0": 0.75, "int4_g32": 0.60, "int4_g64": 0.60,
                                        "int4_g128": 0.60, "q4_0": 0.60, "mxfp4": 0.60,
                                        "q4_k": 0.60, "q5_k": 0.60, "q6_k": 0.60, "iq4_xs": 0.60,
                                        "fp8_e4m3": None}  # DeepSeek-V3's FP8 passed through: no target set

    def stored(w: np.ndarray, scheme: str) -> np.ndarray:
        from ktc.formats.schemes import get_scheme

        if get_scheme(scheme).quantize is not None:
            return quantize(w, scheme)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from model_factory import random_blocks

        return random_blocks(scheme, *w.shape)

    met = True
    rounds = 3 * repeat
    sections = args.sections
    if "1" in sections:
        print(f"1. one token, expert {hidden}x{inter}: {rounds} rounds, each measuring the read bandwidth "
              "and then every scheme; medians (this shared machine's bandwidth drifts by up to 2x within "
              "minutes, so a time is compared with the bandwidth of its own round):")
        experts = {scheme: (stored(w_gate_up, scheme), stored(w_down, scheme)) for scheme in targets}
        rows: dict[str, list[tuple[float, float, float]]] = {scheme: [] for scheme in targets}  # (fraction, s, bw)
        for scheme, (gate_up, down) in experts.items():
            expert_forward(gate_up, down, scheme, x)  # compile or load the kernels outside the timing
        for _ in range(rounds):
            bandwidth = read_bandwidth(256 * 1024 * 1024, repeat=3)
            for scheme, (gate_up, down) in experts.items():
                seconds = timed(lambda: expert_forward(gate_up, down, scheme, x))
                rows[scheme].append(((gate_up.nbytes + down.nbytes) / seconds / bandwidth, seconds, bandwidth))
        for scheme, target in targets.items():
            gate_up, down = experts[scheme]
            fraction = median([r[0] for r in rows[scheme]])
            seconds = median([r[1] for r in rows[scheme]])
            bandwidth = median([r[2] for r in rows[scheme]])
            met &= target is None or fraction >= target
            rate = (gate_up.nbytes + down.nbytes) / seconds
            print(f"   {scheme:<10} {1e3 * seconds:7.2f} ms, {rate / 1e9:5.1f} GB/s; "
                  f"{100 * fraction:3.0f}% of its round's bandwidth (median {bandwidth / 1e9:.1f} GB/s; "
                  + ("no target)" if target is None else f"target {100 * target:.0f}%)"))
        del experts

    if "2" in sections:
        print(f"2. MoE layer, Qwen3-30B-A3B shape, 8 of 128 experts, one token ({rounds} rounds, each measuring "
              "the read bandwidth, then a new token through each scheme's layer; medians):")
        from ktc.compile import compile_bundle
        from ktc.demo import write_sparse_checkpoint
        from ktc.formats.bundle import open_bundle
        from ktc.runtime.moe import MoELayer

        config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 1,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 1024}
        layer_targets = {"int8": 0.60, "q8_0": 0.60, "q4_0": 0.60, "q4_k": 0.60, "fp8_e4m3": None}  # as section 1's
        layer_schemes = tuple(layer_targets)
        with tempfile.TemporaryDirectory() as tmp:
            write_sparse_checkpoint(config, os.path.join(tmp, "src"), dtype="F32")
            layers = {}
            for scheme in layer_schemes:
                path = os.path.join(tmp, f"{scheme}.ktb")
                compile_bundle(os.path.join(tmp, "src"), path, cpu_scheme=scheme)
                layer = MoELayer(open_bundle(path), 0)
                # The sparse source has zero weights: random routing weights give real routing,
                # bf16 values as Qwen3-30B-A3B publishes its routers (the layer reads them as bf16).
                router = rng.standard_normal(layer.router.shape).astype(np.float32).view(np.uint32)
                layer.router = (router & np.uint32(0xFFFF0000)).view(np.float32)
                layer.forward(rng.standard_normal((1, 2048)).astype(np.float32))
                # Every page of the experts mapped before timing, as in a model's steady state: the
                # first touch of each 4 KB page of the bundle's map is a page fault (with the pages
                # in the page cache about 1 us each; unmapped, the layer ran at 20-26% of the
                # bandwidth here, timing the faults of each newly chosen expert)
                for expert in layer.experts.cpu.values():
                    for matrix in (expert.gate_up, expert.down):
                        int(matrix.reshape(-1)[::4096].sum())
                layers[scheme] = layer
            clock = StepClock(layers[layer_schemes[0]])
            results: dict[str, list[dict[str, float]]] = {scheme: [] for scheme in layer_schemes}
            for _ in range(rounds):
                round_bandwidth = read_bandwidth(256 * 1024 * 1024, repeat=3)
                for scheme, layer in layers.items():
                    h = rng.standard_normal((1, 2048)).astype(np.float32)
                    results[scheme].append(clock.measure(layer, h) | {"bandwidth": round_bandwidth})
            clock.uninstall()
            for scheme, layer in layers.items():
                per_expert = next(iter(layer.experts.cpu.values()))
                read = 8 * (per_expert.gate_up.nbytes + per_expert.down.nbytes)
                got = {part: median([r[part] for r in results[scheme]]) for part in results[scheme][0]}
                fraction = median([read / r["total"] / r["bandwidth"] for r in results[scheme]])
                overhead = median([1 - r["kernels"] / r["total"] for r in results[scheme]])
                target = layer_targets[scheme]
                met &= target is None or (fraction >= target and overhead < 0.05)
                print(f"   {scheme:<6} {1e3 * got['total']:6.3f} ms per token, {read / got['total'] / 1e9:5.1f} GB/s; "
                      f"{100 * fraction:3.0f}% of its round's bandwidth (median {got['bandwidth'] / 1e9:.1f} GB/s; "
                      + ("no target)" if target is None else f"target {100 * target:.0f}%)"))
                print(f"          kernels {1e3 * got['kernels']:.3f} ms; beside them routing "
                      f"{1e3 * got['routing']:.3f}, "
                      f"activation quantization {1e3 * got['quantize']:.3f}, activation function "
                      f"{1e3 * got['activation']:.3f}, combination {1e3 * got['combine']:.3f}"
                      f"{' (inside the down rows region)' if got['combine'] == 0 else ''}, the rest (checks, "
                      f"calls) {1e3 * got['rest']:.3f} ms; no worker-thread hand-off (every expert on the CPU): "
                      f"{100 * overhead:.1f}% of the layer (target under 5%)")
                layer.close()

    if "3" in sections:
        import torch

        torch.set_num_threads(threads)
        peaks = {name: peak_ops(name, threads) for name in PEAK_INSTRUCTIONS}
        print(f"3. tokens through one expert {hidden}x{inter} (gate/up, SiLU, down), against torch bf16 F.linear on "
              f"the same weights dequantized, {max(3, repeat)} interleaved rounds, medians; this CPU's peaks, measured "
              f"here (independent {', '.join(PEAK_INSTRUCTIONS.values())} on registers, {threads} threads, the "
              f"fastest of 9 runs): int8 "
              f"{peaks['int8'] / 1e9:.0f} GOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GOP/s (an op: a multiply or an add):")
        from generate import cpu_flags  # benchmarks/generate.py, beside this file

        if "amx_bf16" in cpu_flags():
            from ktc.runtime import amx
            from ktc.runtime.kernels import AMX_MIN_TOKENS

            ours = (f"ktc's products of {AMX_MIN_TOKENS['q4_0']} tokens or more ({AMX_MIN_TOKENS['q4_k']} for the "
                    f"K-quants, {AMX_MIN_TOKENS['int4_g128']} for int4, {AMX_MIN_TOKENS['fp8_e4m3']} for fp8_e4m3) "
                    "take AMX too (bf16, the weights decoded a "
                    "chunk of rows at a time), fewer AVX-512 VNNI" if amx.HAVE_AMX else
                    "ktc's batched kernels use AVX-512 VNNI here (AMX off: KTC_NO_AMX, or Linux refused it)")
            print("   this CPU has AMX, which torch's bf16 products take (oneDNN's AMX kernels; ONEDNN_VERBOSE=1 "
                  f"names them), so they are not bound by the vdpbf16ps peak; {ours}")
        counts = [int(c) for c in args.tokens.split(",")] if args.tokens else [64, 256] if not args.quick else [64]
        all_schemes = ("int8", "q8_0", "q4_0", "mxfp4", "iq4_nl", "q4_k", "q5_k", "q6_k", "iq4_xs", "int4_g32",
                       "int4_g64", "int4_g128", "fp8_e4m3")
        chosen = args.schemes.split(",") if args.schemes else all_schemes
        unknown = sorted(set(chosen) - set(all_schemes))
        if unknown:
            parser.error(f"unknown schemes {', '.join(unknown)}; part 3 has {', '.join(all_schemes)}")
        for count in counts:
            xs = rng.standard_normal((count, hidden)).astype(np.float32)
            ops = 2 * count * 3 * hidden * inter
            for scheme in (s for s in all_schemes if s in chosen):
                target = None if scheme == "fp8_e4m3" else 1.5  # fp8: no issue sets one
                gate_up, down = stored(w_gate_up, scheme), stored(w_down, scheme)
                wg = torch.from_numpy(dequantize(gate_up, scheme, hidden)).to(torch.bfloat16)
                wd = torch.from_numpy(dequantize(down, scheme, inter)).to(torch.bfloat16)
                xt = torch.from_numpy(xs).to(torch.bfloat16)

                def reference() -> None:
                    h2 = torch.nn.functional.linear(xt, wg)
                    a = torch.nn.functional.silu(h2[:, :inter]) * h2[:, inter:]
                    torch.nn.functional.linear(a, wd)

                def ours_fn() -> None:
                    with np.errstate(over="ignore"):  # iq4_nl's random blocks overflow the SiLU's exp
                        expert_forward_batch(gate_up, down, scheme, xs)

                ours_fn(), reference()
                pairs = [(timed(ours_fn), timed(reference)) for _ in range(max(3, repeat))]  # interleaved
                ours, theirs = median([p[0] for p in pairs]), median([p[1] for p in pairs])
                ratio = median([t / o for o, t in pairs])
                met &= target is None or ratio >= target
                print(f"   {count:>3} tokens, {scheme:<9} ktc {1e3 * ours:8.1f} ms ({ops / ours / 1e9:4.0f} GOP/s, "
                      f"{100 * ops / ours / peaks['int8']:3.0f}% of the int8 peak), torch bf16 {1e3 * theirs:8.1f} ms "
                      f"({ops / theirs / 1e9:4.0f} GOP/s, {100 * ops / theirs / peaks['bf16']:3.0f}% of the bf16 "
                      "peak): "
                      f"{ratio:.2f}x torch's throughput, median of the rounds' ratios "
                      + ("(no target)" if target is None else f"(target at least {target}x)"))
    print("targets met" if met else "targets NOT met")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
