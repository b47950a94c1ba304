"""``ktc compile`` and ``ktc verify`` as processes: exit codes, kills at any moment."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

KTC = [sys.executable, "-m", "ktc.cli"]


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
    proc = subprocess.Popen(slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    subprocess.run(KTC + ["compile", demo_model, "-o", str(out)], check=True, capture_output=True)
    previous = sha(out)
    mid_write = 0
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2, 0.4, None):
        for stale in _temp_files(tmp_path):
            os.unlink(tmp_path / stale)
        proc = subprocess.Popen(slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
