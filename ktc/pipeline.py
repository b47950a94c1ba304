"""The pass manager: checks the pass order up front, runs passes, names the one that failed."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import networkx as nx

from ktc.errors import ConfigError, InternalError, KtcError, PassError
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def run(self, ctx: PassContext, ir: ModelIR | None = None, *, stop_after: str | None = None,
            dump_after: str | None = None, dump: Callable[[str], None] | None = None) -> ModelIR:
        """Run the passes in order; ``verify`` each under ``ctx.check``; stop after the pass
        named ``stop_after``; after ``dump_after`` give ``dump`` a JSON description of the IR."""
        for flag, name in (("--stop-after", stop_after), ("--dump-after", dump_after)):
            if name is not None and name not in self.names:
                raise ConfigError(f"{flag}: no pass named {name!r}; passes: {', '.join(self.names)}")
        for p in self.passes:
            try:
                ir = p.run(ir, ctx)
                if ctx.check and ir is not None:
                    p.verify(ir)
            except KtcError:
                raise
            except Exception as exc:
                raise InternalError(f"pass '{p.name}' failed: {type(exc).__name__}: {exc}") from exc
            if dump_after == p.name and ir is not None:
                (dump or (lambda text: print(text, file=sys.stderr)))(
                    json.dumps({"after": p.name, **describe_ir(ir)}, indent=1))
            if stop_after == p.name:
                break
        if ir is None:
            raise InternalError("the pipeline produced no IR")
        return ir


def describe_ir(ir: ModelIR) -> dict[str, Any]:
    """What the IR holds so far, for ``--dump-after``: the model, then each pass result."""
    out: dict[str, Any] = {
        "family": ir.family, "architecture": ir.config.architecture,
        "moe_layers": len(ir.moe_layers), "experts": sum(len(layer.experts) for layer in ir.moe_layers),
        "dense_tensors": len(ir.dense),
    }
    if ir.placement is not None:
        per_layer = ir.placement.gpu_experts_per_layer()
        out["placement"] = {"gpu_experts": sum(per_layer), "cpu_experts": out["experts"] - sum(per_layer),
                            "gpu_experts_per_layer": dict(zip(map(str, ir.placement.layers), per_layer))}
    if ir.quant is not None:
        out["quant"] = {"expert_schemes": Counter(s for row in ir.quant.experts for s in row),
                        "non_expert_schemes": Counter(s for _, s in ir.quant.tensors),
                        "dense_scheme": ir.quant.dense_scheme}
    if ir.layout is not None:
        blocks = getattr(ir.layout, "blocks", ())
        segments: Counter[str] = Counter()
        for block in blocks:
            segments[block.segment] += block.length
        out["layout"] = {
            "blocks": len(blocks), "segment_bytes": segments,
            "first_blocks": [{"name": b.name, "segment": b.segment, "length": b.length,
                              "tensors": [{"name": t.name, "scheme": t.scheme, "shape": list(t.shape),
                                           "offset_in_block": t.offset, "nbytes": t.nbytes}
                                          for t in b.tensors]}
                             for b in blocks[:3]],
        }
    return out
