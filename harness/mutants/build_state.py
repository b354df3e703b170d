"""Mutants whose forward changes its build's metadata in place: right for the first forward
on a build, wrong for every later one on the same build (the next attention layer of an
engine's step, warmups sharing a build, an eager forward after a replay). A replay is right,
since each replay's build starts afresh; the eager forward that checks it, on the same build,
is not.
"""
from __future__ import annotations

import dataclasses

import torch

from mla_fuzz.kernels import TritonMLABackend


class ContextLensInPlace(TritonMLABackend):
    """The forward needs each request's context length (keys before this step's query tokens)
    and derives it from ``seq_lens`` **in place**, in the metadata, instead of in a scratch
    tensor: ``seq_lens -= query tokens`` (counted from the slot mapping on the device), then it
    hands the kernels ``seq_lens + query tokens`` as a temporary. The first forward on a build
    is right and leaves ``seq_lens`` one step short; a second forward on the same build hands
    the kernels lengths short by a step's query tokens, and they miss the newest keys."""

    name = "context-lens-in-place"

    def forward(self, q, kv_cache, metadata, out=None):
        md = metadata
        if not md.sparse:
            tokens = (md.slot_mapping >= 0).sum(1, dtype=torch.int32)
            md.seq_lens.sub_(tokens)  # the context before this step, kept in the metadata
            md = dataclasses.replace(md, seq_lens=md.seq_lens + tokens)
        return super().forward(q, kv_cache, md, out)


class TileCounterPerBuild(TritonMLABackend):
    """A persistent decode kernel takes its work tiles from a device counter in the metadata:
    every tile it finishes bumps the counter, and a tile below the counter counts as done.
    ``build`` zeroes the counter with the rest of the metadata; the forward never does. The
    first forward on a build is right; a second one on the same build (the next attention
    layer of an engine's step, a warmup sharing the capture's build, an eager forward after a
    replay) finds every tile taken and writes nothing for any row: out 0, lse -inf."""

    name = "tile-counter-per-build"

    def build(self, batch):
        md = super().build(batch)
        if not hasattr(self, "_tiles_taken"):  # one persistent buffer: graph-safe
            self._tiles_taken = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._tiles_taken.zero_()
        md.tiles_taken = self._tiles_taken
        return md

    def forward(self, q, kv_cache, metadata, out=None):
        out, lse = super().forward(q, kv_cache, metadata, out)
        taken = getattr(metadata, "tiles_taken", None)
        if taken is not None:
            rows = torch.arange(out.shape[0], device=out.device, dtype=torch.int32)
            done = rows < taken  # tiles an earlier forward on this build already "finished"
            out.masked_fill_(done.view(-1, 1, 1, 1), 0)
            lse.masked_fill_(done.view(-1, 1, 1), float("-inf"))
            taken.add_(out.shape[0])
        return out, lse
