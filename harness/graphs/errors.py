"""Exceptions raised by the graph runners.

Both derive from ``RuntimeError`` so code that already catches PyTorch's own capture errors
keeps working, but the runners never let a bare ``RuntimeError`` escape a capture: callers
(the fuzzer's "no host sync during capture" oracle) test for ``CaptureError`` by type.
"""
from __future__ import annotations


class CaptureError(RuntimeError):
    """Graph capture failed (CUDA refused an operation, or the emulator found one that a
    CUDA capture would refuse, such as a host read). The original exception, when there is
    one, is chained as ``__cause__`` and its message is kept in ``str(err)``."""


class ReplayError(RuntimeError):
    """A captured graph could not be replayed (closed graph, or a recorded op failed)."""


def describe_chain(exc: BaseException) -> str:
    """One line per exception in ``exc``'s cause/context chain, outermost first.

    CUDA reports a failed capture twice: the op that broke it, then ``capture_end``
    complaining about the invalidated capture. The first is the useful one, so the whole
    chain goes into the ``CaptureError`` message rather than only the last exception.
    """
    lines = []
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        lines.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return "\n  caused by ".join(lines)
