"""The ``cuda`` mode: real ``torch.cuda.CUDAGraph`` captures.

Each capture gets its own private memory pool (sharing one pool across graphs hit a
caching-allocator assert on torch 2.11) and runs on ``torch.cuda.graph``'s side stream with
``torch.cuda.set_sync_debug_mode("error")``, so a synchronising op raises at once instead
of invalidating the capture. Any failure is re-raised as ``CaptureError`` with the cause
chained and its message kept.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from .base import CapturedGraph, GraphRunner, Outputs, check_outputs
from .errors import CaptureError, describe_chain
from .oplog import CudaOpLog

# Freed private pools are only returned to the driver by ``empty_cache`` (or an OOM retry);
# a fuzzer captures thousands of graphs, so the runner empties the cache every so often.
_EMPTY_CACHE_EVERY = 32


def cuda_available() -> bool:
    """True when a CUDA device can be used (a CPU build or no driver gives False)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # broken driver installs raise instead of returning False
        return False


class CudaGraph(CapturedGraph):
    """A captured ``torch.cuda.CUDAGraph``; ``replay()`` launches it on the current stream
    (asynchronously: read ``outputs`` with ordinary stream-ordered ops)."""

    mode = "cuda"

    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: Outputs, ops, kept, runner):
        super().__init__(outputs, ops)
        self._graph = graph
        self._kept = kept
        self._runner = runner

    def _replay(self) -> None:
        self._graph.replay()

    def _release(self) -> None:
        # Outputs live in the graph's private pool; drop them before the graph so the
        # pool's blocks are all free when ``reset`` releases it.
        self.outputs = None
        self._kept = None
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.reset()
        runner, self._runner = self._runner, None
        if runner is not None:
            runner._note_closed()


class CudaRunner(GraphRunner):
    """Captures with ``torch.cuda.graph`` on ``device`` (default: the current CUDA device).

    Options:
    - ``record_ops`` (default True): fill ``graph.ops`` from a passive dispatch-mode log and
      keep pre-existing captured tensors alive (see ``oplog``). False gives ``ops = None``.
    - ``poison_empty`` (default False): capture with deterministic algorithms (warn-only)
      and ``torch.utils.deterministic.fill_uninitialized_memory``, so ``empty`` tensors
      allocated in the capture are NaN / integer-max, refilled on every replay. This can
      change which kernel some ops pick (deterministic variants), so bitwise comparisons
      against an eager run without the flag are not meaningful.
    - ``capture_error_mode``: passed to ``torch.cuda.graph`` (default ``"global"``).
    """

    mode = "cuda"

    def __init__(self, device: Optional[torch.device] = None, *, record_ops: bool = True,
                 poison_empty: bool = False, capture_error_mode: str = "global"):
        if not cuda_available():
            raise ValueError("mode 'cuda' needs a CUDA device, but torch.cuda.is_available() is "
                             "False; use mode 'emulated' (or 'auto') on this machine")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise ValueError(f"device: mode 'cuda' needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode: expected 'global', 'thread_local' or 'relaxed', "
                             f"got {capture_error_mode!r}")
        super().__init__(device)
        self.record_ops = record_ops
        self.poison_empty = poison_empty
        self.capture_error_mode = capture_error_mode
        self._closed_since_empty = 0
        self._stream: Optional["torch.cuda.Stream"] = None

    def _capture_stream(self) -> "torch.cuda.Stream":
        """The side stream every capture (and ``warmup``) of this runner uses.

        Made on first use, and cuBLAS/cuBLASLt are initialised on it then: a handle created
        inside a capture fails (CUBLAS_STATUS_NOT_INITIALIZED, pytorch#99397), and the
        per-stream workspace would otherwise be allocated from the first graph's private
        pool and pin it forever. This runs no user code, so it cannot hide a laziness bug."""
        if self._stream is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for dt in (torch.float32, torch.float16, torch.bfloat16):
                    with contextlib.suppress(RuntimeError):  # a dtype this GPU lacks
                        a = torch.ones(8, 8, device=self.device, dtype=dt)
                        torch.mm(a, a)
                        torch.addmm(a, a, a)
                        torch.bmm(a[None], a[None])
            stream.synchronize()
            self._stream = stream
        return self._stream

    def warmup(self, fn: Callable[[], Outputs], n: int = 1) -> Outputs:
        """Call ``fn()`` ``n`` times on the runner's capture stream, as PyTorch recommends
        before capture (lazy library initialisation and Triton compilation must not happen
        inside one)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        out = None
        with torch.cuda.device(self.device):
            side = self._capture_stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(n):
                    out = fn()
            torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn: Callable[[], Outputs]) -> CudaGraph:
        """Capture ``fn()`` into a new CUDA graph with a private pool.

        Kernels are recorded, not run: ``graph.outputs`` hold garbage until the first
        ``replay()``. Raises ``CaptureError`` (cause chained) on any failure, e.g.
        ``.item()`` -> "called a synchronizing CUDA operation", or
        "operation not permitted when stream is capturing"."""
        with torch.cuda.device(self.device):
            return self._capture(fn)

    def _capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        log = CudaOpLog("cuda") if self.record_ops else None
        prev_stream = torch.cuda.current_stream()
        try:
            with self._poison_ctx():
                with torch.cuda.graph(graph, stream=self._capture_stream(),
                                      capture_error_mode=self.capture_error_mode):
                    prev_sync = torch.cuda.get_sync_debug_mode()
                    # Set inside the ``graph`` context: its __enter__ synchronises on purpose.
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        with (log if log is not None else contextlib.nullcontext()):
                            raw = fn()
                    finally:
                        torch.cuda.set_sync_debug_mode(prev_sync)
        except Exception as e:
            # ``torch.cuda.graph.__exit__`` skips restoring the stream when capture_end raises.
            torch.cuda.set_stream(prev_stream)
            with contextlib.suppress(Exception):
                graph.reset()
            raise CaptureError(f"cuda graph capture failed: {describe_chain(e)}") from e
        try:
            out = check_outputs(raw)
        except ValueError:
            graph.reset()
            raise
        return CudaGraph(graph, out, None if log is None else log.names,
                         None if log is None else log.kept, self)

    @contextlib.contextmanager
    def _poison_ctx(self):
        if not self.poison_empty:
            yield
            return
        import torch.utils.deterministic as det

        prev = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                det.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = True
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
            det.fill_uninitialized_memory = prev[2]

    def _note_closed(self) -> None:
        self._closed_since_empty += 1
        if self._closed_since_empty >= _EMPTY_CACHE_EVERY:
            self._closed_since_empty = 0
            torch.cuda.empty_cache()
