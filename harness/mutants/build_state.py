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
