"""The pass manager: checks the pass order up front, runs passes, names the one that failed."""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

from ktc.errors import InternalError, KtcError, PassError
from ktc.ir import ModelIR
from ktc.passes.base import Pass, PassContext


class PassManager:
    """Runs an explicit, ordered tuple of passes over the IR."""

    def __init__(self, passes: Iterable[Pass], provided: Iterable[str] = ("checkpoint",)) -> None:
        self.passes = tuple(passes)
        self.provided = frozenset(provided)
        self._check_order()

    def _check_order(self) -> None:
        # A graph of facet -> pass -> facet; every facet a pass requires must be reachable from
        # what is provided through passes earlier in the tuple.
        graph = nx.DiGraph()
        available = set(self.provided)
        for position, p in enumerate(self.passes):
            node = (position, p.name)
            graph.add_node(node)
            missing = p.requires - available
            if missing:
                producers = [q.name for q in self.passes[position + 1:] if q.produces & missing]
                later = f"; produced later by {', '.join(producers)}" if producers else ""
                raise PassError(f"pass '{p.name}' requires {sorted(missing)}, which nothing "
                                f"before it produces{later}")
            for facet in p.requires:
                graph.add_edge(("facet", facet), node)
            for facet in p.produces:
                graph.add_edge(node, ("facet", facet))
            available |= p.produces
        if not nx.is_directed_acyclic_graph(graph):
            raise PassError("the pass graph has a cycle")
        self.graph = graph

    def run(self, ctx: PassContext, ir: ModelIR | None = None, *,
            stop_after: str | None = None) -> ModelIR:
        for p in self.passes:
            try:
                ir = p.run(ir, ctx)
            except KtcError:
                raise
            except Exception as exc:
                raise InternalError(f"pass '{p.name}' failed: {type(exc).__name__}: {exc}") from exc
            if ctx.check:
                p.verify(ir)
            if stop_after == p.name:
                break
        if ir is None:
            raise InternalError("the pipeline produced no IR")
        return ir
