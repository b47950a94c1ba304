"""Decode of a model whose weights do not fit the memory given, beside llama.cpp on the same GGUF
bytes: a two-layer model at Qwen3-30B-A3B's shape in Q4_0 (``vs_llamacpp.py``'s, made the same
way), each side in a memory cgroup of its own.

A side's limit is its own anonymous memory (its code, buffers and KV cache, measured in a first
run without a limit) plus one allowance, the same for every side, for the page cache, which must
hold what each reads of its file: ``--allowance`` of the GGUF's bytes (0.6 by default). Before each
run the side's file is evicted from the page cache (``posix_fadvise(DONTNEED)``): every run starts
cold, and what does not stay in the allowance is read from the disk again when used. Each side
decodes random tokens (llama-bench feeds random token ids; ktc samples at a temperature that makes
every token about as likely), ``--new`` of them after a warm-up.

- **llama.cpp**: ``llama-bench -p 0 -n N``, its file mapped (``-lm mmap``), its rows as stored
  (``--repack 0``: repacked copies are anonymous memory, a whole copy of the model outside the
  allowance; by default llama.cpp makes them, and then a limit below the model's size leaves it
  the choice of swapping or being killed).
- **ktc mapped**: the bundle compiled from the GGUF (every expert on the CPU), read through its map
  as stored (``--no-interleave``, for the same reason).
- **ktc disk tier**: compiled with ``--vram 0 --ram R --disk-bandwidth B`` (R: the allowance plus the
  input embedding table, which the plan counts whole and a step reads a row of): the plan's RAM
  set read in at load (``MADV_WILLNEED``), the least used experts on disk, paged in a layer ahead
  by pre-gating while a layer's guesses of them are used (``prefetch.Prefetcher``).
- **ktc disk tier, profiled**: the same planned with ``--profile`` the routing counts of 256 random
  tokens decoded by the mapped bundle with another seed (as a user plans from ``ktc profile``):
  the experts that routing used least on disk, in both layers (the plan from uniform routing puts
  them all in the first layer, which no layer before it can guess).
- **ktc disk tier, --mlock**: the first tier bundle with its RAM set locked.

Interleaved rounds, the sides' order rotated each round; medians of decode tokens/s, and each
ktc side's ratio to llama.cpp's in the same round. Needs root and cgroup v1's memory controller
(``/sys/fs/cgroup/memory``); says so and stops without them. The routing of these random models
is about uniform: no expert is much hotter than another, which is where a plan's RAM set can gain
least over the page cache's own choice. ``--routing guessable`` runs the same on a copy of the
model whose routing is skewed and which pre-gating guesses as well as a trained model's
(``guessable_checkpoint``), where the tier's prefetch is built to gain.

    python benchmarks/ram_short.py [--rounds 5] [--allowance 0.6] [--new 64] [--routing guessable]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as gen  # noqa: E402  (the models and llama.cpp's builds)

CGROUP = "/sys/fs/cgroup/memory"


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _anonymous(group: str) -> int:
    with open(os.path.join(CGROUP, group, "memory.stat")) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rss "))


def run_limited(command: list[str], limit: int | None, file: str) -> tuple[str, int]:
    """``command``'s output, run in a new memory cgroup (limited to ``limit`` bytes where given)
    after ``file`` is evicted from the page cache, and the cgroup's peak anonymous memory."""
    group = f"ktc-ram-short-{os.getpid()}-{time.monotonic_ns()}"
    path = os.path.join(CGROUP, group)
    os.mkdir(path)
    try:
        if limit is not None:
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        evict(file)
        proc = subprocess.Popen(["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh", *command],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak, done = [0], threading.Event()

        def watch() -> None:  # the peak of the anonymous part alone (v1 has no such counter)
            while not done.wait(0.02):
                peak[0] = max(peak[0], _anonymous(group))

        watcher = threading.Thread(target=watch)
        watcher.start()
        out, err = proc.communicate()
        done.set()
        watcher.join()
        if proc.returncode:
            raise SystemExit(f"{' '.join(command[:3])} failed ({proc.returncode}): {err[-2000:]}")
        return out, peak[0]
    finally:
        for _ in range(100):  # the group goes once its last process has
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.05)


