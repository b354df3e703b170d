"""Programmatic dependent launch (PDL) between the forward's kernels (Hopper and later).

A forward is planner -> decode -> combine, three launches in one stream (and in a captured
graph, three nodes). Normally each waits for the previous grid to finish and its memory to
be flushed before any of its blocks is *scheduled*; the gap between two kernels is then the
launch latency plus the new grid's ramp-up. With PDL (``cudaLaunchAttributeProgrammatic
StreamSerialization``; Triton's ``launch_pdl=True`` launch option) the next grid may be
scheduled as soon as every block of the previous one has executed
``griddepcontrol.launch_dependents`` (or exited), and each of its threads then waits in
``griddepcontrol.wait`` until the previous grid has completed and its writes are visible.
Correctness only needs the second half: a kernel launched with PDL executes the wait
before it reads or writes anything a previous kernel touches, so the wait is the first
statement of every such kernel here (and of each worker partition of the warp-specialised
ones). Transitively, the combine's wait covers the planner too: the decode finished only after
its own wait returned. Without the wait the decode reads the previous replay's plan: the
graph-replay test (``test_kernels_backend``) fails on all five Gluon routes with it removed.

Who does what (``PDL`` kernels' constexpr and the launch option, both from ``pdl_on``):

- the planner is launched without PDL (what precedes it -- cache writes, a layer's
  projections -- is not ours to overlap) and releases its dependents first thing, so the
  decode's blocks are resident, waiting, when it ends;
- the decode kernels (Triton split-KV and sparse, the Gluon ones) are launched with PDL and
  wait; they do not release early, so the combine's blocks are scheduled only as decode
  blocks exit (an early release let them in beside running decode blocks: 0.96x at h=16,
  B=8, L=16k);
- the combine is launched with PDL and waits.

The measurements behind these choices are in ``docs/kernel-performance.md``. The CPU interpreter
knows no ``griddepcontrol``: ``pdl_on`` is False there, on CUDA devices before
compute capability 9.0, and with a CUDA runtime before 12.3 (the first whose graphs describe
programmatic dependencies natively; a capture is where these launches run).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..config import interpreting

__all__ = ["pdl_on", "launch_options", "grid_wait", "grid_release", "PDL_MIN_CUDA"]

#: the first CUDA release whose graphs capture programmatic dependent launches as edges
PDL_MIN_CUDA = (12, 3)


def _cuda_version() -> tuple:
    """torch's CUDA runtime version as ``(major, minor)``; ``(0, 0)`` for a build without CUDA."""
    try:
        return tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    except ValueError:  # pragma: no cover - an unparsable version string: take no chances
        return (0, 0)


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _cuda_version() >= PDL_MIN_CUDA


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels launched on ``t``'s device take PDL (module doc): a CUDA tensor (any shape
    / dtype), not the interpreter, compute capability 9.0 or later and a CUDA runtime of at least
    ``PDL_MIN_CUDA`` (earlier ones cannot capture it)."""
    if t.device.type != "cuda" or interpreting():
        return False
    return _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch for ``pdl`` (from ``pdl_on``): the launch option
    where it is on, none otherwise (so the CPU interpreter sees no CUDA-only option)."""
    return {"launch_pdl": True} if pdl else {}


# The Triton kernels' two halves (the Gluon ones have theirs in gluon_parts). Kernels call them
# under ``if PDL:`` so that the interpreter, where PDL is off, never makes the nested call.

@triton.jit
def grid_wait():
    """Wait until the previous grid in the stream has completed and its writes are visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def grid_release():
    """Let the next grid in the stream be scheduled once every block of this one has run this."""
    tl.extra.cuda.gdc_launch_dependents()
