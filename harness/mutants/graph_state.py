"""Mutants whose bug is state the captured graph froze: addresses, plans, host reads."""
from __future__ import annotations

import dataclasses

import torch

from mla_fuzz.kernels import TritonMLABackend, plan_reference
from mla_fuzz.kernels.sched import SchedState


class StaleFP8Metadata(TritonMLABackend):
    """vLLM #35175: the FP8 decode metadata builder returned freshly allocated tensors each
    step instead of copying into the persistent graph buffers; the captured graph kept
    reading the capture-time tensors, so replays decoded with a stale plan/lengths."""

    name = "stale-fp8-metadata"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        if batch.kv_dtype == "fp8":
            md.seq_lens = md.seq_lens.clone()
            md.block_table = md.block_table.clone()
        return md


class StaleKScale(TritonMLABackend):
    """vLLM #35175's shape for the per-tensor FP8 cache: the builder hands the kernels a copy
    of the layer's ``k_scale`` made at every build instead of writing it into the persistent
    buffer, so a captured graph keeps reading the capture-time copy: once the engine changes
    its scale, every replay dequantises the cache with the old one."""

    name = "stale-k-scale"

    def _stage_k_scale(self, batch):
        return batch.k_scale.to(self.device, copy=True)


class SharedLazySched(TritonMLABackend):
    """vLLM #42444: planning is lazy (FlashMLA's "plan on first use" contract) and warmup
    and capture share one build, so warmup plans it with dummy lengths, the capture takes
    the "already planned" branch, the planner never enters the graph and every replay uses
    the frozen warmup plan."""

    name = "shared-lazy-sched"

    def _plan(self, md):
        md.sched.plan(md.seq_lens)


class _HostPlan(SchedState):
    """A plan decided on the host at build time and written with Python scalars."""

    def __init__(self, base: SchedState, info, nsplit, offsets):
        super().__init__(base.config)
        self.part_info, self.num_splits, self.split_offsets = base.part_info, base.num_splits, base.split_offsets
        self.host = (info, nsplit, offsets)

    def plan(self, cache_seqlens, *, config=None, force=False):
        info, nsplit, offsets = self.host
        # Each fill_ carries its value as a constant: captured once, replayed forever.
        for p, row in enumerate(info):
            for j, v in enumerate(row):
                self.part_info[p, j].fill_(int(v))
        for b, (n, o) in enumerate(zip(nsplit, offsets)):
            self.num_splits[b].fill_(int(n))
            self.split_offsets[b].fill_(int(o))
        self.planned = True


class HostSplitDecision(TritonMLABackend):
    """A host-side split decision baked into the graph (the FlashInfer-plan shape of bug):
    the split-KV partition is computed on the host from the build's sequence lengths and
    launched as constants, so a graph captured for one batch replays that batch's split
    for every later batch — rows longer than at capture lose their tail."""

    name = "host-split-decision"

    def _make_sched(self, md):
        base = super()._make_sched(md)
        cfg = md.config
        seq = md.seq_lens.cpu().tolist()  # build time: host reads are allowed here
        info, nsplit, offsets = plan_reference(seq, num_parts=cfg.num_parts, block_n=cfg.block_n,
                                               min_tiles_per_part=cfg.min_tiles_per_part)
        return _HostPlan(base, info, nsplit, offsets)


class ItemInCapture(TritonMLABackend):
    """vLLM #42604's first fix: a ``.item()`` in the forward path (here: skip planning for an
    all-empty batch) — a host sync, illegal while a CUDA graph is being captured."""

    name = "item-in-capture"

    def _plan(self, md):
        if int(md.seq_lens.max().item()) > 0:
            super()._plan(md)


class TorchOpMetadata(TritonMLABackend):
    """A fresh metadata tensor per build hidden behind a torch op in the forward (vLLM
    #35175's fresh-tensor bug in the shape ``cache_seqlens = md.seq_lens.to(torch.int32)``):
    the builder stages ``seq_lens`` as a new int64 device tensor each step (the engine's own
    dtype, ``host.to(device, torch.int64)``) and keeps it in the metadata; the forward casts
    it to the int32 the kernels take. The cast's output, allocated inside the forward, is the
    only tensor the planner and the decode kernel ever see, so no kernel argument is a
    metadata tensor that moved — but a captured graph replays the cast on the capture-time
    int64 tensor, and every replay plans and decodes with the capture batch's lengths."""

    name = "torch-op-metadata"

    def _stage(self, name, host):
        if name == "seq_lens":
            return host.to(self.device, torch.int64)  # fresh each build
        return super()._stage(name, host)

    def forward(self, q, kv_cache, metadata, out=None):
        md = dataclasses.replace(metadata, seq_lens=metadata.seq_lens.to(torch.int32))
        return super().forward(q, kv_cache, md, out)


class LazyPlannerOnBackend(TritonMLABackend):
    """FlashMLA's lazily planned scheduler state (vLLM #42444's contract, "plan on first
    use") kept on the backend: in graph mode the builder holds one ``SchedState`` per padded
    batch size on ``self`` (so the plan tensors a graph reads never move, as engines keep
    per-size persistent buffers) and hands it to every build of that size, and the forward
    calls the lazy ``plan`` (no ``force``). The first forward of a size (a warmup, or an
    earlier eager step) plans it and sets ``planned``; every later forward, the capture's
    included, skips the planner: the captured graph has no planner kernel and every later
    batch of that size (replayed or eager) runs on the first batch's plan — rows longer
    than then lose their tail."""

    name = "lazy-planner-on-backend"

    def _make_sched(self, md):
        if not self.graph_safe:
            return super()._make_sched(md)  # eager engines make a state per step
        scheds = self.__dict__.setdefault("_planned_scheds", {})
        state = scheds.get(md.padded_size)
        if state is None or state.config != md.config:
            state = scheds[md.padded_size] = super()._make_sched(md)
        return state

    def _plan(self, md):
        md.sched.plan(md.seq_lens)  # lazy: a no-op once the state is planned
