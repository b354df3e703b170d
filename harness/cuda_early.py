"""Create a GPU worker's CUDA context on a thread while the worker is still importing.

A worker's first example used to wait for the CUDA context after its imports and its
backend's load: with many workers starting at once under MPS, creating it is the largest
part of a worker's start (docs/cli.md, "Workers and crash isolation"). The driver's primary context
is what the CUDA runtime, and so torch and Triton, use on that device; retaining it early
through the driver API lets the later ``torch.cuda`` initialisation find it made. The calls
go through ``ctypes``, which releases the GIL during a foreign call, so the imports on the
main thread go on meanwhile.

This is a head start only: whatever fails here (no driver, no device, MPS unreachable) is
left for torch to meet and report on the main thread, where the worker reports its errors.
Stdlib only: it runs before the worker imports torch's users.
"""
from __future__ import annotations

import ctypes
import threading
import time

#: what the thread did: ``seconds`` it took, ``error`` (None when the context was made) and
#: ``context`` (the ``CUcontext`` handle as an int, or None)
RESULT: dict = {}


def _open() -> None:
    t0 = time.monotonic()
    error = None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for name, call in (("cuInit", lambda: lib.cuInit(0)),
                           ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), 0)),
                           # kept retained for the process's life: released, the driver would
                           # destroy it again before torch asks for it
                           ("cuDevicePrimaryCtxRetain", lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
            code = call()
            if code != 0:
                error = f"{name} returned CUDA error {code}"
                break
    except (OSError, AttributeError) as exc:  # no driver library, or one without these symbols
        error = f"{type(exc).__name__}: {exc}"
    RESULT.update(seconds=round(time.monotonic() - t0, 3), error=error, context=None if error else ctx.value)


def open_primary_context() -> threading.Thread:
    """Start retaining device 0's primary context (of those ``CUDA_VISIBLE_DEVICES`` shows) on
    a daemon thread; returns the thread. Call before anything in the process touches CUDA
    and only in a process that will use the GPU: the context holds device memory."""
    t = threading.Thread(target=_open, name="mla-fuzz-cuda-context", daemon=True)
    t.start()
    return t
