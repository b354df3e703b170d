"""Whose fault is an exception, and what kind: the backend's code, a host read inside a
capture, a kernel the emulator cannot record, or an input the backend does not support.

A capture wraps whatever went wrong inside it (``CaptureError`` from the graph runners,
CUDA's own "capture invalidated" on top of the original error), so the verdict is taken
from the *first* thing that failed: the innermost exception of the cause/context chain.
"""
from __future__ import annotations

import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # harness/
_MUTANTS = _HERE / "mutants"

# The first failure of a capture was a host read or sync: CUDA's sync-debug refusal, a
# capture CUDA invalidated or refused, or the emulator's host-read refusal.
_HOST_SYNC = re.compile(r"operation not permitted when stream is capturing|called a synchronizing CUDA operation|"
                        r"cudaErrorStreamCapture|capture (was )?invalidated|reads a tensor value on the host|"
                        r"operation not permitted when stream is capturing \(emulated\)", re.IGNORECASE)
_RAW_TRITON = "launched during an emulated capture outside any dispatched op"

CUSTOM_OP_DOC = "docs/backends.md#the-custom-op-rule"


class InternalError(RuntimeError):
    """An exception that did not come from the backend's code: a bug of the harness."""


class CudaContextLost(BaseException):
    """A CUDA error that poisons the process's context (illegal memory access, device-side
    assert, launch failure): nothing that runs after it in this process means anything. A
    BaseException, so the search does not try to shrink it in the same process; the worker
    exits on it and the campaign records a crash for the step that was running, replayed and
    reduced in fresh processes, as for a segfault."""

    EXIT_CODE = 70  # crash_repro.CUDA_LOST_EXIT


class DeviceOutOfMemory(BaseException):
    """The GPU ran out of memory in a step. Workers share one GPU, so by itself this says
    nothing about the backend: the worker frees what it holds and reports it, and the parent
    runs the task again with fewer tasks side by side (``harness.throttle``). A task that
    runs alone (``OOM_IS_ENVIRONMENT`` off) reports an out-of-memory error as the backend's
    own. A BaseException, so neither the search nor a diagnosis takes it for a finding."""


#: Whether an out-of-memory error in a step is the environment's (``DeviceOutOfMemory``)
#: rather than the backend's error. Off in a process of its own (``fuzz()`` called in-process,
#: the pytest plugin): the backend's error there. A pool's worker sets it per task: on, but
#: off for a task the parent runs alone, where nothing else holds the GPU's memory.
OOM_IS_ENVIRONMENT = False

# The GPU out of memory, as each layer words it: torch's allocator ("CUDA out of memory"), a
# CUDA runtime or driver call through torch ("CUDA error: out of memory", cudaErrorMemoryAllocation:
# a graph's instantiation, a library's workspace), the driver API (CUDA_ERROR_OUT_OF_MEMORY),
# a Triton launch ("Triton Error [CUDA]: out of memory") and cuBLAS' allocation.
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|"
                  r"CUDA_ERROR_OUT_OF_MEMORY|CUDA (driver )?error: out of memory|\[CUDA\]: out of memory",
                  re.IGNORECASE)


def find_oom(exc: BaseException) -> BaseException | None:
    """The GPU out-of-memory error in ``exc``'s cause/context chain (``torch.OutOfMemoryError``
    or a message saying so, as a capture's wrapper or a Triton launch words it), or None."""
    import torch
    for e in chain(exc):
        if isinstance(e, torch.OutOfMemoryError) or _OOM.search(f"{type(e).__name__}: {e}"):
            return e
    return None


def out_of_memory(exc: BaseException) -> BaseException | None:
    """``find_oom(exc)`` when an out-of-memory error is the environment's doing
    (``OOM_IS_ENVIRONMENT``); None otherwise."""
    return find_oom(exc) if OOM_IS_ENVIRONMENT else None


def is_cuda_error(text: str | None) -> bool:
    """Whether an error message names a CUDA (device) error that poisons the context. Running
    out of memory does not ("CUDA error: out of memory" leaves the context usable): it is
    ``find_oom``'s."""
    from .bisect_step import is_cuda_error as _is
    return _is(text) and not _OOM.search(text)


def call_backend(fn, *args, **kwargs):
    """Every call the harness makes into backend code goes through here, so that an
    exception's traceback says whether it was raised below a backend call (the backend's
    fault, even from compiled code) or in the harness itself."""
    return fn(*args, **kwargs)


