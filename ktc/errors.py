"""The error types of ktc.

User mistakes (a damaged file, an unsupported model, a budget that cannot be met) are
``KtcError`` subclasses whose message says what, where, expected against found, and a hint;
the command line prints them in a line or two. ``InternalError`` is a bug in ktc and is shown
with its traceback.
"""

from __future__ import annotations


class KtcError(Exception):
    """Root of every error ktc raises on purpose."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None,
                 hint: str | None = None) -> None:
        self.message = message
        self.path = path
        self.tensor = tensor
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path:
            where.append(str(self.path))
        if self.tensor:
            where.append(f"tensor '{self.tensor}'")
        text = f"{': '.join(where)}: {self.message}" if where else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class FormatError(KtcError):
    """A checkpoint or bundle file is damaged, truncated or not what its name says."""


class UnsupportedModelError(KtcError):
    """The checkpoint is readable but its Mixture-of-Experts layout is not one ktc knows."""


class ConfigError(KtcError):
    """A model configuration is missing a field or disagrees with the tensors."""


class BudgetError(KtcError):
    """A memory budget cannot be met."""


class BundleError(KtcError):
    """A .ktb bundle fails validation."""


class PassError(KtcError):
    """A compiler pass failed; the message names the pass."""


class InternalError(Exception):
    """A bug in ktc: an invariant that should always hold did not."""


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM); raised where it was, like ``KeyboardInterrupt``,
    so that what is being written is removed on the way out. Not an ``Exception``: code that
    handles errors must not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by signal {signum}")


# Outputs a command has put in place whole (renamed from their temporary file): a stop that
# arrives after that leaves them, and says so.
_written: list[str] = []


def mark_written(path: str) -> None:
    """``path`` is in place and complete: a SIGTERM from now on does not make it half-written."""
    _written[:] = [*_written[-7:], path]  # a long-lived process compiling many keeps the last few


def written_outputs(*, clear: bool = False) -> list[str]:
    """The outputs ``mark_written`` recorded (and, with ``clear``, none from now on)."""
    got = list(_written)
    if clear:
        _written.clear()
    return got


# A SIGTERM that arrives while the process starts worker processes is held until they have
# started (``signals_held``): a child that is still being spawned when its parent exits reads a
# closed pipe and prints a traceback, and one the parent does not know of yet is not stopped.
_held = 0
_pending: list[int] = []


def hold_signal(signum: int) -> bool:
    """For the SIGTERM handler: True (and the signal kept for later) while signals are held."""
    if _held:
        _pending.append(signum)
        return True
    return False


class signals_held:  # noqa: N801  (a context manager, used as a statement)
    """``with signals_held():`` a SIGTERM handled by ``hold_signal`` takes effect at the end."""

    def __enter__(self) -> None:
        global _held
        _held += 1

    def __exit__(self, *exc: object) -> None:
        global _held
        _held -= 1
        if not _held and _pending:
            signum = _pending.pop()
            _pending.clear()
            raise Terminated(signum)