def ktc_worker(bundle: str, new: int, mlock: bool, threads: int) -> None:
    """One ktc side's run (in its cgroup): decode tokens/s of random tokens and the prefetcher's
    figures, as JSON."""
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle

    flat = Sampling(temperature=1000.0, top_k=0, top_p=1.0, seed=0)  # every token about as likely
    with from_bundle(bundle, threads=threads, interleave=False, mlock=mlock) as km:
        generate(km, [100], max_new_tokens=2, sampling=flat, stop_at_eos=False)  # warm, as llama-bench
        result = generate(km, [101], max_new_tokens=new, sampling=flat, stop_at_eos=False)
        fetch = km.prefetcher
        print(json.dumps({"decode": result.decode_tokens_per_s,
                          "pinning": list(km.pinning) if km.pinning else None,
                          "prefetch": None if fetch is None else
                          {"paged": fetch.asked, "accuracy": fetch.accuracy, "not_paged": fetch.skipped}}))


def guessable_checkpoint(checkpoint: str, folder: str) -> str:
    """``checkpoint`` (the two-layer model) with routing that is skewed and that pre-gating
    guesses: both layers take the first layer's router with expert e's row scaled by
    1 + 2 exp(-e / 16) (a larger row wins its token's top k more often: the first 32 of 128
    experts take about two thirds of the choices), and the second layer's attention output
    projection is scaled by 0.05, so that the residual changes little between the first layer's
    output and the second's experts, as in a trained model (pre-gating then names about 90% of
    the second layer's experts, as on the trained demo; on the random model 23%)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(folder, exist_ok=True)
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    router = weights["model.layers.0.mlp.gate.weight"].float()
    scale = 1 + 2 * torch.exp(-torch.arange(router.shape[0], dtype=torch.float32) / 16)
    for layer in (0, 1):
        weights[f"model.layers.{layer}.mlp.gate.weight"] = (router * scale[:, None]).to(torch.bfloat16)
    projection = "model.layers.1.self_attn.o_proj.weight"
    weights[projection] = (weights[projection].float() * 0.05).to(torch.bfloat16)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    # the tokenizer's files, then the config: the folder's mark of being whole
    for name in sorted(os.listdir(checkpoint), key=lambda n: n == "config.json"):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(checkpoint, name), folder)
    return folder


def record_profile(bundle: str, path: str, tokens: int, threads: int) -> None:
    """The routing counts of ``tokens`` random tokens decoded by ``bundle`` (another seed than
    the runs'), saved as a profile for ``ktc compile --profile``."""
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle
    from ktc.runtime.moe import routing_profile

    flat = Sampling(temperature=1000.0, top_k=0, top_p=1.0, seed=1)
    with from_bundle(bundle, threads=threads, interleave=False) as km:
        for experts in km.experts:
            experts.counts[:] = 0
        generate(km, [7], max_new_tokens=tokens, sampling=flat, stop_at_eos=False)
        routing_profile(km.experts).save(path)  # each ExpertSet's layer and counts, as a MoE layer's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    parser.add_argument("--allowance", type=float, default=0.6, help="the page cache's share of the GGUF's bytes")
    parser.add_argument("--new", type=int, default=64, help="decoded tokens a run")
    parser.add_argument("--routing", choices=("random", "guessable"), default="random",
                        help="the model's routers as initialised, or made skewed and guessable a layer ahead "
                             "(guessable_checkpoint)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--disk-bandwidth", default="0.67GB/s",
                        help="the disk's read bandwidth for the tier's plan (ktc doctor --disk DIR measures it)")
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-generate"))
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"))
    parser.add_argument("--ktc-worker", nargs=2, metavar=("BUNDLE", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--mlock", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ktc_worker:
        ktc_worker(args.ktc_worker[0], int(args.ktc_worker[1]), args.mlock, args.threads)
        return 0
    if not os.access(CGROUP, os.W_OK):
        print(f"needs root and cgroup v1's memory controller at {CGROUP}: not here, nothing measured")
        return 1
    bench = os.path.join(args.llamacpp, "build", "bin", "llama-bench")
    if not os.path.exists(bench):
        print(f"llama.cpp's tools are not built in {args.llamacpp}: run ../shared/tools/build-llamacpp.sh")
        return 1
    from gguf import GGUFReader

    from ktc.compile import compile_bundle

    os.makedirs(args.workdir, exist_ok=True)
    checkpoint = gen.build_checkpoint("qwen3", os.path.join(args.workdir, "qwen3-2l"), 2)
    name = "qwen3-2l"
    if args.routing == "guessable":
        name = "qwen3-2l-guessable"
        checkpoint = guessable_checkpoint(checkpoint, os.path.join(args.workdir, name))
    gguf = gen.llama_gguf(args.llamacpp, checkpoint, name, "Q4_0", args.workdir, True)
    mapped = os.path.join(args.workdir, f"{name}-Q4_0-pure-from-gguf.ktb")
    if not os.path.exists(mapped):
        compile_bundle(gguf, mapped, cpu_scheme="q4_0", dense_scheme="q4_0", max_tokens=4096)
    allowance = int(args.allowance * os.path.getsize(gguf))
    embedding = next(int(t.n_bytes) for t in GGUFReader(gguf).tensors if t.name == "token_embd.weight")
    tiered = os.path.join(args.workdir, f"{name}-Q4_0-tier-{allowance}.ktb")
    profiled = os.path.join(args.workdir, f"{name}-Q4_0-tier-profiled-{allowance}.ktb")
    profile = os.path.join(args.workdir, f"{name}-Q4_0-random-profile.json")
    if not os.path.exists(profile):
        record_profile(mapped, profile, 256, args.threads)
    for path, extra in ((tiered, []), (profiled, ["--profile", profile])):
        if not os.path.exists(path):
            subprocess.run([sys.executable, "-m", "ktc.cli", "compile", gguf, "-o", path, "--vram", "0", "--ram",
                            f"{(allowance + embedding) // 10**6}MB", "--max-tokens", "512",
                            "--disk-bandwidth", args.disk_bandwidth, *extra], check=True, stdout=subprocess.DEVNULL)
    worker = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads), "--ktc-worker"]
    sides = {
        "llama.cpp (mmap, --repack 0)": ([bench, "-m", gguf, "-p", "0", "-n", str(args.new), "-t", str(args.threads),
                                          "-r", "1", "-o", "json", "-lm", "mmap", "--repack", "0"], gguf),
        "ktc mapped": (worker + [mapped, str(args.new)], mapped),
        "ktc disk tier": (worker + [tiered, str(args.new)], tiered),
        "ktc disk tier, profiled": (worker + [profiled, str(args.new)], profiled),
        "ktc disk tier, --mlock": (worker + [tiered, str(args.new), "--mlock"], tiered),
    }

    fetched: dict[str, list[str]] = {}  # each ktc side's prefetch figures, run by run

    def decode(name: str, out: str) -> float:
        if name.startswith("llama.cpp"):
            return next(r["avg_ts"] for r in json.loads(out) if r["n_gen"] > 0)
        result = json.loads(out.strip().splitlines()[-1])
        fetch = result["prefetch"]
        if fetch is not None:
            fetched.setdefault(name, []).append(
                f"{fetch['paged'] / 1e6:.0f} MB paged in, {fetch['not_paged']} guesses not, "
                f"{100 * (fetch['accuracy'] or 0):.0f}% of the experts used guessed")
        return result["decode"]

    # each side's own anonymous memory, without a limit, from a second run: the first may compile
    # ktc's kernels, whose compiler's memory a run from the cache does not take
    for command, file in sides.values():
        run_limited(command, None, file)
    anonymous = {name: run_limited(command, None, file)[1] for name, (command, file) in sides.items()}
    print(f"{args.rounds} rounds, {args.threads} threads, {args.new} random tokens decoded a run; page cache "
          f"allowance {allowance / 1e6:.0f} MB ({args.allowance:.2f} of the GGUF's {os.path.getsize(gguf) / 1e6:.0f} MB); "
          "each side's limit its own anonymous memory plus the allowance: " +
          ", ".join(f"{name} {anonymous[name] / 1e6:.0f} MB" for name in sides), flush=True)
    rows: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            command, file = sides[name]
            out, _ = run_limited(command, anonymous[name] + allowance, file)
            rows[name].append(decode(name, out))
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {rows[n][-1]:.1f}" for n in names) + " tok/s", flush=True)
    reference = rows[names[0]]
    print(f"\nmedians over {args.rounds} rounds:")
    for name in names:
        line = f"{name:30} decode {gen.median(rows[name]):6.1f} tok/s"
        if name != names[0]:
            ratios = [a / b for a, b in zip(rows[name], reference)]
            line += (f"; /llama.cpp {gen.median(ratios):.2f}x (rounds {' '.join(f'{r:.2f}' for r in ratios)})")
        print(line)
    for name, runs in fetched.items():  # the same every round where the reads are: said once then
        said = runs[0] if len(set(runs)) == 1 else "; ".join(f"round {i + 1} {r}" for i, r in enumerate(runs))
        print(f"{name} prefetch: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
