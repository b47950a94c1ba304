"""The placement problem and its exact solver.

Every routed expert takes one option (a device and a scheme). A MoE layer costs
``max(gpu_time, cpu_time) + sync`` where each side's time is the sum over its experts of
``usage x seconds_per_use`` and the sync is paid when the layer has a CPU expert that can be used.
Options use VRAM or RAM, within budgets. A small quality term (usage-weighted nominal error times
``quality_weight``) prefers the more precise scheme when speed does not care.

This is a mixed-integer program; we hand it to HiGHS (through ``highspy``), which
either proves optimality or reports its best bound, so every solution carries a proven gap.
Experts of a layer with equal usage and equal allowed options are interchangeable, so they are
merged into one integer variable: a uniform profile gives one variable per layer and option.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ktc.errors import BudgetError

GPU, CPU, DISK = "gpu", "cpu", "disk"  # a disk option runs on the CPU's side and takes no RAM


@dataclass(frozen=True)
class PlacementOption:
    """Where an expert may live and what it costs there."""

    device: str  # "gpu", "cpu" or "disk"
    scheme: str
    vram_bytes: int  # bytes of VRAM it occupies (0 on the CPU)
    ram_bytes: int  # bytes of RAM it occupies (0 on the GPU)
    seconds_per_use: float  # data bytes over the device's bandwidth
    error: float = 0.0  # nominal relative error of the scheme, for the quality term


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """``usage[l, e]``: probability that a decode step uses expert e of MoE layer l.
    ``allowed[l, e, o]``: whether option o is allowed (pins restrict it)."""

    usage: np.ndarray
    options: tuple[PlacementOption, ...]
    allowed: np.ndarray
    vram_budget: int
    ram_budget: int
    sync_seconds: np.ndarray  # per layer
    quality_weight: float = 0.0
    # per layer: the runtime's fixed cost of a step that runs any of the layer's experts on the
    # GPU (``HardwareProfile.device_step_seconds``); None: none
    device_seconds: np.ndarray | None = None
    # [layers, options]: each option's error layer by layer (measured on activations), instead of
    # its nominal ``error`` in every layer
    layer_errors: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.usage.shape  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class PlacementSolution:
    choice: np.ndarray  # [layers, experts] option index
    objective: float  # seconds per decode step spent in routed experts (+ the quality term)
    lower_bound: float  # proven: no placement does better
    optimal: bool
    solve_seconds: float
    method: str

    @property
    def gap(self) -> float:
        """Relative gap between this solution and the proven bound."""
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / self.objective)


@dataclass(frozen=True)
class Evaluation:
    objective: float
    expert_seconds: float  # the time part, without the quality term
    layer_seconds: tuple[float, ...]
    vram_bytes: int
    ram_bytes: int


@dataclass(frozen=True, eq=False)
class _OptionArrays:
    """The options' fields as arrays indexed by option."""

    seconds: np.ndarray
    on_gpu: np.ndarray
    error: np.ndarray  # [layers, options]
    vram: np.ndarray
    ram: np.ndarray

    @classmethod
    def of(cls, problem: PlacementProblem) -> _OptionArrays:
        opts = problem.options
        error = problem.layer_errors
        if error is None:
            error = np.broadcast_to(np.array([o.error for o in opts]), (problem.usage.shape[0], len(opts)))
        return cls(np.array([o.seconds_per_use for o in opts]), np.array([o.device == GPU for o in opts]),
                   error, np.array([o.vram_bytes for o in opts], dtype=np.int64),
                   np.array([o.ram_bytes for o in opts], dtype=np.int64))

    def side_times(self, usage: np.ndarray, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, the expected seconds of its GPU experts and of its CPU experts."""
        t = usage * self.seconds[choice]
        on_gpu = self.on_gpu[choice]
        return np.where(on_gpu, t, 0.0).sum(axis=1), np.where(on_gpu, 0.0, t).sum(axis=1)


def evaluate(problem: PlacementProblem, choice: np.ndarray) -> Evaluation:
    """Cost and memory of a placement under the problem's model (no feasibility check)."""
    a = _OptionArrays.of(problem)
    on_gpu, error, vram, ram = a.on_gpu, a.error, a.vram, a.ram
    use = problem.usage
    gpu_time, cpu_time = a.side_times(use, choice)
    cpu_active = ((~on_gpu[choice]) & (use > 0)).any(axis=1)
    layers = np.maximum(gpu_time, cpu_time) + np.where(cpu_active, problem.sync_seconds, 0.0)
    if problem.device_seconds is not None:
        gpu_active = (on_gpu[choice] & (use > 0)).any(axis=1)
        layers = layers + np.where(gpu_active, problem.device_seconds, 0.0)
    quality = problem.quality_weight * float((use * np.take_along_axis(error, choice, axis=1)).sum())
    return Evaluation(float(layers.sum()) + quality, float(layers.sum()), tuple(layers.tolist()),
                      int(vram[choice].sum()), int(ram[choice].sum()))


def is_feasible(problem: PlacementProblem, choice: np.ndarray) -> bool:
    ev = evaluate(problem, choice)
    allowed = np.take_along_axis(problem.allowed, choice[..., None], axis=2).all()
    return bool(allowed) and ev.vram_bytes <= problem.vram_budget and ev.ram_bytes <= problem.ram_budget


def solve_placement(problem: PlacementProblem, *, time_limit: float = 1.5,
                    rel_gap: float = 1e-6) -> PlacementSolution:
    """The cheapest feasible placement, proven optimal or with a proven bound.

    Raises ``BudgetError`` when no placement fits the budgets and pins.
    """
    started = time.perf_counter()
    n_layers, n_experts = problem.shape
    n_opts = len(problem.options)
    a = _OptionArrays.of(problem)
    seconds, on_gpu, error = a.seconds, a.on_gpu, a.error
    vram, ram = a.vram.astype(np.float64), a.ram.astype(np.float64)

    allowed_all = problem.allowed
    if problem.quality_weight == 0:
        # Speed alone decides: an option with no fewer bytes on the same device and no less
        # speed than another can be left out of the search (polish may still pick it when it
        # costs no time), which keeps the program small when several schemes are allowed. Only
        # for experts where the better option is allowed too (options may be allowed per layer).
        allowed_all = problem.allowed.copy()
        for i, a in enumerate(problem.options):
            for j, b in enumerate(problem.options):
                if i != j and a.device == b.device and (
                        b.vram_bytes <= a.vram_bytes and b.ram_bytes <= a.ram_bytes
                        and b.seconds_per_use <= a.seconds_per_use
                        and (b.vram_bytes, b.ram_bytes, b.seconds_per_use, j)
                        < (a.vram_bytes, a.ram_bytes, a.seconds_per_use, i)):
                    allowed_all[..., i] &= ~problem.allowed[..., j]
    # Groups of interchangeable experts: same layer, same usage, same allowed options.
    groups: list[tuple[int, float, np.ndarray, list[int]]] = []
    for layer in range(n_layers):
        index: dict[tuple[float, bytes], int] = {}
        for expert in range(n_experts):
            key = (float(problem.usage[layer, expert]), allowed_all[layer, expert].tobytes())
            if key not in index:
                index[key] = len(groups)
                groups.append((layer, key[0], allowed_all[layer, expert], []))
            groups[index[key]][3].append(expert)
    n_groups = len(groups)
    g_layer = np.array([g[0] for g in groups])
    g_use = np.array([g[1] for g in groups])
    g_size = np.array([len(g[3]) for g in groups], dtype=np.float64)
    g_allowed = np.array([g[2] for g in groups]).reshape(n_groups, n_opts)
    if not g_allowed.any(axis=1).all():
        bad = int(np.argmin(g_allowed.any(axis=1)))
        raise BudgetError(f"expert {groups[bad][3][0]} of MoE layer {groups[bad][0]} has no allowed "
                          "placement (pinned to both devices?)")

    # Variables: x[g, o] (count of group g's experts on option o), z[l] (layer time), y[l] (sync),
    # and where the device's steps cost, w[l] (a step with device experts).
    nx = n_groups * n_opts
    z0, y0 = nx, nx + n_layers
    stepped = problem.device_seconds is not None and bool(np.any(problem.device_seconds > 0))
    w0 = nx + 2 * n_layers
    n_vars = nx + (3 if stepped else 2) * n_layers
    scale = 1e3  # milliseconds keep the coefficients near 1
    g_idx = np.repeat(np.arange(n_groups), n_opts)
    o_idx = np.tile(np.arange(n_opts), n_groups)
    x_cost = (g_use[g_idx] * seconds[o_idx] * scale)
    cost = np.zeros(n_vars)
    # The quality term goes into the program only when it is a real trade-off; as a tie-break
    # (weight 0) it is left to ``polish``: coefficients near the solver's tolerances slow it
    # down for nothing.
    cost[:nx] = problem.quality_weight * scale * g_use[g_idx] * error[g_layer[g_idx], o_idx]
    cost[z0:y0] = 1.0
    cost[y0:w0] = problem.sync_seconds * scale
    if stepped:
        cost[w0:] = problem.device_seconds * scale

    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    n_rows = 0

    def add(r: np.ndarray, c: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        nonlocal n_rows
        rows.append(r + n_rows)
        cols.append(c)
        vals.append(v)
        lower.append(lo)
        upper.append(hi)
        n_rows += len(lo)

    # Each group's experts all placed: sum_o x[g, o] = size[g].
    add(g_idx, np.arange(nx), np.ones(nx), g_size, g_size)
    # z[l] >= gpu time of layer l and z[l] >= cpu time of layer l.
    for side, mask in ((0, on_gpu), (1, ~on_gpu)):
        sel = mask[o_idx] & (x_cost > 0)
        r = g_layer[g_idx[sel]]
        add(np.concatenate([r, np.arange(n_layers)]),
            np.concatenate([np.nonzero(sel)[0], z0 + np.arange(n_layers)]),
            np.concatenate([x_cost[sel], -np.ones(n_layers)]),
            np.full(n_layers, -np.inf), np.zeros(n_layers))
    def forces(device_mask: np.ndarray, first: int) -> None:
        """A used expert on an option of ``device_mask`` forces its layer's indicator (the
        variable at ``first + layer``) to 1: x[g, o] <= size[g] * indicator[l]."""
        sel = device_mask[o_idx] & (g_use[g_idx] > 0)
        k = int(sel.sum())
        if k:
            add(np.concatenate([np.arange(k), np.arange(k)]),
                np.concatenate([np.nonzero(sel)[0], first + g_layer[g_idx[sel]]]),
                np.concatenate([np.ones(k), -g_size[g_idx[sel]]]),
                np.full(k, -np.inf), np.zeros(k))

    forces(~on_gpu, y0)  # the sync, where the CPU has a used expert
    if stepped:
        forces(on_gpu, w0)  # the device's step, where the GPU has one
    # Budgets, in units of the sizes' greatest common divisor (a page, usually): integer
    # coefficients and an integer right-hand side, so solver tolerances cannot let a placement
    # overshoot a budget by a few bytes.
    for per_option, budget in ((vram, problem.vram_budget), (ram, problem.ram_budget)):
        sel = per_option[o_idx] > 0
        if sel.any():
            unit = int(np.gcd.reduce(per_option[per_option > 0].astype(np.int64)))
            add(np.zeros(int(sel.sum()), dtype=np.int64), np.nonzero(sel)[0],
                per_option[o_idx[sel]] / unit, np.array([-np.inf]), np.array([float(budget // unit)]))

    upper_x = np.where(g_allowed[g_idx, o_idx], g_size[g_idx], 0.0)
    col_upper = np.concatenate([upper_x, np.full(n_layers, np.inf), np.ones((2 if stepped else 1) * n_layers)])
    integer = np.concatenate([np.ones(nx, bool), np.zeros(n_layers, bool), np.ones((2 if stepped else 1) * n_layers, bool)])
    run = _run_highs(cost, np.concatenate(rows), np.concatenate(cols), np.concatenate(vals),
                     np.concatenate(lower), np.concatenate(upper), col_upper, integer,
                     time_limit=max(time_limit - (time.perf_counter() - started), 0.05), rel_gap=rel_gap)
    if run.infeasible:
        raise BudgetError("no placement of the experts fits the VRAM and RAM budgets with the "
                          "given pins")
    if run.x is not None:
        counts = np.rint(run.x[:nx]).astype(np.int64).reshape(n_groups, n_opts)
        choice = np.zeros((n_layers, n_experts), dtype=np.int64)
        for g, (layer, _, _, members) in enumerate(groups):
            it = iter(members)
            for option in range(n_opts):
                for _ in range(counts[g, option]):
                    choice[layer, next(it)] = option
        method = "milp-highs"
    else:  # out of time before a first solution: start from a greedy one, bound from HiGHS
        greedy = greedy_placement(problem)
        if greedy is None:
            raise BudgetError(f"the placement solver found no solution in {time_limit:.1f} s",
                              hint="raise the solver's time limit (--time-limit)")
        choice = greedy
        method = "greedy+milp-bound"
    choice = polish(problem, choice)
    objective = evaluate(problem, choice).objective
    lower_bound = min(max(run.bound, 0.0) / scale, objective)
    optimal = run.optimal
    return PlacementSolution(choice, objective, lower_bound, optimal,
                             time.perf_counter() - started, method)


def polish(problem: PlacementProblem, choice: np.ndarray) -> np.ndarray:
    """Move single experts to a better option on the same device while that lowers the
    objective and keeps the budgets: the solver stops within ``rel_gap`` of the optimum, which
    can leave the small quality term (the more precise scheme when speed does not care) unused."""
    choice = choice.copy()
    opts = problem.options
    a = _OptionArrays.of(problem)
    seconds, on_gpu, error, vram, ram = a.seconds, a.on_gpu, a.error, a.vram, a.ram
    use = problem.usage
    gpu_time, cpu_time = a.side_times(use, choice)
    vram_left = problem.vram_budget - int(vram[choice].sum())
    ram_left = problem.ram_budget - int(ram[choice].sum())
    qw = problem.quality_weight
    order = np.argsort(-use, axis=None, kind="stable")
    for flat in order.tolist():
        layer, expert = divmod(flat, use.shape[1])
        current = int(choice[layer, expert])
        u = float(use[layer, expert])
        best, best_delta = current, 0.0
        before = max(gpu_time[layer], cpu_time[layer])
        for option in range(len(opts)):
            if option == current or on_gpu[option] != on_gpu[current]:
                continue
            if not problem.allowed[layer, expert, option]:
                continue
            if vram[option] - vram[current] > vram_left or ram[option] - ram[current] > ram_left:
                continue
            shift = u * (seconds[option] - seconds[current])
            g = gpu_time[layer] + (shift if on_gpu[option] else 0.0)
            c = cpu_time[layer] + (0.0 if on_gpu[option] else shift)
            # Lower objective first; at equal objective, the more precise scheme.
            quality = u * (error[layer, option] - error[layer, current])
            delta = max(g, c) - before + qw * quality
            if delta < best_delta - 1e-15 or (abs(delta - best_delta) <= 1e-15 and quality < 0
                                              and error[layer, option] < error[layer, best]):
                best, best_delta = option, delta
        if best != current:
            shift = u * (seconds[best] - seconds[current])
            if on_gpu[best]:
                gpu_time[layer] += shift
            else:
                cpu_time[layer] += shift
            vram_left -= int(vram[best] - vram[current])
            ram_left -= int(ram[best] - ram[current])
            choice[layer, expert] = best
    return choice


def greedy_placement(problem: PlacementProblem) -> np.ndarray | None:
    """A feasible placement without search: the most used experts at their smallest GPU option
    while VRAM lasts, then at their smallest CPU option while RAM lasts, the rest on disk where
    the problem has disk options. None if RAM is short without them."""
    opts = problem.options
    gpu_opts = [i for i, o in enumerate(opts) if o.device == GPU]
    cpu_opts = [i for i, o in enumerate(opts) if o.device == CPU]
    disk_opts = [i for i, o in enumerate(opts) if o.device == DISK]
    n_layers, n_experts = problem.shape
    choice = np.full((n_layers, n_experts), -1, dtype=np.int64)
    vram_left, ram_left = problem.vram_budget, problem.ram_budget
    for flat in np.argsort(-problem.usage, axis=None, kind="stable").tolist():
        layer, expert = divmod(flat, n_experts)
        allowed = problem.allowed[layer, expert]
        gpu = [i for i in gpu_opts if allowed[i] and opts[i].vram_bytes <= vram_left]
        cpu = [i for i in cpu_opts if allowed[i] and opts[i].ram_bytes <= ram_left]
        disk = [i for i in disk_opts if allowed[i]]
        if gpu:
            pick = min(gpu, key=lambda i: opts[i].vram_bytes)
        elif cpu:
            pick = min(cpu, key=lambda i: opts[i].ram_bytes)
        elif disk:
            pick = min(disk, key=lambda i: opts[i].seconds_per_use)
        else:
            return None
        choice[layer, expert] = pick
        vram_left -= opts[pick].vram_bytes
        ram_left -= opts[pick].ram_bytes
    return choice


@dataclass(frozen=True)
class _HighsRun:
    x: np.ndarray | None
    bound: float  # proven lower bound on the objective (scaled units)
    optimal: bool
    infeasible: bool


def _run_highs(cost: np.ndarray, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray,
               row_lower: np.ndarray, row_upper: np.ndarray, col_upper: np.ndarray,
               integer: np.ndarray, *, time_limit: float, rel_gap: float) -> _HighsRun:
    """Minimise ``cost . x`` over ``row_lower <= A x <= row_upper``, ``0 <= x <= col_upper``.

    HiGHS through its own Python API (``highspy``): it imports in a tenth of the time that
    ``scipy.optimize`` takes, which matters for a command that should answer in about a second.
    """
    import highspy

    inf = highspy.kHighsInf
    n_cols, n_rows = len(cost), len(row_lower)
    order = np.lexsort((rows, cols))  # column-major for HiGHS
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = n_rows
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(n_cols)
    lp.col_upper_ = np.where(np.isinf(col_upper), inf, col_upper)
    lp.row_lower_ = np.where(np.isinf(row_lower), -inf, row_lower)
    lp.row_upper_ = np.where(np.isinf(row_upper), inf, row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(cols[order], np.arange(n_cols + 1)).astype(np.int32)
    lp.a_matrix_.index_ = rows[order].astype(np.int32)
    lp.a_matrix_.value_ = vals[order].astype(np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in integer]
    h = _new_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("threads", 1)  # one thread: the same placement on every run and machine
    h.setOptionValue("random_seed", 0)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if status in (highspy.HighsModelStatus.kInfeasible,):
        return _HighsRun(None, 0.0, False, True)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has_solution else None
    optimal = status == highspy.HighsModelStatus.kOptimal
    bound = info.mip_dual_bound
    if not np.isfinite(bound):
        bound = info.objective_function_value if optimal else 0.0
    return _HighsRun(x, float(bound), optimal, False)


def _new_highs(highspy):  # type: ignore[no-untyped-def]
    """A ``Highs`` instance without the banner its C++ constructor writes to standard output
    (once per process), which would corrupt ``--json`` output."""
    import os
    import sys

    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        return highspy.Highs()
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