def _backend_frames(frames) -> list | None:
    """The frames below the innermost ``call_backend``; None when there is none."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].name == "call_backend" and Path(frames[i].filename).resolve() == Path(__file__).resolve():
            return frames[i + 1:]
    return None


@dataclass
class Verdict:
    """``kind``: "unsupported" | "host-sync" | "custom-op" | "backend-error" | "internal";
    ``origin`` the first exception that failed; ``site`` "file:line" in the backend's own
    code (or a description of where, for compiled code; None for "internal")."""

    kind: str
    origin: BaseException
    site: str | None
    reason: str


def chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first."""
    out, seen, cur = [], set(), exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def backend_roots(backend_cls) -> list[Path]:
    """Folders whose files count as the backend's own: the folder of every class in its MRO
    that is not a builtin (a mutant's folder and our kernels' for a mutant; the user's
    package folder for theirs)."""
    roots = []
    for k in getattr(backend_cls, "__mro__", ()):
        if k is object:
            continue
        try:
            f = inspect.getsourcefile(k) or inspect.getfile(k)
        except (TypeError, OSError):
            continue
        if f:
            d = Path(f).resolve().parent
            if d not in roots:
                roots.append(d)
    return roots


def _is_under(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _library(path: Path) -> bool:
    """Python's own or an installed library's file (torch, triton, hypothesis, ...), or ours
    (the harness outside its mutants)."""
    s = str(path)
    if "site-packages" in s or "dist-packages" in s or s.startswith(sys.prefix) or s.startswith(sys.base_prefix):
        return True
    return _is_under(path, [_HERE]) and not _is_under(path, [_MUTANTS])


def _frames(links) -> list:
    """The stack from the harness down to where the last of ``links`` was raised: each
    exception's traceback runs from where it was caught to where it was raised, so an error
    caught and re-raised inside the backend (Triton's interpreter wraps every kernel error)
    has the harness's frames in the outer link's traceback and the kernel's in the inner's."""
    out = []
    for e in links:
        if e.__traceback__ is not None:
            out.extend(traceback.extract_tb(e.__traceback__))
    return out


def site_of(exc: BaseException, backend_cls, outer: tuple = ()) -> str | None:
    """Where in the backend ``exc`` was raised: ``file:line`` of the innermost frame below the
    harness's call into the backend that is in the backend's own files, failing that one that
    is neither a library's nor the harness's, failing that (compiled code) the backend
    function the harness called. None when ``exc`` was not raised below a backend call.
    ``outer``: the exceptions that wrapped ``exc``, outermost first (``chain``)."""
    frames = _frames([*outer, exc])
    below = _backend_frames(frames)
    if below is None:
        return None
    roots = backend_roots(backend_cls)
    for want in (lambda p: _is_under(p, roots), lambda p: not _library(p)):
        for fr in reversed(below):
            p = Path(fr.filename).resolve()
            if want(p):
                return f"{_short_path(p)}:{fr.lineno}"
    called = frames[len(frames) - len(below) - 1].line or "the backend"
    return f"compiled code called by {called.strip()}"


def defined_at(fn) -> str | None:
    """``file:line`` where a function or method is defined (a path relative to the working
    folder when below it), or None for built-ins and code without source."""
    try:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        return f"{_short_path(Path(inspect.getsourcefile(fn)).resolve())}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError, ValueError):
        return None


def _short_path(p: Path) -> str:
    try:
        rel = os.path.relpath(p)
    except ValueError:
        return str(p)
    return rel if not rel.startswith("..") else str(p)


def judge(exc: BaseException, backend_cls) -> Verdict:
    """The verdict on an exception raised while a step ran (see the module docstring)."""
    from .graphs.errors import CaptureError

    links = chain(exc)
    for i, e in enumerate(links):  # an input the backend declines, wherever it was raised in the backend
        if isinstance(e, NotImplementedError) and site_of(e, backend_cls, tuple(links[:i])) is not None:
            from mla_fuzz.mla_ref import Unsupported
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return Verdict("unsupported", e, site_of(e, backend_cls, tuple(links[:i])),
                           reason if isinstance(e, Unsupported) else f"NotImplementedError: {reason}")
    origin = links[-1]
    text = " | ".join(str(e) for e in links)
    site = site_of(origin, backend_cls, tuple(links[:-1]))
    if site is None:
        return Verdict("internal", origin, None, first_line(origin))
    if _RAW_TRITON in text:
        return Verdict("custom-op", origin, site, first_line(origin))
    if any(isinstance(e, CaptureError) for e in links) and _HOST_SYNC.search(str(origin)):
        return Verdict("host-sync", origin, site, first_line(origin))
    return Verdict("backend-error", origin, site, first_line(origin))
