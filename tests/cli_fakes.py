"""Small decode backends for the CLI tests, loaded by worker processes through
``--backend cli_fakes:Name`` (the tests put this directory on PYTHONPATH).

``RefBackend`` wraps the reference op: exact under ``--graph eager``; under ``emulated`` its
host-side reads (``.tolist()`` while validating) are caught during capture as a
``host-sync`` failure -- a real, fast, deterministic finding. The others misbehave on
purpose, only on some inputs, so the fuzzer has to find them:

- ``AbortBackend``: ``os.abort()`` when a real row has ``seq_len`` 0 (kills the worker);
- ``AbortLongBackend``: ``os.abort()`` when a real row has ``seq_len >= 20`` in a padded
  batch (never in the first steps of the search's first scenario, so the crash comes
  mid-scenario);
- ``HangBackend``: sleeps for an hour on the same inputs (a hang);
- ``SlowBackend``: clean but every forward sleeps, for interrupting a running campaign;
- ``AbortOnceBackend``: as ``AbortBackend``, but only while the file named by
  ``$MLA_FUZZ_TEST_MARKER`` does not exist (it creates it just before aborting): a worker
  death that a later replay does not reproduce, like a neighbour's GPU fault under MPS;
- ``FlakyOnceBackend``: wrong outputs in a few forwards per process (a failure that does not
  reproduce while being shrunk);
- ``DecliningBackend``: clean, but declines (``mla_ref.Unsupported``) every batch of
  16-token pages: a third of the scenarios, which are then not searched examples;
- ``EnvProbeBackend``: clean; appends ``$CUDA_MPS_PIPE_DIRECTORY`` of its process to the
  file named by ``$MLA_FUZZ_TEST_ENVLOG`` (which environment did the worker get?).
"""
from __future__ import annotations

import os
import time

import torch

from mla_fuzz import mla_ref


class RefBackend:
    name = "ref"

    def __init__(self, spec, *, device, max_batch, capture_sizes, graph_safe, **extra):
        self.spec = spec
        self.device = torch.device(device)

    def build(self, batch):
        """Metadata padded to ``batch.padded_size``: padded rows have seq_len 0, q_len 0 and
        point at the null block."""
        B, pad = batch.batch_size, batch.padded_size
        bt = torch.full((pad, batch.block_table.shape[1]), batch.null_block, dtype=torch.int32)
        bt[:B] = batch.block_table
        sl = torch.zeros(pad, dtype=torch.int32)
        sl[:B] = batch.seq_lens
        ql = torch.zeros(pad, dtype=torch.int32)
        ql[:B] = batch.q_lens
        return {"block_table": bt.to(self.device), "seq_lens": sl.to(self.device), "q_lens": ql.to(self.device),
                "real": B}

    def forward(self, q, kv_cache, metadata, out=None):
        """q ``[pad, s_q, h, d_qk]`` -> out ``[pad, s_q, h, rank]`` (q dtype), lse ``[pad, h, s_q]`` fp32."""
        self.check(metadata)
        o, lse = mla_ref.mla_decode(q, kv_cache, metadata["block_table"], metadata["seq_lens"], spec=self.spec,
                                    q_lens=metadata["q_lens"])
        return o.to(q.dtype), lse.float()

    def check(self, metadata) -> None:
        pass

    @staticmethod
    def empty_real_row(metadata) -> bool:
        return 0 in metadata["seq_lens"][: metadata["real"]].tolist()


class DecliningBackend(RefBackend):
    name = "declining"

    def build(self, batch):
        if batch.page_size == 16:
            raise mla_ref.Unsupported("16-token pages")
        return super().build(batch)


class AbortBackend(RefBackend):
    name = "abort"

    def check(self, metadata) -> None:
        if self.empty_real_row(metadata):
            os.abort()


class AbortLongBackend(RefBackend):
    name = "abort-long"

    def check(self, metadata) -> None:
        padded = metadata["real"] < metadata["seq_lens"].shape[0]
        if padded and max(metadata["seq_lens"][: metadata["real"]].tolist(), default=0) >= 20:
            os.abort()


class HangBackend(RefBackend):
    name = "hang"

    def check(self, metadata) -> None:
        if self.empty_real_row(metadata):
            time.sleep(3600)


class SlowBackend(RefBackend):
    name = "slow"

    def check(self, metadata) -> None:
        time.sleep(0.05)


class AbortOnceBackend(RefBackend):
    name = "abort-once"

    def check(self, metadata) -> None:
        marker = os.environ["MLA_FUZZ_TEST_MARKER"]
        if self.empty_real_row(metadata) and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write("aborted once\n")
            os.abort()


class EnvProbeBackend(RefBackend):
    name = "env-probe"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        with open(os.environ["MLA_FUZZ_TEST_ENVLOG"], "a") as fh:
            fh.write(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "<unset>") + "\n")


def _in_capture_step() -> bool:
    import sys
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_step_capture" and f.f_code.co_filename.endswith("executor.py"):
            return True
        f = f.f_back
    return False


class FlakyOnceBackend(RefBackend):
    """Exact, except for a few forwards per process: the first five with two or more real
    rows, one of ``seq_len`` 0, return every output off by one. A failure that shrinking cannot
    reproduce (Hypothesis' Flaky), like a GPU fault that depends on what ran before."""

    name = "flaky-once"
    fired = False
    seen = 0

    def forward(self, q, kv_cache, metadata, out=None):
        o, lse = super().forward(q, kv_cache, metadata, out)
        if (FlakyOnceBackend.seen < 5 and metadata["real"] >= 2 and self.empty_real_row(metadata)
                and not _in_capture_step()):
            # the first five such forwards whose outputs an oracle reads (a capture step's are
            # not: which scenarios come first depends on Hypothesis' version), then never again
            FlakyOnceBackend.seen += 1
            FlakyOnceBackend.fired = True
            o = o + 1.0
        return o, lse
