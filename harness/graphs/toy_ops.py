"""Toy custom ops (namespace ``mla_fuzz_toy``) for the fidelity scenarios.

They mimic the shape of the real decode path in miniature: a planner that writes a plan
buffer from device-side lengths, a decode that reads it, and a lazily planned state object
(FlashMLA's scheduler metadata pattern, the laziness bug class). Pure PyTorch inside, so
they run on any device; registered with ``torch.library.custom_op`` like the Triton kernels,
so dispatch-level tooling sees each as one op.
"""
from __future__ import annotations

from typing import Optional

import torch

NAMESPACE = "mla_fuzz_toy"


@torch.library.custom_op(f"{NAMESPACE}::plan", mutates_args=("plan",))
def toy_plan(lens: torch.Tensor, plan: torch.Tensor) -> None:
    """Planner: ``plan[i] = sum(lens[:i+1])`` (inclusive prefix sum, like an indptr).

    ``lens`` int32 ``[n]``; ``plan`` int32 ``[n]`` (written)."""
    plan.copy_(torch.cumsum(lens, 0, dtype=plan.dtype))


@torch.library.custom_op(f"{NAMESPACE}::decode", mutates_args=())
def toy_decode(x: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """Decode reading a plan: ``x * plan + 1``. ``x`` float ``[n]``, ``plan`` int ``[n]``;
    returns a fresh float ``[n]``."""
    return x * plan.to(x.dtype) + 1


@torch.library.custom_op(f"{NAMESPACE}::decode_out", mutates_args=("out",))
def toy_decode_out(x: torch.Tensor, plan: torch.Tensor, out: torch.Tensor) -> None:
    """``toy_decode`` writing into a persistent ``out`` ``[n]`` (same dtype as ``x``)."""
    out.copy_(x * plan.to(x.dtype) + 1)


@torch.library.custom_op(f"{NAMESPACE}::split_by_host_value", mutates_args=())
def toy_split_by_host_value(x: torch.Tensor) -> torch.Tensor:
    """A kernel wrapper that reads a device value on the host (``.item()``) to choose its
    path: illegal inside a CUDA capture. ``x`` float ``[n]``; returns float ``[n]``."""
    if x.sum().item() > 0:
        return x * 2
    return x.clone()


class LazyPlanState:
    """Scheduler state planned on first use (``plan is None`` until then).

    ``forward(lens, x)`` plans from ``lens`` the first time only, then decodes with the
    plan. Warm it up and then capture, and the capture skips the planner: every replay
    uses the frozen warmup plan (vLLM #42444)."""

    def __init__(self, n: int, device: torch.device):
        self.n = n
        self.device = device
        self.plan: Optional[torch.Tensor] = None

    def forward(self, lens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.plan is None:
            self.plan = torch.empty(self.n, dtype=torch.int32, device=self.device)
            torch.ops.mla_fuzz_toy.plan(lens, self.plan)
        return torch.ops.mla_fuzz_toy.decode(x, self.plan)
