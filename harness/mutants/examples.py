"""Mutants of the plug-in example ``examples/triton_decode.py``: the engines' usual graph
bugs, each a one-method subclass of ``TritonDecodeBackend`` (the proof that the harness
catches them in a third-party backend too, not only in ours)."""
from __future__ import annotations

import dataclasses

import torch

from mla_fuzz.examples.triton_decode import TritonDecodeBackend, decode_stage1, decode_stage2


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


class ExampleUnguardedStage2(TritonDecodeBackend):
    """The example's two-stage split-KV decode with vLLM's stage-1 guard but not its stage-2 one:
    stage 1 writes nothing for an empty split (``if split_kv_end > split_kv_start`` in vLLM's
    ``_fwd_kernel_stage1``), while stage 2 merges every split of the workspace, relying on an
    lse of -inf that the workspace held only when it was allocated (the constructor fills it).
    Empty splits are common: the split count is the host's, from the longest sequence (and
    frozen at capture), so shorter rows and early MTP tokens get splits with no keys. Once
    earlier steps have written the workspace, those splits merge an earlier step's partial
    output and lse into the row. Needs two or more splits: rows of more than ``min_split_len``
    keys."""

    name = "example-unguarded-stage2"

    def __init__(self, spec, **kw) -> None:
        super().__init__(spec, **kw)
        ws = self._workspace.view(-1, spec.kv_lora_rank + 1)
        ws[:, :-1].zero_()
        ws[:, -1].fill_(float("-inf"))  # "an empty split reads as empty": until the buffer is reused

    def forward(self, q, kv_cache, metadata):
        md, spec = metadata, self.spec
        pad, s_q, h, rank = md.padded_size, md.next_n, spec.num_heads, spec.kv_lora_rank
        if tuple(q.shape) != (pad, s_q, h, spec.d_qk):
            raise ValueError(f"q must be [pad={pad}, next_n={s_q}, h={h}, d_qk={spec.d_qk}], got {tuple(q.shape)}")
        splits = self._splits(md)
        q_rows = q.reshape(pad * s_q, h, spec.d_qk).contiguous()
        out = torch.empty(pad, s_q, h, rank, dtype=q.dtype, device=q.device)
        lse = torch.empty(pad, h, s_q, dtype=q.dtype, device=q.device)
        before = md.workspace.clone()
        decode_stage1(q_rows, kv_cache, kv_cache[..., :rank], md.block_table, md.seq_lens, md.workspace,
                      spec.softmax_scale, s_q, splits)
        # the stage-1 guard: a split with no keys keeps what the workspace held
        tok = torch.arange(s_q, device=q.device)
        visible = (md.seq_lens.to(torch.int64)[:, None] - s_q + tok[None, :] + 1).clamp(min=0)  # [pad, s_q]
        split_len = (visible + splits - 1) // splits
        start = torch.arange(splits, device=q.device)[None, None, :] * split_len[..., None]
        empty = (start >= visible[..., None]).reshape(pad * s_q, 1, splits, 1)
        md.workspace.copy_(torch.where(empty, before, md.workspace))
        decode_stage2(md.workspace, out.view(pad * s_q, h, rank), lse, s_q)
        return out, lse
