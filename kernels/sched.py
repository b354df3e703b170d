"""``SchedState``: the lazily planned split-KV schedule, mirroring FlashMLA's current API.

FlashMLA's ``get_mla_metadata()`` now returns an *empty* scheduler object; the first
``flash_mla_with_kvcache`` call that receives it allocates the plan tensors and launches
the planner, and every later call with the same object reuses that plan. That is cheap
and right in eager mode (one object per step), and exactly the "laziness" bug class under
CUDA graphs when warmup and capture share one object: warmup plans it, the capture sees
"already planned", the planner never enters the graph, and every replay uses the frozen
warmup plan (vLLM #42444).

Two ways to use it safely in a graph-captured engine (``TritonMLABackend`` does both):
bind a fresh state to persistent buffers per build, and force a re-plan on every forward
(``plan(..., force=True)``) so the planner is always part of what gets captured.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .config import DecodeConfig

__all__ = ["SchedState"]


class SchedState:
    """Split-KV plan tensors, ``None`` until the first ``plan`` call allocates them.

    Attributes:
        config: the ``DecodeConfig`` the plan is for (``None`` until first use, when the
            caller's config is adopted).
        part_info: int32 ``[num_parts + 1, 3]``; num_splits, split_offsets: int32 ``[B]``.
        planned: whether the planner has run for this state.
    """

    def __init__(self, config: Optional[DecodeConfig] = None) -> None:
        self.config = config
        self.part_info: Optional[torch.Tensor] = None
        self.num_splits: Optional[torch.Tensor] = None
        self.split_offsets: Optional[torch.Tensor] = None
        self.planned = False

    @classmethod
    def over(cls, config: DecodeConfig, part_info: torch.Tensor, num_splits: torch.Tensor,
             split_offsets: torch.Tensor) -> "SchedState":
        """An unplanned state whose plan tensors are the given (persistent) buffers."""
        state = cls(config)
        state.part_info, state.num_splits, state.split_offsets = part_info, num_splits, split_offsets
        return state

    def _allocate(self, batch: int, device: torch.device) -> None:
        P = self.config.num_parts
        self.part_info = torch.empty(P + 1, 3, dtype=torch.int32, device=device)
        self.num_splits = torch.empty(batch, dtype=torch.int32, device=device)
        self.split_offsets = torch.empty(batch, dtype=torch.int32, device=device)

    def plan(self, cache_seqlens: torch.Tensor, *, config: Optional[DecodeConfig] = None,
             force: bool = False) -> None:
        """Plan for ``cache_seqlens`` (int32 ``[B]``) unless already planned (or ``force``).

        The lazy branch is FlashMLA's contract: a planned state is reused as is, even if
        ``cache_seqlens`` changed since — callers own the state's lifetime.
        """
        if self.planned and not force:
            return
        if self.config is None:
            if config is None:
                raise ValueError("SchedState has no config: pass config= on the first plan call")
            self.config = config
        elif config is not None and config != self.config:
            raise ValueError(f"config {config} differs from the one this SchedState was made for ({self.config})")
        B = cache_seqlens.shape[0]
        if self.part_info is None:
            self._allocate(B, cache_seqlens.device)
        if self.num_splits.shape[0] != B:
            raise ValueError(f"this SchedState holds a plan for batch {self.num_splits.shape[0]}, "
                             f"but cache_seqlens has batch {B}")
        if self.part_info.shape[0] != self.config.num_parts + 1:
            raise ValueError(f"part_info must have num_parts + 1 = {self.config.num_parts + 1} rows, "
                             f"got {tuple(self.part_info.shape)}")
        ops.plan(cache_seqlens, self.part_info, self.num_splits, self.split_offsets,
                 self.config.block_n, self.config.min_tiles_per_part)
        self.planned = True

    def reset(self) -> None:
        """Mark unplanned (keeps the tensors): the next ``plan`` call launches the planner."""
        self.planned = False
