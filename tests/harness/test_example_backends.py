"""The example backends (``examples/``) driven directly, without the fuzzer: outputs against
``mla_ref.mla_decode``, persistent-buffer addresses, padding conventions, ``Unsupported`` for
inputs outside (c)'s declaration, and capture/replay (emulated on CPU, CUDA graphs on a GPU)."""
from __future__ import annotations

import pytest
import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch, ModelSpec, Unsupported, capabilities_of
from mla_fuzz.examples.reference_backend import ReferenceBackend
from mla_fuzz.examples.sglang_style import SGLangStyleBackend
from mla_fuzz.harness.mutants.sglang_style import CaptureOwnIndices

SPEC = ModelSpec.tiny(num_heads=4)
NULL = 0
MAX_BATCH, MAX_BLOCKS = 6, 5
# the oracles' tolerances (harness.oracles): out per q dtype, lse fp32 on both sides
OUT_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
LSE_TOL = 1e-4
KV_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Case:
    """A random paged cache plus one decode step on it (host batch + padded q).

    Pages of real rows are distinct and never the null block; every other page (null block
    included) is NaN, and the block-table columns past a row's pages hold garbage, in range
    or not (the contract allows any value there), so a backend reading outside a row's keys
    shows up as NaN or an index error, never as a plausible number."""

    def __init__(self, seq_lens, q_lens, *, page_size, kv_dtype="bf16", next_n=1, pad_to=None, seed=0,
                 q_dtype=None, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        B, mb = len(seq_lens), MAX_BLOCKS
        self.num_blocks = 1 + MAX_BATCH * mb  # one size for every case: a graph's cache is refilled in place
        pages = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        table = torch.randint(-3, self.num_blocks + 5, (B, mb), generator=g, dtype=torch.int32)
        for b, L in enumerate(seq_lens):
            need = -(-L // page_size)
            table[b, :need] = torch.tensor([pages.pop() for _ in range(need)], dtype=torch.int32)
        used = {int(p) for b, L in enumerate(seq_lens) for p in table[b, :-(-L // page_size)]}
        n = self.num_blocks * page_size
        latent = torch.randn(n, SPEC.kv_lora_rank, generator=g)
        rope = torch.randn(n, SPEC.qk_rope_head_dim, generator=g)
        unused = torch.tensor([p not in used for p in range(self.num_blocks)]).repeat_interleave(page_size)
        latent[unused], rope[unused] = float("nan"), float("nan")
        self.kv = mla_ref.make_kv_cache(SPEC, self.num_blocks, page_size, kv_dtype, device=device)
        mla_ref.write_kv_cache(self.kv, latent.to(device), rope.to(device), torch.arange(n, device=device), spec=SPEC)
        self.q_dtype = q_dtype or KV_TORCH.get(kv_dtype, torch.bfloat16)
        self.batch = DecodeBatch(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 q_lens=torch.tensor(q_lens, dtype=torch.int32), block_table=table,
                                 slot_mapping=torch.full((B, next_n), -1, dtype=torch.int64), page_size=page_size,
                                 next_n=next_n, max_decode_len=next_n, pad_to=pad_to, kv_dtype=kv_dtype,
                                 null_block=NULL)
        pad = self.batch.padded_size
        q = torch.randn(pad, next_n, SPEC.num_heads, SPEC.d_qk, generator=g)
        for b in range(pad):  # padded rows and padding tokens are stale pool memory: NaN
            q[b, (q_lens[b] if b < B else 0):] = float("nan")
        self.q = q.to(self.q_dtype).to(device)

    def reference(self):
        B, dev = self.batch.batch_size, self.kv.device
        return mla_ref.mla_decode(self.q[:B], self.kv, self.batch.block_table.to(dev), self.batch.seq_lens.to(dev),
                                  spec=SPEC, q_lens=self.batch.q_lens.to(dev))


def make(cls, page_size, device="cpu", max_batch=MAX_BATCH):
    return cls(SPEC, device=torch.device(device), max_batch=max_batch, capture_sizes=[4, max_batch], graph_safe=True,
               page_size=page_size, max_blocks_per_seq=MAX_BLOCKS, next_n_max=4, num_blocks=64)


def assert_matches_reference(case, out, lse=None):
    """Real rows of ``out`` (and ``lse``) against ``mla_decode``."""
    B = case.batch.batch_size
    ref_out, ref_lse = case.reference()
    assert out.shape[0] == case.batch.padded_size and out.dtype == case.q_dtype
    tol = OUT_TOL[out.dtype]
    torch.testing.assert_close(out[:B].float(), ref_out.float(), atol=tol, rtol=tol, equal_nan=False)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == (case.batch.padded_size, SPEC.num_heads, case.batch.next_n)
        torch.testing.assert_close(lse[:B], ref_lse, atol=LSE_TOL, rtol=LSE_TOL)


def ptrs(md) -> dict:
    return {k: v.data_ptr() for k, v in vars(md).items() if isinstance(v, torch.Tensor)}


# ====================================================================== (a) reference backend

REF_ROWS = [  # (seq_lens, q_lens): ragged MTP, an empty real row, a q_len-0 real row
    ([37, 1, 0, 12], [3, 1, 0, 2]),
    ([5, 64, 3], [1, 3, 0]),
]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_reference_backend_matches_mla_decode(kv_dtype, page_size):
    be = make(ReferenceBackend, page_size)
    for i, (seq, ql) in enumerate(REF_ROWS):
        seq = [min(s, MAX_BLOCKS * page_size) for s in seq]
        for pad_to in (None, MAX_BATCH):
            case = Case(seq, ql, page_size=page_size, kv_dtype=kv_dtype, next_n=3, pad_to=pad_to, seed=10 * i)
            out, lse = be.forward(case.q, case.kv, be.build(case.batch))
            assert_matches_reference(case, out, lse)
            # padding tokens and padded rows: exactly 0 / -inf, whatever q held (NaN here)
            for b in range(case.batch.padded_size):
                real = ql[b] if b < len(ql) else 0
                assert bool((out[b, real:] == 0).all()) and bool((lse[b, :, real:] == float("-inf")).all())


def test_reference_backend_fp16_queries_over_fp8_cache():
    be = make(ReferenceBackend, 16)
    case = Case([40, 7], [2, 1], page_size=16, kv_dtype="fp8", next_n=2, pad_to=4, q_dtype=torch.float16, seed=3)
    out, lse = be.forward(case.q, case.kv, be.build(case.batch))
    assert_matches_reference(case, out, lse)


def test_reference_backend_padding_rows_and_addresses():
    be = make(ReferenceBackend, 16)
    first = None
    for i, (seq, ql, pad_to) in enumerate([([9, 30], [1, 2], 5), ([17], [1], 2), ([3, 1, 50, 2, 8], [1] * 5, None),
                                           ([80, 0, 4], [2, 0, 1], MAX_BATCH)]):
        case = Case(seq, ql, page_size=16, next_n=2, pad_to=pad_to, seed=i)
        md = be.build(case.batch)
        B, pad = case.batch.batch_size, case.batch.padded_size
        if first is None:
            first = ptrs(md)
        assert ptrs(md) == first, "a build moved a buffer the captured graph reads"
        assert all(t.is_contiguous() for t in vars(md).values())
        assert md.seq_lens.tolist() == seq + [0] * (pad - B)
        assert md.q_lens.tolist() == ql + [0] * (pad - B)
        assert bool((md.block_table[B:] == NULL).all())
        # real rows keep their pages; the garbage columns past them are sanitised to the null block
        for b, L in enumerate(seq):
            need = -(-L // 16)
            assert md.block_table[b, :need].tolist() == case.batch.block_table[b, :need].tolist()
            assert bool((md.block_table[b, need:] == NULL).all())


def test_reference_backend_declares_and_refuses_sparse():
    caps = capabilities_of(ReferenceBackend)
    assert caps.kv_dtypes == ("bf16", "fp16", "fp8") and caps.mtp == "ragged" and caps.empty_rows
    assert not caps.sparse and not caps.layer and caps.lse == "natural"
    case = Case([8], [1], page_size=16)
    b = case.batch
    sparse = DecodeBatch(seq_lens=b.seq_lens, q_lens=b.q_lens, block_table=b.block_table, slot_mapping=b.slot_mapping,
                         page_size=16, topk_indices=torch.zeros(1, 1, 4, dtype=torch.int32))
    with pytest.raises(Unsupported, match="sparse"):
        make(ReferenceBackend, 16).build(sparse)


# ====================================================================== (c) SGLang-style backend

SGL_ROWS = [[37, 1, 12], [5, 64, 3, 19, 2]]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_sglang_style_matches_mla_decode_on_every_path(kv_dtype, page_size):
    be = make(SGLangStyleBackend, page_size)
    for i, seq in enumerate(SGL_ROWS):
        seq = [min(s, MAX_BLOCKS * page_size) for s in seq]
        for pad_to in (None, len(seq), MAX_BATCH):
            case = Case(seq, [1] * len(seq), page_size=page_size, kv_dtype=kv_dtype, pad_to=pad_to, seed=i)
            paths = [be.build] + ([be.build_for_capture] if pad_to is not None else [])
            for path in paths:
                out, lse = be.forward(case.q, case.kv, path(case.batch))
                assert lse is None
                assert_matches_reference(case, out)


def test_sglang_style_indices_and_padding_rows():
    be = make(SGLangStyleBackend, 4)
    case = Case([6, 9], [1, 1], page_size=4, pad_to=5, seed=2)
    md = be.build(case.batch)
    B, pad, ps = 2, 5, 4
    indptr = md.kv_indptr.tolist()
    assert len(indptr) == pad + 1 and indptr[0] == 0
    assert [indptr[b + 1] - indptr[b] for b in range(pad)] == [6, 9, 1, 1, 1]  # padded rows: fill value 1
    bt = case.batch.block_table
    for b, L in enumerate([6, 9]):
        want = [int(bt[b, t // ps]) * ps + t % ps for t in range(L)]
        assert md.kv_indices[indptr[b]:indptr[b + 1]].tolist() == want
    assert md.kv_indices[indptr[B]:indptr[pad]].tolist() == [NULL * ps] * (pad - B)  # slot 0 of the null block


def test_sglang_style_graph_paths_share_buffers_and_eager_allocates():
    be = make(SGLangStyleBackend, 16)
    c1 = Case([30, 2], [1, 1], page_size=16, pad_to=4, seed=1)
    c2 = Case([70, 5, 9, 1], [1] * 4, page_size=16, pad_to=4, seed=2)
    cap = ptrs(be.build_for_capture(c1.batch))
    assert ptrs(be.build(c2.batch)) == cap == ptrs(be.build(c1.batch))
    assert cap["kv_indptr"] == be.kv_indptr.data_ptr()
    assert cap["kv_indices"] == be.cuda_graph_kv_indices.data_ptr()
    eager = Case([30, 2], [1, 1], page_size=16, seed=1)
    md = be.build(eager.batch)
    assert md.kv_indptr.data_ptr() != be.kv_indptr.data_ptr()
    assert md.kv_indices.numel() == 32  # exactly the batch's keys


def test_capture_own_indices_mutant_diverges():
    be = make(CaptureOwnIndices, 16)
    c1 = Case([30, 2], [1, 1], page_size=16, pad_to=4, seed=1)
    c2 = Case([70, 5, 9], [1] * 3, page_size=16, pad_to=4, seed=2)
    cap, cap_again = be.build_for_capture(c1.batch), be.build_for_capture(c2.batch)
    replay, replay_again = be.build(c1.batch), be.build(c2.batch)
    assert ptrs(cap) == ptrs(cap_again) and ptrs(replay) == ptrs(replay_again)  # each path stable on its own
    assert not set(ptrs(cap).values()) & set(ptrs(replay).values())            # ... but not the same buffers
    # each path alone is still a correct decode
    for md in (be.build_for_capture(c2.batch), be.build(c2.batch)):
        assert_matches_reference(c2, be.forward(c2.q, c2.kv, md)[0])


def _batch_like(case, **changes):
    b = case.batch
    fields = dict(seq_lens=b.seq_lens, q_lens=b.q_lens, block_table=b.block_table, slot_mapping=b.slot_mapping,
                  page_size=b.page_size, pad_to=4, kv_dtype=b.kv_dtype, null_block=b.null_block)
    fields.update(changes)
    return DecodeBatch(**fields)


def test_sglang_style_raises_unsupported_outside_its_declaration():
    caps = capabilities_of(SGLangStyleBackend)
    assert caps.kv_dtypes == ("bf16", "fp16") and caps.next_n == (1,) and caps.mtp == "none"
    assert caps.lse is None and not caps.empty_rows and not caps.sparse and not caps.layer
    be = make(SGLangStyleBackend, 16)
    case = Case([20, 3], [1, 1], page_size=16, pad_to=4, seed=0)
    two = torch.full((2, 2), -1, dtype=torch.int64)
    bad = {
        "fp8": _batch_like(case, kv_dtype="fp8"),
        "next_n": _batch_like(case, next_n=2, slot_mapping=two, q_lens=torch.tensor([2, 1], dtype=torch.int32)),
        "next_n=2": _batch_like(case, next_n=2, slot_mapping=two),  # uniform one-token rows, still next_n 2
        "seq_len 0": _batch_like(case, seq_lens=torch.tensor([20, 0], dtype=torch.int32),
                                 q_lens=torch.tensor([1, 0], dtype=torch.int32)),
        "q_len 0": _batch_like(case, q_lens=torch.tensor([1, 0], dtype=torch.int32)),
        "sparse": _batch_like(case, topk_indices=torch.zeros(2, 1, 4, dtype=torch.int32)),
        "sparse ragged": _batch_like(case, topk_flat=torch.zeros(3, dtype=torch.int32),
                                     topk_indptr=torch.tensor([0, 2, 3], dtype=torch.int32), topk=2),
        "on-device top-k": _batch_like(case, topk=4),
    }
    for what, batch in bad.items():
        for path in (be.build, be.build_for_capture):
            with pytest.raises(Unsupported):
                path(batch)
    fp8 = Case([20, 3], [1, 1], page_size=16, kv_dtype="fp8", pad_to=4)
    with pytest.raises(Unsupported, match="kv_cache"):  # an FP8 cache reaching forward anyway
        be.forward(fp8.q, fp8.kv, be.build(case.batch))


# ====================================================================== capture and replay

CAPTURE_CASES = [
    pytest.param(ReferenceBackend, dict(kv_dtype="fp8", next_n=3), id="reference-fp8-mtp"),
    pytest.param(ReferenceBackend, dict(kv_dtype="bf16", next_n=1), id="reference-bf16"),
    pytest.param(SGLangStyleBackend, dict(kv_dtype="bf16", next_n=1), id="sglang-style"),
    pytest.param(CaptureOwnIndices, dict(kv_dtype="bf16", next_n=1), id="capture-own-indices"),
]


def _steps(kw):
    """Capture batch, then two different batches replayed at the same padded size 4."""
    if kw["next_n"] > 1:
        return [([12, 40], [3, 2]), ([70, 0, 6, 33], [1, 0, 3, 2]), ([5], [1])]
    return [([12, 40], [1, 1]), ([70, 3, 6, 33], [1] * 4), ([5], [1])]


def _capture_and_replay(cls, kw, runner_mode, device):
    from mla_fuzz.harness.graphs import make_runner

    be = make(cls, 16, device=device)
    steps = _steps(kw)
    seq, ql = steps[0]
    cap = Case(seq, ql, page_size=16, pad_to=4, seed=100, device=device, **kw)
    q, kv = cap.q.clone(), cap.kv  # the graph's inputs: refreshed in place before each replay
    md = getattr(be, "build_for_capture", be.build)(cap.batch)
    be.forward(q, kv, md)  # warmup, as engines do before capturing
    runner = make_runner(runner_mode, device, poison_empty=True)
    graph = runner.capture(lambda: be.forward(q, kv, md)[0])
    results = []
    try:
        for i, (seq, ql) in enumerate(steps[1:]):
            case = Case(seq, ql, page_size=16, pad_to=4, seed=101 + i, device=device, **kw)
            new_md = be.build(case.batch)
            q.copy_(case.q)
            kv.copy_(case.kv)
            replayed = graph.replay().clone()
            eager = be.forward(q, kv, new_md)[0]
            results.append((case, replayed, eager))
    finally:
        graph.close()
    return results


def _check_replays(cls, results):
    for case, replayed, eager in results:
        B = case.batch.batch_size
        if cls is CaptureOwnIndices:
            # the graph still reads the capture batch's indices: replay departs from eager
            assert not torch.equal(replayed[:B], eager[:B])
        else:
            assert torch.equal(replayed[:B], eager[:B]), "replay after a new build != eager forward"
            assert_matches_reference(case, eager)


@pytest.mark.parametrize("cls,kw", CAPTURE_CASES)
def test_emulated_capture_then_replay_new_batch(cls, kw):
    _check_replays(cls, _capture_and_replay(cls, kw, "emulated", "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("cls,kw", CAPTURE_CASES)
def test_cuda_graph_capture_then_replay_new_batch(cls, kw, cuda_device):
    _check_replays(cls, _capture_and_replay(cls, kw, "cuda", cuda_device))
