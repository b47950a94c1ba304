"""``ktc compile`` and ``ktc verify`` as processes: exit codes, kills at any moment."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

KTC = [sys.executable, "-m", "ktc.cli"]
# The kill tests start a compile a dozen times: they detect the demo's experts with the declarative
# tables (the same bundle, byte for byte), since importing transformers and torch for its model
# structure took about 5 of each compile's 6 seconds; what they test is the writing.
TABLES_ONLY = dict(os.environ, KTC_NO_TRANSFORMERS_DETECTION="1")


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_compile_verify_and_damage(tmp_path, demo_model):
    out = tmp_path / "d.ktb"
    proc = subprocess.run(KTC + ["compile", demo_model, "-o", str(out), "--vram", "16MiB", "--reserve", "0",
                                 "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["sha256"] == sha(out) and info["gpu_experts"] > 0
    ok = subprocess.run(KTC + ["verify", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout
    raw = bytearray(out.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    out.write_bytes(bytes(raw))
    bad = subprocess.run(KTC + ["verify", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "damaged" in bad.stderr and "Traceback" not in bad.stderr
    assert "layers." in bad.stderr or "model." in bad.stderr  # the damaged tensor is named


def test_compile_from_a_plan_file(tmp_path, demo_model):
    plan = tmp_path / "plan.json"
    subprocess.run(KTC + ["plan", demo_model, "--vram", "16MiB", "--reserve", "0", "-o", str(plan)],
                   check=True, capture_output=True)
    proc = subprocess.run(KTC + ["compile", demo_model, "--plan", str(plan), "-o", str(tmp_path / "p.ktb"),
                                 "--json"], capture_output=True, text=True, check=True)
    planned = json.loads(plan.read_text())
    assert json.loads(proc.stdout)["gpu_experts"] == sum(planned["gpu_experts_per_layer"].values())


def _temp_files(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_sigkill_at_any_moment_leaves_nothing_or_the_previous_bundle(tmp_path, demo_model):
    out = tmp_path / "out.ktb"
    slow = KTC + ["compile", demo_model, "-o", str(out), "--cpu-scheme", "f32", "--report-error", "--compress"]
    # Before any bundle exists: killed at start-up, OUT must be absent.
    proc = subprocess.Popen(slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=TABLES_ONLY)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    subprocess.run(KTC + ["compile", demo_model, "-o", str(out)], check=True, capture_output=True, env=TABLES_ONLY)
    previous = sha(out)
    mid_write = 0
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2, 0.4, None):
        for stale in _temp_files(tmp_path):
            os.unlink(tmp_path / stale)
        proc = subprocess.Popen(slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=TABLES_ONLY)
        if delay is None:
            time.sleep(0.5)  # during start-up, before anything is written
        else:
            deadline = time.time() + 60
            while not _temp_files(tmp_path) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.002)
            time.sleep(delay)
        writing = bool(_temp_files(tmp_path)) and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        mid_write += writing
        if sha(out) != previous:  # the run finished before the kill: then OUT is the new, whole bundle
            assert subprocess.run(KTC + ["verify", str(out)], capture_output=True).returncode == 0
            previous = sha(out)
    assert mid_write >= 3, "the kills did not land while the bundle was being written"


def test_stop_after_and_dump_after(tmp_path, demo_model):
    out = tmp_path / "s.ktb"
    proc = subprocess.run(KTC + ["compile", demo_model, "-o", str(out), "--vram", "16MiB", "--reserve", "0",
                                 "--check", "--stop-after", "layout", "--dump-after", "layout"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "stopped after the layout pass" in proc.stdout and not out.exists()
    dumped = json.loads(proc.stderr[proc.stderr.index("{"):])
    assert dumped["after"] == "layout" and dumped["layout"]["blocks"] > 0


def _process_group(pgid: int) -> list[int]:
    """Live processes of a process group (a compile started in its own session keeps its
    workers and multiprocessing's resource tracker in its group, even once they are orphans)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]
        if int(group) == pgid and state != "Z":
            members.append(int(entry))
    return members


def _without_spawn_cut_short(err: str, signum: int) -> str:
    """``err`` without the one traceback a SIGKILL may leave: a worker whose parent was killed
    while handing it its instructions (multiprocessing's spawn writes them into a pipe after the
    worker process exists; a SIGKILL cannot be held off) reads a pipe that ends early and Python
    reports it (EOFError in spawn_main). The worker then exits: the caller checks that no process
    is left. A SIGTERM is held while workers start (ktc.errors.signals_held), so it leaves none."""
    if signum != signal.SIGKILL:
        return err
    kept, block = [], []
    for line in err.splitlines():
        if line.startswith("Traceback") or block:
            block.append(line)
            if not line.startswith((" ", "Traceback")):  # the exception line ends the block
                if not ("spawn_main" in "\n".join(block) and line.startswith("EOFError")):
                    kept.extend(block)
                block = []
        else:
            kept.append(line)
    return "\n".join(kept + block)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_killed_parallel_compile_leaves_no_process_and_its_temporary_is_removed(tmp_path, demo_model, signum):
    out = tmp_path / "out.ktb"
    command = KTC + ["compile", demo_model, "-o", str(out), "--jobs", "2"]
    rng = random.Random(signum)
    killed_while_writing = 0
    first_seen = []  # (bytes on disk, size) of each temporary file when it appeared
    for _ in range(5):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env=TABLES_ONLY)
        mine = f".ktc-{proc.pid}-"
        deadline = time.time() + 120
        while not (names := [n for n in _temp_files(tmp_path) if mine in n]) and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.005)
        try:
            st = os.stat(tmp_path / names[0])
            first_seen.append((st.st_blocks * 512, st.st_size))
        except (IndexError, FileNotFoundError):
            pass
        time.sleep(rng.uniform(0.0, 0.6))  # writing the experts takes about a second here
        killed_while_writing += proc.poll() is None
        proc.send_signal(signum)
        # communicate() returns only once every holder of the pipes is gone: workers that
        # outlived the parent would hang it (the `ktc compile | tee` hang).
        _, err = proc.communicate(timeout=30)
        gone_by = time.time() + 1.0
        while _process_group(proc.pid) and time.time() < gone_by:
            time.sleep(0.05)
        assert _process_group(proc.pid) == [], "a worker or the resource tracker outlived the compile"
        if proc.returncode == 0 or (proc.returncode == -signum and out.exists()):
            # finished before the signal, or the signal came once the command was done and the
            # process was exiting (its handler gone: the default action): the bundle is whole
            assert subprocess.run(KTC + ["verify", str(out)], capture_output=True).returncode == 0
            out.unlink()  # start again
            continue
        if b"was written whole" in err:  # stopped after the bundle was renamed into place: it is whole
            assert signum == signal.SIGTERM and proc.returncode == 128 + signal.SIGTERM
            assert subprocess.run(KTC + ["verify", str(out)], capture_output=True).returncode == 0
            assert _temp_files(tmp_path) == []
            out.unlink()
            continue
        assert not out.exists()
        assert "Traceback" not in _without_spawn_cut_short(err.decode(), signum)
        if signum == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM and b"stopped by SIGTERM" in err
            assert _temp_files(tmp_path) == []
    assert killed_while_writing >= 3
    # Pre-sized but sparse: a killed compile's file holds only what was written.
    assert any(on_disk < size // 2 for on_disk, size in first_seen), first_seen
    if signum == signal.SIGKILL:
        stale = _temp_files(tmp_path)
        assert stale, "SIGKILL cannot be handled: the temporary file stays until the next compile"
        done = subprocess.run(command, capture_output=True, text=True, env=TABLES_ONLY)
        assert done.returncode == 0, done.stderr
        assert _temp_files(tmp_path) == [] and "left by a compile that was killed" in done.stderr
        assert subprocess.run(KTC + ["verify", str(out)], capture_output=True).returncode == 0


def test_stopping_the_workers_stops_the_expert_they_are_building():
    # Python's shutdown() drops the pool's list of its workers: stopping them after it found
    # none, and a stopped compile then waited for the experts in flight.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ktc.passes.emit import _stop_workers

    pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    busy = [pool.submit(time.sleep, 120) for _ in range(3)]
    deadline = time.time() + 60
    while not all(f.running() for f in busy[:2]):
        assert time.time() < deadline
        time.sleep(0.05)
    pids = [worker.pid for worker in pool._processes.values()]
    assert len(pids) == 2
    manager = pool._executor_manager_thread
    _stop_workers(pool)
    # ... and the pool's manager thread has ended, its wake-up pipe closed: Python 3.11's exit
    # handler raced it ("Bad file descriptor" after a SIGTERM'd compile)
    assert manager is None or not manager.is_alive()
    # Asked of the kernel, not of Process.is_alive(): the pool's own thread reaps the workers too,
    # and a Process whose child another thread reaped reads as alive.
    deadline = time.time() + 20
    while not all(_exited(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert all(_exited(pid) for pid in pids), [(pid, _state(pid)) for pid in pids]


def _exited(pid: int) -> bool:
    """The process is gone or a zombie (dead, not yet reaped)."""
    return _state(pid) in ("gone", "Z")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the open and the read)
        return "gone"


def test_only_temporaries_whose_writer_is_gone_are_removed(tmp_path):
    from ktc.passes.emit import remove_stale_temporaries, temporary_prefix

    assert temporary_prefix(str(tmp_path / "m.ktb")) == f".m.ktb.ktc-{os.getpid()}-"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".m.ktb.ktc-{dead.pid}-abc123.tmp"
    stale.write_bytes(b"x")
    live = tmp_path / f".m.ktb.ktc-{os.getpid()}-abc123.tmp"
    live.write_bytes(b"x")
    other = tmp_path / ".m.ktb.abc123.tmp"  # not ours: kept
    other.write_bytes(b"x")
    removed = remove_stale_temporaries(str(tmp_path))
    assert [p for p, _ in removed] == [str(stale)]
    assert live.exists() and other.exists() and not stale.exists()


class _CompilerFrame:
    """A stand-in for the frame a signal interrupts inside llvmlite (``cli._in_compiler``)."""

    class f_code:  # noqa: N801
        co_filename = os.path.join(os.sep, "site-packages", "llvmlite", "binding", "ffi.py")

    f_back = None


def test_sigterm_inside_numba_s_compiler_takes_effect_once_out_of_it():
    """A SIGTERM that interrupts Numba's compiler or llvmlite does not raise there (a ctypes
    callback swallowed it and the compile ran on to exit 0; a half-built llvmlite object printed
    a traceback at exit): the stop is asked for again shortly and raises in ktc's own code."""
    from ktc import cli
    from ktc.errors import Terminated

    returned = False
    with pytest.raises(Terminated):
        with cli._sigterm_raises():
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, _CompilerFrame())
            returned = True
            deadline = time.time() + 10
            while time.time() < deadline:
                time.sleep(0.01)
    assert returned


def test_sigterm_asked_again_is_not_sent_once_the_command_is_done():
    """The stop asked for again is dropped when the command ends first: nothing reaches the
    SIGTERM handler that was there before."""
    from ktc import cli

    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with cli._sigterm_raises():
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, _CompilerFrame())
        time.sleep(10 * cli._AGAIN_AFTER)
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_stop_after_the_output_is_in_place_says_it_is_whole(capsys):
    """A SIGTERM that lands after the bundle was renamed into place (while the passes' checks
    read it, or the summary prints) stops the command, and says the bundle is whole; the next
    command starts with nothing written."""
    from ktc import cli
    from ktc.errors import Terminated, mark_written

    @cli._handle_errors
    def finished_then_stopped() -> None:
        mark_written("out.ktb")
        raise Terminated(signal.SIGTERM)

    @cli._handle_errors
    def stopped() -> None:
        raise Terminated(signal.SIGTERM)

    for command, words in ((finished_then_stopped, "after out.ktb was written whole"),
                           (stopped, "stopped by SIGTERM; nothing half-written")):
        with pytest.raises(SystemExit) as stop:
            command()
        assert stop.value.code == 128 + signal.SIGTERM
        err = capsys.readouterr().err
        assert words in err and (command is finished_then_stopped or "written whole" not in err)
