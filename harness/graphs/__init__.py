"""Graph runners: one interface, three modes (docs/design.md, "Graph runners").

``make_runner(mode, device=None, **options)`` with ``mode`` one of:

- ``"eager"``: no graph; ``replay()`` calls ``fn()`` again (the baseline);
- ``"cuda"``: ``torch.cuda.CUDAGraph``, private pool per capture, side stream,
  sync-debug mode "error" while capturing;
- ``"emulated"``: a dispatch-mode emulator giving CUDA-graph semantics on any device;
- ``"auto"``: ``"cuda"`` when CUDA is available, else ``"emulated"``.

Every runner has ``mode`` (resolved), ``capture(fn) -> CapturedGraph`` and
``warmup(fn, n)``; every graph has ``outputs``, ``replay()``, ``ops`` and ``close()``.
Capture failures raise ``CaptureError`` in the graph modes.
"""
from __future__ import annotations

from typing import Any

from .base import CapturedGraph, GraphRunner, resolve_device
from .cuda import CudaGraph, CudaRunner, cuda_available
from .eager import EagerGraph, EagerRunner
from .emulated import EmulatedGraph, EmulatedRunner, RecordedOp
from .errors import CaptureError, ReplayError

MODES = ("eager", "cuda", "emulated", "auto")

__all__ = [
    "MODES", "make_runner", "CaptureError", "ReplayError", "CapturedGraph", "GraphRunner",
    "EagerRunner", "CudaRunner", "EmulatedRunner", "EagerGraph", "CudaGraph", "EmulatedGraph",
    "RecordedOp", "cuda_available", "default_device",
]


def default_device(mode: str) -> str:
    """Where a scenario's tensors live under the resolved graph ``mode``: ``"cuda"`` for real
    graphs, and for ``"eager"`` when CUDA is available (the kernels run on the GPU without
    graphs); else ``"cpu"`` (the emulator on CPU, the Triton interpreter)."""
    return "cuda" if mode == "cuda" or (mode == "eager" and cuda_available()) else "cpu"


def make_runner(mode: str, device: Any = None, **options: Any) -> GraphRunner:
    """Build the runner for ``mode`` (``"eager" | "cuda" | "emulated" | "auto"``).

    ``device``: ``None``, a ``torch.device`` or a string. For ``cuda`` it is the capture
    device (default: current); for ``emulated`` the device whose memory the graph owns
    (default ``None`` = every device; see ``EmulatedRunner``). ``options`` go to the runner
    (``poison_empty`` for cuda/emulated; ``record_ops``, ``capture_error_mode`` for cuda).

    Raises ValueError for an unknown mode (listing the choices), a bad device, an option
    the mode does not take, or ``cuda`` without a CUDA device.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    dev = resolve_device(device)
    accepted = {"eager": set(), "cuda": {"record_ops", "poison_empty", "capture_error_mode"},
                "emulated": {"poison_empty"}}
    if mode == "auto":
        # Options of either graph mode are fine here; the ones the resolved mode lacks drop.
        allowed = accepted["cuda"] | accepted["emulated"]
        mode = "cuda" if cuda_available() and (dev is None or dev.type == "cuda") else "emulated"
        unknown = sorted(set(options) - allowed)
        options = {k: v for k, v in options.items() if k in accepted[mode]}
    else:
        allowed = accepted[mode]
        unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"options: mode {mode!r} accepts {sorted(allowed) or 'no options'}, "
                         f"got {unknown}")
    if mode == "eager":
        return EagerRunner(dev)
    if mode == "cuda":
        return CudaRunner(dev, **options)
    return EmulatedRunner(dev, **options)
