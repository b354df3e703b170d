"""Refuse Triton launches the emulator cannot replay.

The emulator replays what the dispatcher showed it. A Triton kernel launched straight from
Python (not wrapped in a ``torch.library.custom_op``) never reaches the dispatcher, so it
would run at capture and silently never again: a CUDA capture, by contrast, records it.
While an emulated capture is active on this thread, launches outside a dispatched op raise
``CaptureError`` instead. Launches inside an op (a custom op's implementation) are fine:
the op is recorded and replayed as one unit.

Triton is patched only for the duration of a capture (reference-counted across threads);
``JITFunction.run`` (compiled) and ``InterpretedFunction.run`` (``TRITON_INTERPRET=1``) both
receive every ``kernel[grid](...)`` launch in triton 3.x.
"""
from __future__ import annotations

import contextlib
import threading

from .errors import CaptureError

_state = threading.local()
_lock = threading.Lock()
_patch_count = 0
_originals: list = []


def _capturing_outside_op() -> bool:
    return getattr(_state, "capture_depth", 0) > 0 and getattr(_state, "op_depth", 0) == 0


def _kernel_name(fn_obj) -> str:
    inner = getattr(fn_obj, "fn", None)
    return getattr(inner, "__name__", None) or getattr(fn_obj, "__name__", type(fn_obj).__name__)


def _wrap(orig):
    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False) and _capturing_outside_op():
            raise CaptureError(
                f"Triton kernel '{_kernel_name(self)}' launched during an emulated capture outside "
                "any dispatched op: the emulator would not replay it. Register the launcher with "
                "torch.library.custom_op (declaring mutates_args) so it is recorded as one op.")
        return orig(self, *args, **kwargs)

    run.__wrapped__ = orig
    return run


def _targets():
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # triton absent or broken: nothing to guard
        return []
    found = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        found.append(InterpretedFunction)
    except Exception:
        pass
    return [cls for cls in found if "run" in cls.__dict__]


def _patch() -> None:
    global _patch_count
    with _lock:
        if _patch_count == 0:
            for cls in _targets():
                orig = cls.__dict__["run"]
                _originals.append((cls, orig))
                cls.run = _wrap(orig)
        _patch_count += 1


def _unpatch() -> None:
    global _patch_count
    with _lock:
        _patch_count -= 1
        if _patch_count == 0:
            while _originals:
                cls, orig = _originals.pop()
                cls.run = orig


@contextlib.contextmanager
def capture_scope():
    """Active while an emulated capture runs ``fn`` on this thread."""
    _patch()
    _state.capture_depth = getattr(_state, "capture_depth", 0) + 1
    try:
        yield
    finally:
        _state.capture_depth -= 1
        _unpatch()


@contextlib.contextmanager
def inside_op():
    """Active while a dispatched op executes: launches here belong to a recorded op."""
    _state.op_depth = getattr(_state, "op_depth", 0) + 1
    try:
        yield
    finally:
        _state.op_depth -= 1


def in_capture() -> bool:
    """True while an emulated capture is active on this thread."""
    return getattr(_state, "capture_depth", 0) > 0
