"""Mutants of the SGLang-shaped example backend (``examples.sglang_style``)."""
from __future__ import annotations

import torch

from mla_fuzz.examples.sglang_style import SGLangStyleBackend


class CaptureOwnIndices(SGLangStyleBackend):
    """Capture and replay metadata paths that diverged (SGLang backends, where
    ``init_forward_metadata_capture_cuda_graph`` and ``..._replay_cuda_graph`` are separate
    code): the capture path fills its own persistent ``kv_indptr`` / ``kv_indices`` while the
    replay path refreshes the backend's others. Each path keeps its addresses stable on its
    own, so no single build looks wrong, but the captured graph reads the capture-time
    indices on every replay: later steps attend over the capture batch's keys."""

    name = "example-capture-own-indices"

    def build_for_capture(self, batch):
        self._check(batch)
        if not hasattr(self, "_capture_buffers"):  # allocated once: stable within the capture path
            self._capture_buffers = (torch.zeros_like(self.kv_indptr), torch.zeros_like(self.cuda_graph_kv_indices))
        return self._fill_graph_metadata(batch, *self._capture_buffers)
