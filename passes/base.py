"""What a compiler pass is, and the context every pass receives."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

from ktc.ir import ModelIR


@dataclass
class PassContext:
    """Per-run state shared by passes: logging, options, a scratch folder."""

    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("ktc"))
    check: bool = False  # run each pass's verify() after it
    temp_dir: str | None = None


class Pass:
    """A step of the pipeline: ``run`` returns a new IR; ``verify`` checks its postconditions.

    ``requires`` and ``produces`` name IR facets ("config", "tensors", "experts", "placement",
    ...); the pass manager checks the order up front.
    """

    name: ClassVar[str] = "pass"
    requires: ClassVar[frozenset[str]] = frozenset()
    produces: ClassVar[frozenset[str]] = frozenset()

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        raise NotImplementedError

    def verify(self, ir: ModelIR) -> None:
        """Raise ``InternalError`` when a postcondition does not hold."""
