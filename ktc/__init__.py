"""ktc: an ahead-of-time weight compiler and planner for Mixture-of-Experts language models.

``import ktc`` stays light (no click, networkx or transformers) so that ``ktc.runtime`` can be
embedded; the entry points below load their modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ktc.api import load_model

__all__ = ["__version__", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from ktc.api import load_model

        return load_model
    raise AttributeError(f"module 'ktc' has no attribute {name!r}")
