"""What every graph runner and captured graph share: the interface, output handling, and
the device argument.

A runner turns a zero-argument callable into a ``CapturedGraph``:

- ``graph.outputs``: the tensors ``fn`` returned at capture (a tensor, or a tuple/list of
  tensors, same structure; ``None`` if ``fn`` returned ``None``). For graph modes these
  are the *static* outputs, overwritten by every ``replay()``.
- ``graph.replay()``: re-executes the graph and returns ``graph.outputs``.
- ``graph.ops``: names of the recorded ops in order (``"aten::mm"``, ``"mla_fuzz::decode"``)
  or ``None`` where the mode records none (eager).
- ``graph.close()`` (alias ``reset()``): releases the graph and everything it keeps alive.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Union

import torch

from .errors import ReplayError

Outputs = Union[None, torch.Tensor, tuple, list]


def check_outputs(out: Any) -> Outputs:
    """Validate what a capture fn returned: ``None``, a tensor, or a tuple/list of tensors.

    Raises ValueError naming what was given otherwise: a graph's outputs must be device
    memory the replay overwrites, so Python numbers (frozen at capture) are refused.
    """
    if out is None or isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return out
    if isinstance(out, (tuple, list)):
        kinds = [type(t).__name__ for t in out]
        raise ValueError(f"capture fn must return a tensor or a tuple/list of tensors; got a "
                         f"{type(out).__name__} of {kinds}")
    raise ValueError(f"capture fn must return a tensor or a tuple/list of tensors; got "
                     f"{type(out).__name__}")


def output_tensors(out: Outputs) -> List[torch.Tensor]:
    """The tensors of an ``Outputs`` value as a flat list (empty for ``None``)."""
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return list(out)


def resolve_device(device: Any) -> Optional[torch.device]:
    """``None`` stays ``None``; a str or ``torch.device`` becomes a ``torch.device``.

    Raises ValueError for anything else (e.g. an int ordinal is ambiguous here)."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device: expected a torch.device or a device string such as "
                             f"'cpu' or 'cuda:0', got {device!r} ({e})") from None
    raise ValueError(f"device: expected None, a torch.device or a str, got "
                     f"{type(device).__name__} {device!r}")


class CapturedGraph:
    """Base class of the three modes' graphs; see the module docstring for the contract."""

    mode: str = "?"

    def __init__(self, outputs: Outputs, ops: Optional[List[str]]):
        self.outputs = outputs
        self.ops = ops
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def replay(self) -> Outputs:
        """Re-execute the graph; return ``self.outputs`` (the same tensor objects each time
        in graph modes)."""
        self._check_open()
        self._replay()
        return self.outputs

    def _replay(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release the graph: its memory pool (cuda) or recorded ops and the tensors they
        keep alive (emulated). Idempotent. ``outputs`` becomes ``None``."""
        if self._closed:
            return
        self._closed = True
        self._release()
        self.outputs = None

    reset = close

    def _release(self) -> None:
        pass

    def _check_open(self) -> None:
        if self._closed:
            raise ReplayError(f"{self.mode} graph was closed; capture a new one")

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        n = "-" if self.ops is None else len(self.ops)
        return f"<{type(self).__name__} mode={self.mode} ops={n}{' closed' if self._closed else ''}>"


class GraphRunner:
    """Base class of the runners. ``mode`` is the resolved mode string."""

    mode: str = "?"

    def __init__(self, device: Optional[torch.device]):
        self.device = device

    def capture(self, fn: Callable[[], Outputs]) -> CapturedGraph:  # pragma: no cover
        """Capture ``fn()`` (zero-argument callable returning ``Outputs``) into a graph."""
        raise NotImplementedError

    def warmup(self, fn: Callable[[], Outputs], n: int = 1) -> Outputs:
        """Call ``fn()`` ``n`` times outside capture (eagerly) and return the last result.

        Warmup runs the user's Python, lazy initialisation included: that is exactly how
        the laziness bug class freezes a plan, so the runner never warms up on its own.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        out = None
        for _ in range(n):
            out = fn()
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} mode={self.mode} device={self.device}>"
