"""Third-party-style backends for the plug-in contract tests (``--backend contract_fakes:Name``;
the ``fakes`` fixture puts this directory on PYTHONPATH for worker processes).

``OpBackend`` is correct and graph-safe: persistent buffers filled with ``copy_`` in
``build``, the reference decode inside a ``torch.library.custom_op`` (the emulator records
it as one op). Each subclass breaks one rule of the contract, on some inputs only.
"""
from __future__ import annotations

import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import Capabilities, Unsupported

_SPECS: dict = {}


@torch.library.custom_op("contract_fakes::decode", mutates_args=("out", "lse"))
def _decode(q: torch.Tensor, kv: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor, ql: torch.Tensor,
            spec_id: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    o, l_ = mla_ref.mla_decode_masked(q, kv, bt, sl, spec=_SPECS[spec_id], q_lens=ql)
    out.copy_(o.to(out.dtype))
    lse.copy_(l_.to(lse.dtype))


class OpBackend:
    """q ``[pad, s_q, h, d_qk]`` -> out ``[pad, s_q, h, rank]`` (q dtype), lse ``[pad, h, s_q]`` fp32."""

    name = "op"
    capabilities = Capabilities(sparse=False, layer=False)

    def __init__(self, spec, *, device, max_batch, capture_sizes, graph_safe, max_blocks_per_seq=8, **extra):
        self.spec = spec
        _SPECS[id(spec)] = spec
        self.device = torch.device(device)
        self.bt = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self.sl = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self.ql = torch.zeros(max_batch, dtype=torch.int32, device=self.device)

    def build(self, batch):
        B, pad = batch.batch_size, batch.padded_size
        self.check(batch)
        self.bt[:pad].fill_(batch.null_block)
        self.bt[:B, : batch.block_table.shape[1]].copy_(batch.block_table)
        self.sl.zero_()
        self.sl[:B].copy_(batch.seq_lens)
        self.ql.zero_()
        self.ql[:B].copy_(batch.q_lens)
        return {"bt": self.bt[:pad], "sl": self.sl[:pad], "ql": self.ql[:pad]}

    def check(self, batch) -> None:
        pass

    def forward(self, q, kv_cache, md, out=None):
        pad, s_q, h, _ = q.shape
        out = torch.empty(pad, s_q, h, self.spec.kv_lora_rank, dtype=q.dtype, device=q.device)
        lse = torch.empty(pad, h, s_q, dtype=torch.float32, device=q.device)
        _decode(q, kv_cache, md["bt"], md["sl"], md["ql"], id(self.spec), out, lse)
        return out, lse


class FrequentAndRare(OpBackend):
    """Two different errors: a frequent one (any sequence of 3+ tokens) and a rare one (a
    sequence of 13-16 tokens in a batch of 3+ rows: a few in a hundred steps drawn, so the
    frequent one is seen first and a loaded CI core still reaches the rare one well inside its
    half minute; the test is about the known failure being searched past, not about hitting
    one exact length)."""

    name = "frequent-and-rare"

    def check(self, batch):
        lens = batch.seq_lens.tolist()
        if len(lens) >= 3 and any(13 <= n <= 16 for n in lens):
            raise KeyError("rare: a row of 13-16 tokens in a batch of three")
        if max(lens) >= 3:
            raise ValueError("frequent: a row of three or more tokens")


class RaisesInForward(OpBackend):
    """``forward`` raises on batches with a padded row: inside a capture, whose size pads."""

    name = "raises-in-forward"

    def forward(self, q, kv_cache, md, out=None):
        if q.shape[0] >= 2:
            raise ValueError("this forward cannot take two rows")  # RAISE-LINE
        return super().forward(q, kv_cache, md, out)


class DeclinesFP8(OpBackend):
    """Declares nothing, but raises ``Unsupported`` for FP8 caches and a plain
    ``NotImplementedError`` for MTP (what a backend written before capabilities does)."""

    name = "declines-fp8"
    capabilities = None

    def check(self, batch):
        if batch.kv_dtype == "fp8":
            raise Unsupported("fp8 KV caches are not supported")
        if batch.next_n > 1:
            raise NotImplementedError("MTP")
        if batch.is_sparse:
            raise Unsupported("sparse batches are not supported")


class WrongOutDtype(OpBackend):
    """Returns out in fp32 whatever q's dtype."""

    name = "wrong-out-dtype"

    def forward(self, q, kv_cache, md, out=None):
        o, lse = super().forward(q, kv_cache, md, out)
        return o.float(), lse


class NoLse(OpBackend):
    """Returns out alone, declaring no lse (SGLang's Triton decode)."""

    name = "no-lse"
    capabilities = Capabilities(sparse=False, layer=False, lse=None)

    def forward(self, q, kv_cache, md, out=None):
        return super().forward(q, kv_cache, md, out)[0]


class StridedLse(OpBackend):
    """A valid lse seen through a view whose size-1 dim has a non-unit stride (engines
    write [pad, h] and view it as [pad, h, 1]), in q's dtype, base 2."""

    name = "strided-lse"
    capabilities = Capabilities(sparse=False, layer=False, next_n=(1,), mtp="none", lse="base2", lse_dtype="q")

    def forward(self, q, kv_cache, md, out=None):
        o, lse = super().forward(q, kv_cache, md, out)
        pad, h = lse.shape[:2]
        wide = torch.empty(pad, h, 3, dtype=q.dtype, device=q.device)
        wide[:, :, 0].copy_(lse[:, :, 0] / 0.6931471805599453)  # ln -> log2
        return o, wide.as_strided((pad, h, 1), (h * 3, 3, 7))


class BadConstructor(OpBackend):
    """A constructor that does not take the harness's keywords."""

    name = "bad-constructor"

    def __init__(self, spec, device):  # noqa: D107
        super().__init__(spec, device=device, max_batch=8, capture_sizes=[8], graph_safe=True)


class RaisingConstructor(OpBackend):
    """A constructor that takes the right keywords and raises (a buffer it cannot size)."""

    name = "raising-constructor"

    def __init__(self, spec, **kw):  # noqa: D107
        raise ValueError(f"workspace for {spec.num_heads} heads does not fit")  # the constructor's own error


@torch.library.custom_op("contract_fakes::decode_v", mutates_args=("out", "lse"))
def _decode_v(q: torch.Tensor, kv: torch.Tensor, v: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor,
              ql: torch.Tensor, spec_id: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    assert v.data_ptr() == kv.data_ptr()  # V is the cache's first kv_lora_rank dims, read through its strides
    _decode(q, kv, bt, sl, ql, spec_id, out, lse)


class StridedValueView(OpBackend):
    """Hands its kernel V as a strided view of the KV cache (``kv[..., :kv_lora_rank]``), as
    engines' Triton MLA backends do; the kernel reads it through its strides."""

    name = "strided-v"
    capabilities = Capabilities(sparse=False, layer=False, kv_dtypes=("bf16", "fp16"))

    def forward(self, q, kv_cache, md, out=None):
        pad, s_q, h, _ = q.shape
        out = torch.empty(pad, s_q, h, self.spec.kv_lora_rank, dtype=q.dtype, device=q.device)
        lse = torch.empty(pad, h, s_q, dtype=torch.float32, device=q.device)
        _decode_v(q, kv_cache, kv_cache[..., : self.spec.kv_lora_rank], md["bt"], md["sl"], md["ql"], id(self.spec),
                  out, lse)
        return out, lse


@torch.library.custom_op("contract_fakes::oob_write", mutates_args=("x",))
def _oob_write(x: torch.Tensor, on: bool) -> None:
    if on:  # a kernel whose store lands far outside its tensor: an illegal memory access on a GPU
        _oob_kernel[(1,)](x, 1 << 40)


def _make_oob_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, offset):
        tl.store(x_ptr + offset, 1.0)

    return kernel


_oob_kernel = _make_oob_kernel()


class Chaos(OpBackend):
    """Misbehaves by case, each way once per kind of input (``s`` a real row's seq_len):
    ``s % 16 == 15`` in a batch of 3+ rows aborts the process; ``s % 16 == 3`` in a batch of
    2+ rows hangs; ``s % 16 == 9`` raises in build; a capture at size 3 raises in forward;
    ``s % 16 == 5`` returns wrong outputs (eager); ``s % 16 == 1`` (s > 1) on a GPU writes out of
    bounds (an illegal memory access)."""

    name = "chaos"

    def check(self, batch):
        import os
        import time
        lens = batch.seq_lens.tolist()
        B = len(lens)
        if B >= 3 and any(s % 16 == 15 for s in lens):
            os.abort()
        if B >= 2 and any(s % 16 == 3 for s in lens):
            time.sleep(3600)
        if any(s % 16 == 9 for s in lens):
            raise KeyError("chaos: a row of 9 (mod 16) tokens")  # CHAOS-BUILD
        self.garbage = any(s % 16 == 5 for s in lens)
        self.oob = self.device.type == "cuda" and any(s % 16 == 1 and s > 1 for s in lens)

    def forward(self, q, kv_cache, md, out=None):
        if q.shape[0] == 3:
            raise ValueError("chaos: three rows")  # CHAOS-FORWARD
        o, lse = super().forward(q, kv_cache, md, out)
        _oob_write(lse, self.oob)
        return (o + 1 if self.garbage else o), lse


_OOM_SEEN = []


class OomOnce(OpBackend):
    """Runs out of GPU memory once per process (its first build), as a neighbour's
    allocation makes it do on a shared GPU; correct otherwise."""

    name = "oom-once"

    def check(self, batch):
        if not _OOM_SEEN:
            _OOM_SEEN.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB (a test double)")


class OomAlways(OpBackend):
    """Runs out of GPU memory on every build with two or more rows, alone or not: its own
    allocation is too large."""

    name = "oom-always"
    #: what is raised: torch's allocator by default; a test sets other layers' wordings
    error = (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 96.00 GiB (a test double)")

    def check(self, batch):
        if batch.batch_size >= 2:
            raise self.error[0](self.error[1])  # OOM-LINE


_FAILED_ONCE = []


class OomWhileShrinking(OpBackend):
    """A real bug (any batch of three or more rows raises), and, once per process, the GPU
    running out of memory on the second build after that bug was first hit: while the search
    shrinks it."""

    name = "oom-while-shrinking"

    def check(self, batch):
        if _FAILED_ONCE and len(_FAILED_ONCE) < 3:
            _FAILED_ONCE.append(True)
            if len(_FAILED_ONCE) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (a test double)")
        if batch.batch_size >= 3:
            if not _FAILED_ONCE:
                _FAILED_ONCE.append(True)
            raise ValueError("three rows are one too many")
