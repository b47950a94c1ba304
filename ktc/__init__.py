"""ktc: an ahead-of-time weight compiler and planner for Mixture-of-Experts language models.

``import ktc`` stays light (no click, networkx or transformers) so that ``ktc.runtime`` can be
embedded; the entry points below load their modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ktc.api import generate_gpu_experts_masks, load_model, plan

__all__ = ["__version__", "generate_gpu_experts_masks", "load_model", "plan"]


def __getattr__(name: str) -> Any:
    if name in ("load_model", "plan", "generate_gpu_experts_masks"):
        from ktc import api

        return getattr(api, name)
    raise AttributeError(f"module 'ktc' has no attribute {name!r}")
