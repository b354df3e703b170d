"""The ``eager`` mode: no graph at all, the baseline the graph modes are compared with."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .base import CapturedGraph, GraphRunner, Outputs, check_outputs


class EagerGraph(CapturedGraph):
    """"Replay" calls ``fn()`` again, so every Python-side effect (lazy planning, fresh
    allocations, rebinding) is re-run; ``outputs`` is rebound to the fresh results."""

    mode = "eager"

    def __init__(self, fn: Callable[[], Outputs], outputs: Outputs):
        super().__init__(outputs, ops=None)
        self._fn = fn

    def _replay(self) -> None:
        self.outputs = check_outputs(self._fn())

    def _release(self) -> None:
        self._fn = None


class EagerRunner(GraphRunner):
    """Runs ``fn`` directly; ``capture`` calls it once. ``graph.ops`` is ``None``."""

    mode = "eager"

    def __init__(self, device: Optional[torch.device] = None):
        super().__init__(device)

    def capture(self, fn: Callable[[], Outputs]) -> EagerGraph:
        """Call ``fn()`` once; its results become ``graph.outputs``. Exceptions propagate
        unchanged: nothing is being captured, so there is no capture failure to report."""
        return EagerGraph(fn, check_outputs(fn()))
