"""Mutants of the plug-in example ``examples/triton_decode.py``: the engines' usual graph
bugs, each a one-method subclass of ``TritonDecodeBackend`` (the proof that the harness
catches them in a third-party backend too, not only in ours)."""
from __future__ import annotations

import dataclasses

import torch

from mla_fuzz.examples.triton_decode import TritonDecodeBackend


class ExampleSeqLensFresh(TritonDecodeBackend):
    """vLLM #35175's shape: the builder hands the kernels a freshly allocated ``seq_lens``
    (``host.to(device)``) instead of copying into the persistent buffer; a captured graph
    keeps reading the capture-time tensor, so replays decode with stale lengths."""

    name = "example-seq-lens-fresh"

    def _stage(self, name, host):
        if name == "seq_lens":
            return host.to(self.device)
        return super()._stage(name, host)


class ExampleWorkspaceRealloc(TritonDecodeBackend):
    """The split workspace grown on demand: the builder keeps one buffer sized for the
    largest (rows x splits) seen so far and re-allocates it when a larger batch or a longer
    sequence (more splits) arrives; a graph captured before keeps writing the old buffer,
    which the builder no longer holds (on a GPU: freed memory the allocator may reuse)."""

    name = "example-workspace-realloc"

    def _workspace_for(self, rows, num_kv_splits):
        shape = (rows, self.spec.num_heads, num_kv_splits, self.spec.kv_lora_rank + 1)
        need = shape[0] * shape[1] * shape[2] * shape[3]
        ws = getattr(self, "_grown", None)
        if ws is None or ws.numel() < need:
            ws = self._grown = torch.empty(need, dtype=torch.float32, device=self.device)
        return ws[:need].view(shape)


class ExampleItemInForward(TritonDecodeBackend):
    """The forward re-derives the split count from the longest sequence with ``.item()``
    (to size the split loop) instead of taking the build's host int: a device->host sync,
    which CUDA forbids while a graph is being captured."""

    name = "example-item-in-forward"

    def _splits(self, md):
        return self._num_kv_splits(int(md.seq_lens.max().item()))


class ExamplePaddedPageMinusOne(TritonDecodeBackend):
    """Padded rows as SGLang pads them (seq_len 1, so no row is empty) with their block-table
    rows filled with -1, the "no page" marker slot mappings use: the kernel dereferences page
    -1, one page before the KV cache. On a GPU that reads whatever lies before the cache's
    allocation into rows nobody looks at (or, at a mapping boundary, an illegal memory access);
    on the CPU interpreter, host memory or a segfault."""

    name = "example-padded-page-minus-one"

    def build(self, batch):
        md = super().build(batch)
        B = batch.batch_size
        md.seq_lens[B:].fill_(1)
        md.block_table[B:].fill_(-1)
        return md


class BackendHeldLens(TritonDecodeBackend):
    """Per-step state kept on the backend object instead of the metadata (the shape of a
    decode wrapper whose ``plan()`` keeps the step's tensors on ``self``, FlashInfer-wrapper
    style, or an attention impl reading ``self.`` state its builder set): ``build`` still
    copies into the persistent buffers and returns graph-safe metadata, but it also stores a
    freshly allocated device copy of the padded lengths on the backend
    (``self._seq_lens_now = seq.to(device)``) and ``forward`` hands *that* to the kernels.
    Nothing in the metadata moves, so the metadata looks right; a captured graph keeps
    reading the capture-time ``_seq_lens_now``, so every replay decodes the new batch with
    the capture batch's lengths."""

    name = "example-backend-held-lens"

    def build(self, batch):
        md = super().build(batch)
        seq = torch.zeros(md.padded_size, dtype=torch.int32)
        seq[:batch.batch_size] = batch.seq_lens
        self._seq_lens_now = seq.to(self.device)  # a new tensor every step, held by the backend
        return md

    def forward(self, q, kv_cache, metadata):
        return super().forward(q, kv_cache, dataclasses.replace(metadata, seq_lens=self._seq_lens_now))
