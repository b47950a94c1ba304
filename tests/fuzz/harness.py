"""Mutation fuzzing of every input ktc reads, through its command line, in this process.

Seeds are tiny models made by the tests' model factory: a SafeTensors folder, a ``torch.save``
``.bin`` folder, a GGUF file, a bundle compiled from them, and the JSON inputs (a plan, an
activation profile, a hardware profile). Each case copies one seed, mutates its bytes (bit flips,
random or boundary bytes, mostly in the first KiB where the headers are, runs of bytes,
truncation, appended bytes), and runs the command that reads it:

    safetensors, pytorch, gguf  ktc inspect PATH --tensors
    config                      ktc inspect FOLDER --tensors (its config.json mutated)
    bundle                      ktc verify PATH
    plan                        ktc compile MODEL --plan PATH -o OUT --stop-after layout
    profile                     ktc plan MODEL --vram 16MiB --profile PATH
    hardware                    ktc plan MODEL --hardware PATH

An outcome is "accepted" (exit 0), "rejected" (exit 2 with ``error:``, or ``ktc verify``'s exit 1
with ``damaged:``), "crash" (any other exit, an exception, a traceback) or "hang" (over
``--timeout`` seconds).
For bundles an accepted mutation is a miss: every byte of a bundle is covered by a checksum.
Memory: the largest rise of the process's peak resident size over one case, after a warm-up of
uncounted cases (the first runs through each error path import modules and grow the allocator's
pools), against the bytes the case's command reads (the seed, plus the model for JSON inputs).

    .venv/bin/python tests/fuzz/harness.py --cases 10000            # every format, 10,000 each
    .venv/bin/python tests/fuzz/harness.py --formats gguf,bundle --cases 500 --seed 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

WARM_UP_CASES = 50
FORMATS = ("safetensors", "config", "pytorch", "gguf", "bundle", "plan", "profile", "hardware")


@dataclass
class Tally:
    accepted: int = 0
    rejected: int = 0
    crash: int = 0
    hang: int = 0
    max_growth_bytes: int = 0
    max_growth_case: int = -1
    seed_bytes: int = 0
    input_bytes: int = 0  # everything the command reads: the seed, and the model for JSON inputs
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)  # a few crashes and hangs, for the report

    @property
    def cases(self) -> int:
        return self.accepted + self.rejected + self.crash + self.hang


@dataclass(frozen=True)
class Seed:
    """One input to mutate: ``target`` is the file that is mutated, inside ``root`` (a folder
    copied whole for each case, or the file itself); ``command`` has ``{path}`` and ``{out}``."""

    fmt: str
    root: str
    target: str
    command: tuple[str, ...]
    also_reads: str | None = None  # the model folder the command reads besides the seed

    @property
    def input_bytes(self) -> int:
        paths = [self.root] + ([self.also_reads] if self.also_reads else [])
        total = 0
        for path in paths:
            if os.path.isdir(path):
                total += sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
            else:
                total += os.path.getsize(path)
        return total


class _Timeout(BaseException):
    pass


def build_seeds(folder: str) -> dict[str, Seed]:
    """Seeds made with the tests' model factory and ktc itself, under ``folder``."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import model_factory as mf
    from ktc.api import plan as make_plan
    from ktc.compile import compile_bundle
    from ktc.formats.activation_profile import uniform_profile

    model = mf.build_hf_model("mixtral")
    st = mf.write_safetensors(model, os.path.join(folder, "st"))
    pt = mf.write_pytorch_from_safetensors(st, os.path.join(folder, "pt"))
    gguf = mf.write_gguf(st, os.path.join(folder, "m.gguf"), family="mixtral")
    bundle = os.path.join(folder, "m.ktb")
    compile_bundle(gguf, bundle, cpu_scheme="q8_0")
    plan = make_plan(st, vram="64MiB", reserve="0", time_limit=5)
    plan_path = os.path.join(folder, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan.to_json(), f)
    profile_path = os.path.join(folder, "profile.json")
    uniform_profile(tuple(plan.to_json()["model"]["moe_layers"]), plan.to_json()["model"]["num_experts"]).save(
        profile_path)
    hardware_path = os.path.join(folder, "hardware.json")
    with open(hardware_path, "w") as f:
        json.dump({"format": "ktc-hardware-profile", "version": 1, "vram_bytes": 64 << 20,
                   "ram_bytes": 1 << 30, "reserve_bytes": 0, "cpu_bandwidth": 5e10}, f)

    def first(folder_: str, suffix: str) -> str:
        return os.path.join(folder_, next(n for n in sorted(os.listdir(folder_)) if n.endswith(suffix)))

    inspect = ("inspect", "{path}", "--tensors", "--json")
    return {
        "safetensors": Seed("safetensors", st, first(st, ".safetensors"), inspect),
        "config": Seed("config", st, os.path.join(st, "config.json"), inspect),
        "pytorch": Seed("pytorch", pt, first(pt, ".bin"), inspect),
        "gguf": Seed("gguf", gguf, gguf, inspect),
        "bundle": Seed("bundle", bundle, bundle, ("verify", "{path}")),
        "plan": Seed("plan", plan_path, plan_path,
                     ("compile", st, "--plan", "{path}", "-o", "{out}", "--stop-after", "layout"), st),
        "profile": Seed("profile", profile_path, profile_path,
                        ("plan", st, "--vram", "64MiB", "--reserve", "0", "--profile", "{path}"), st),
        "hardware": Seed("hardware", hardware_path, hardware_path, ("plan", st, "--hardware", "{path}"), st),
    }


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation of ``data``: most land in the first KiB, where headers and metadata are."""
    out = bytearray(data)
    if not out:
        return bytes([rng.randrange(256)])

    def position() -> int:
        return rng.randrange(min(len(out), 1024) if rng.random() < 0.7 else len(out))

    kind = rng.randrange(7)
    if kind == 0:  # flip one to four bits
        for _ in range(rng.randint(1, 4)):
            out[position()] ^= 1 << rng.randrange(8)
    elif kind == 1:  # random bytes
        for _ in range(rng.randint(1, 4)):
            out[position()] = rng.randrange(256)
    elif kind == 2:  # boundary values, where counts and lengths overflow
        for _ in range(rng.randint(1, 2)):
            out[position()] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF))
    elif kind == 3:  # a run of equal bytes (a length or offset made huge or zero)
        at = position()
        out[at: at + rng.randint(2, 8)] = bytes([rng.choice((0x00, 0xFF))]) * rng.randint(2, 8)
    elif kind == 4:  # truncate
        del out[rng.randrange(len(out)):]
    elif kind == 5:  # append
        out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:  # copy a few bytes from elsewhere in the file (a valid-looking but wrong field)
        src, dst, n = position(), position(), rng.randint(1, 8)
        out[dst: dst + n] = out[src: src + n]
    if bytes(out) == data:  # a no-op: change one byte for sure
        out[position()] ^= 0xFF
    return bytes(out)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _run_case(seed: Seed, data: bytes | None, work: str, timeout: float) -> tuple[str, str]:
    """Copy the seed into ``work``, write ``data`` over its target (None: unchanged), run the
    command; returns (outcome, detail)."""
    from click.testing import CliRunner

    from ktc.cli import main

    case = os.path.join(work, "case")
    shutil.rmtree(case, ignore_errors=True)
    os.makedirs(case)
    if os.path.isdir(seed.root):
        root = shutil.copytree(seed.root, os.path.join(case, os.path.basename(seed.root)))
        target = os.path.join(root, os.path.relpath(seed.target, seed.root))
    else:
        root = target = shutil.copyfile(seed.root, os.path.join(case, os.path.basename(seed.root)))
    if data is not None:
        with open(target, "wb") as f:
            f.write(data)
    args = [a.format(path=root, out=os.path.join(case, "out.ktb")) for a in seed.command]
    try:
        with _deadline(timeout):
            result = CliRunner().invoke(main, args)
    except _Timeout:
        return "hang", f"{seed.fmt}: over {timeout} s"
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "crash", f"{seed.fmt}: {type(result.exception).__name__}: {str(result.exception)[:200]}"
    if "Traceback" in output:
        return "crash", f"{seed.fmt}: traceback in the output"
    if result.exit_code == 0:
        return "accepted", ""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    # 2: a user error (ktc's "error: ..." or click's usage error); 1: ktc verify's "damaged: ..."
    first = lines[0] if lines else ""
    if (result.exit_code == 2 and first.startswith(("error:", "Error:", "Usage:"))) or \
            (result.exit_code == 1 and first.startswith("damaged:")):
        return "rejected", ""
    return "crash", f"{seed.fmt}: exit {result.exit_code}: {output.strip()[:200]}"


def fuzz(formats: tuple[str, ...] = FORMATS, cases: int = 100, seed: int = 0, timeout: float = 20.0,
         work: str | None = None, progress: bool = False, warm_up: int = WARM_UP_CASES,
         save: str | None = None) -> dict[str, Tally]:
    """Run ``cases`` mutations of each format's seed; returns a tally per format. With ``save``,
    the input of every crash and hang is written there (``FORMAT-CASE.bin``) to replay."""
    owned = work is None
    work = work or tempfile.mkdtemp(prefix="ktc-fuzz-")
    try:
        seeds = build_seeds(os.path.join(work, "seeds"))
        tallies = {}
        for fmt in formats:
            s = seeds[fmt]
            raw = open(s.target, "rb").read()
            outcome, detail = _run_case(s, None, work, timeout)
            if outcome != "accepted":
                raise RuntimeError(f"the unmutated {fmt} seed is not accepted: {detail}")
            # Warm-up, not counted: the first runs through each error path import modules and
            # grow the allocator's pools, which is not what a mutated input costs.
            warm = random.Random(f"warm-{fmt}")
            for _ in range(warm_up):
                _run_case(s, mutate(raw, warm), work, timeout)
            tally = Tally(seed_bytes=len(raw), input_bytes=s.input_bytes)
            rng = random.Random(f"{seed}-{fmt}")
            started = time.perf_counter()
            for i in range(cases):
                data = mutate(raw, rng)
                before = _peak_rss_bytes()
                outcome, detail = _run_case(s, data, work, timeout)
                growth = _peak_rss_bytes() - before
                if growth > tally.max_growth_bytes:
                    tally.max_growth_bytes, tally.max_growth_case = growth, i
                setattr(tally, outcome, getattr(tally, outcome) + 1)
                if detail and len(tally.examples) < 5:
                    tally.examples.append(f"case {i}: {detail}")
                if detail and save:
                    os.makedirs(save, exist_ok=True)
                    with open(os.path.join(save, f"{fmt}-{i}.bin"), "wb") as f:
                        f.write(data)
                if progress and (i + 1) % 500 == 0:
                    print(f"  {fmt}: {i + 1}/{cases}", file=sys.stderr, flush=True)
            tally.seconds = time.perf_counter() - started
            tallies[fmt] = tally
        return tallies
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def report(tallies: dict[str, Tally]) -> str:
    lines = [f"{'format':<12} {'cases':>6} {'rejected':>8} {'accepted':>8} {'crash':>5} {'hang':>4} "
             f"{'peak RSS rise':>13} {'input size':>10} {'s/case':>7}"]
    for fmt, t in tallies.items():
        lines.append(f"{fmt:<12} {t.cases:>6} {t.rejected:>8} {t.accepted:>8} {t.crash:>5} {t.hang:>4} "
                     f"{t.max_growth_bytes / 2**10:>9.0f} KiB {t.input_bytes / 2**10:>6.0f} KiB "
                     f"{t.seconds / max(t.cases, 1):>7.3f}")
        lines += [f"    {e}" for e in t.examples]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list of " + ", ".join(FORMATS))
    parser.add_argument("--cases", type=int, default=1000, help="mutations per format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a case is a hang")
    parser.add_argument("--json", action="store_true", help="print the tallies as JSON")
    parser.add_argument("--save", metavar="DIR", help="write the input of each crash and hang here")
    args = parser.parse_args()
    formats = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown format(s) {unknown}; known: {', '.join(FORMATS)}")
    tallies = fuzz(formats, args.cases, args.seed, args.timeout, progress=True, save=args.save)
    if args.json:
        print(json.dumps({f: {**t.__dict__, "cases": t.cases} for f, t in tallies.items()}, indent=1))
    else:
        print(report(tallies))
    sys.exit(1 if any(t.crash or t.hang for t in tallies.values()) else 0)


if __name__ == "__main__":
    main()
