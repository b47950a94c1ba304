"""The placement solver against brute force on random small instances."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ktc.errors import BudgetError
from ktc.passes.placement_solver import (
    CPU, GPU, PlacementOption, PlacementProblem, is_feasible, solve_placement,
)


def random_problem(seed: int) -> PlacementProblem:
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 5))
    experts = int(rng.integers(2, 9))
    n_gpu = int(rng.integers(1, 3))
    n_cpu = int(rng.integers(1, 3))
    base = int(rng.integers(1, 5)) * 4096
    options = []
    for i in range(n_gpu):
        size = base * (2 - i)  # e.g. bf16 then half of it
        options.append(PlacementOption(GPU, f"g{i}", size, 0, size / float(rng.uniform(2, 20)),
                                       error=0.01 * (i + 1)))
    for i in range(n_cpu):
        size = base * (1 + (n_cpu - 1 - i)) // 1
        options.append(PlacementOption(CPU, f"c{i}", 0, size, size / float(rng.uniform(0.5, 10)),
                                       error=0.02 * (i + 1)))
    usage = rng.dirichlet(np.ones(experts), size=layers) * rng.uniform(0.5, 2)
    usage[rng.random(usage.shape) < 0.15] = 0.0  # some experts never used
    usage = np.clip(usage, 0, 1)
    if rng.random() < 0.3:  # ties: interchangeable experts are merged by the solver
        usage[:, : experts // 2] = usage[:, :1]
    allowed = np.ones((layers, experts, len(options)), dtype=bool)
    for _ in range(int(rng.integers(0, 3))):  # pins
        l, e = int(rng.integers(layers)), int(rng.integers(experts))
        device = GPU if rng.random() < 0.5 else CPU
        allowed[l, e] = [o.device == device for o in options]
    total_gpu = layers * experts * options[0].vram_bytes
    total_cpu = layers * experts * max(o.ram_bytes for o in options if o.device == CPU)
    # half the instances with a device step cost (drawn apart: the other fields stay as they were)
    own = np.random.default_rng(seed + 1000)
    device_seconds = own.uniform(0, 0.05, size=layers) if own.random() < 0.5 else None
    return PlacementProblem(
        usage=usage, options=tuple(options), allowed=allowed,
        vram_budget=int(rng.uniform(0.0, 0.8) * total_gpu),
        ram_budget=int(rng.uniform(0.3, 1.1) * total_cpu),
        sync_seconds=rng.uniform(0, 0.05, size=layers),
        quality_weight=float(rng.choice([0.0, 1e-9, 0.05])), device_seconds=device_seconds)


def brute_force(problem: PlacementProblem) -> float | None:
    """Enumerate every assignment of every layer (its own arithmetic, not the solver's model
    code); combine layers exactly over the (VRAM, RAM) they use."""
    layers, experts = problem.shape
    opts = problem.options
    n_opts = len(opts)
    assignments = np.array(list(itertools.product(range(n_opts), repeat=experts)), dtype=np.int64)
    seconds = np.array([o.seconds_per_use for o in opts])
    gpu = np.array([o.device == GPU for o in opts])
    vram = np.array([o.vram_bytes for o in opts])
    ram = np.array([o.ram_bytes for o in opts])
    err = np.array([o.error for o in opts])
    combined: dict[tuple[int, int], float] = {(0, 0): 0.0}
    for layer in range(layers):
        use = problem.usage[layer]
        ok = problem.allowed[layer][np.arange(experts), assignments].all(axis=1)
        a = assignments[ok]
        t = use * seconds[a]
        g = np.where(gpu[a], t, 0).sum(axis=1)
        c = np.where(gpu[a], 0, t).sum(axis=1)
        sync = np.where(((~gpu[a]) & (use > 0)).any(axis=1), problem.sync_seconds[layer], 0.0)
        if problem.device_seconds is not None:
            sync = sync + np.where((gpu[a] & (use > 0)).any(axis=1), problem.device_seconds[layer], 0.0)
        cost = np.maximum(g, c) + sync + problem.quality_weight * (use * err[a]).sum(axis=1)
        best: dict[tuple[int, int], float] = {}
        for v, r, value in zip(vram[a].sum(axis=1).tolist(), ram[a].sum(axis=1).tolist(), cost.tolist()):
            if value < best.get((v, r), np.inf):
                best[(v, r)] = value
        merged: dict[tuple[int, int], float] = {}
        for (v1, r1), c1 in combined.items():
            for (v2, r2), c2 in best.items():
                key = (v1 + v2, r1 + r2)
                if key[0] <= problem.vram_budget and key[1] <= problem.ram_budget:
                    if c1 + c2 < merged.get(key, np.inf):
                        merged[key] = c1 + c2
        combined = merged
    return min(combined.values()) if combined else None


@pytest.mark.parametrize("seed", range(80))
def test_solver_matches_brute_force(seed):
    problem = random_problem(seed)
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(BudgetError):
            solve_placement(problem)
        return
    solution = solve_placement(problem, time_limit=10)
    assert solution.optimal
    assert is_feasible(problem, solution.choice)
    assert solution.objective == pytest.approx(expected, rel=1e-7, abs=1e-12)
    assert solution.lower_bound <= solution.objective + 1e-12


def test_enough_instances_are_feasible_and_nontrivial():
    """The random family must exercise real trade-offs, not just infeasible or all-GPU cases."""
    feasible = mixed = 0
    for seed in range(80):
        problem = random_problem(seed)
        if brute_force(problem) is None:
            continue
        feasible += 1
        choice = solve_placement(problem).choice
        devices = {problem.options[c].device for c in choice.ravel()}
        mixed += devices == {GPU, CPU}
    assert feasible >= 50 and mixed >= 25, (feasible, mixed)


def test_a_device_step_cost_keeps_small_experts_on_the_cpu():
    """Experts whose GPU time saves less than the runtime's fixed cost of a device step stay on
    the CPU though VRAM holds them all; without that cost they all go to the GPU."""
    options = (PlacementOption(GPU, "g", 100, 0, 1e-6), PlacementOption(CPU, "c", 0, 100, 10e-6))
    usage = np.full((2, 4), 0.5)
    allowed = np.ones((2, 4, 2), dtype=bool)

    def solved(device_seconds):  # type: ignore[no-untyped-def]
        problem = PlacementProblem(usage=usage, options=options, allowed=allowed, vram_budget=800,
                                   ram_budget=800, sync_seconds=np.zeros(2), device_seconds=device_seconds)
        return solve_placement(problem)

    assert (solved(None).choice == 0).all()  # 4 x 0.5 x 9 us saved a layer
    cheap = solved(np.full(2, 5e-6))
    assert (cheap.choice == 0).all() and cheap.objective == pytest.approx(2 * (2e-6 + 5e-6))
    costly = solved(np.full(2, 50e-6))
    assert (costly.choice == 1).all() and costly.objective == pytest.approx(2 * 20e-6)
