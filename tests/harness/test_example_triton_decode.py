"""Example (b), ``examples/triton_decode.py``, driven directly: its two-stage split-KV Triton
kernel against ``mla_ref.mla_decode`` (every split count, page sizes 4/16/64, MTP 1 and 2,
padded rows), ``Unsupported`` for every input outside its declaration, the lse convention,
persistent-buffer addresses, capture/replay under the emulator, and its three mutants'
mechanics. On CPU the kernels run in Triton's interpreter in fp16 (its bf16 arithmetic is
not faithful); the ``gpu`` cases add bf16 and DeepSeek-V3 dims."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_fuzz import mla_ref
from mla_fuzz.examples.triton_decode import TritonDecodeBackend, TritonDecodeMetadata
from mla_fuzz.harness.mutants import ALL as MUTANTS, EXPECTED
from mla_fuzz.mla_ref import DecodeBatch, ModelSpec, Unsupported, capabilities_of

# the plain tests run on the GPU when there is one (fp16 either way), else in the interpreter
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NULL = 0
# harness.oracles' tolerances: out per q dtype; lse (here in q's dtype) relative, per q dtype
OUT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LSE_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KV = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class Case:
    """A paged cache plus one decode step. Real rows get distinct random pages (never the
    null block); every other slot, including the tail of each row's last page, is NaN, and
    so are q's padded rows: a kernel reading outside a row's keys shows up as NaN."""

    def __init__(self, spec, seq_lens, *, page_size, next_n=1, pad_to=None, dtype=torch.float16, seed=0,
                 device=DEV, max_blocks=None, num_blocks=None):
        g = torch.Generator().manual_seed(seed)
        B = len(seq_lens)
        self.spec, self.dtype, self.device = spec, dtype, device
        self.max_blocks = max_blocks or max(1, max(-(-L // page_size) for L in seq_lens))
        # a fixed num_blocks lets a captured graph's cache be refilled in place by later cases
        self.num_blocks = num_blocks or 1 + B * self.max_blocks
        pages = (torch.randperm(self.num_blocks - 1, generator=g) + 1).to(torch.int32)
        table = torch.randint(-2, self.num_blocks + 3, (B, self.max_blocks), generator=g, dtype=torch.int32)
        valid = torch.zeros(self.num_blocks, page_size, dtype=torch.bool)
        for b, L in enumerate(seq_lens):
            need = -(-L // page_size)
            table[b, :need] = pages[b * self.max_blocks:b * self.max_blocks + need]
            valid[table[b, :need].long()] = (torch.arange(need * page_size) < L).view(need, page_size)
        cache = torch.randn(self.num_blocks, page_size, 1, spec.d_qk, generator=g)
        cache[~valid] = float("nan")
        self.kv = cache.to(dtype).to(device)
        self.batch = DecodeBatch(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 q_lens=torch.full((B,), next_n, dtype=torch.int32), block_table=table,
                                 slot_mapping=torch.full((B, next_n), -1, dtype=torch.int64), page_size=page_size,
                                 next_n=next_n, pad_to=pad_to, kv_dtype=KV[dtype], null_block=NULL)
        q = torch.randn(self.batch.padded_size, next_n, spec.num_heads, spec.d_qk, generator=g)
        q[B:] = float("nan")
        self.q = q.to(dtype).to(device)

    def backend(self, cls=TritonDecodeBackend, max_batch=None, **kw):
        return cls(self.spec, device=self.device, max_batch=max_batch or self.batch.padded_size, capture_sizes=(),
                   graph_safe=True, page_size=self.batch.page_size, max_blocks_per_seq=self.max_blocks,
                   next_n_max=2, **kw)

    def reference(self):
        b = self.batch
        B = b.batch_size
        return mla_ref.mla_decode(self.q[:B], self.kv, b.block_table.to(self.device), b.seq_lens.to(self.device),
                                  spec=self.spec, q_lens=b.q_lens.to(self.device))


def check_against_reference(case, out, lse):
    """Real rows within the oracles' tolerances; padded rows exactly 0 / -inf."""
    spec, b, dt = case.spec, case.batch, case.dtype
    B, pad, n = b.batch_size, b.padded_size, b.next_n
    assert out.shape == (pad, n, spec.num_heads, spec.kv_lora_rank) and out.dtype == dt
    assert lse.shape == (pad, spec.num_heads, n) and lse.dtype == dt
    ref_out, ref_lse = case.reference()
    tol = OUT_TOL[dt]
    torch.testing.assert_close(out[:B].float().cpu(), ref_out.float().cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[:B].float().cpu(), ref_lse.cpu(), atol=LSE_TOL[dt], rtol=LSE_TOL[dt])
    assert bool((out[B:] == 0).all()) and bool((lse[B:] == float("-inf")).all())


def run(case, md=None, be=None):
    be = be or case.backend()
    md = md or be.build(case.batch)
    return be.forward(case.q, case.kv, md)


TINY = ModelSpec.tiny


# heads, page size, next_n, seq_lens, pad_to: together every split count (1, 2, 4, 8), page
# boundaries (L = k * page_size, +-1), a single-key row, non-power-of-two head counts, padding
CASES = [
    (8, 16, 1, [5, 33, 16], None),           # 1 split
    (3, 4, 2, [100, 7, 64], 4),              # 2 splits, page 4, MTP
    (1, 64, 1, [200, 129, 1], 5),            # 4 splits, page 64, a 1-key row
    (16, 16, 2, [512, 2, 257, 80], None),    # 8 splits, 16 heads, MTP
    (5, 16, 2, [65, 63, 17], 4),             # 2 splits at page boundaries
]


@pytest.mark.parametrize("heads,page,next_n,seq_lens,pad_to", CASES)
def test_matches_reference(heads, page, next_n, seq_lens, pad_to):
    case = Case(TINY(num_heads=heads), seq_lens, page_size=page, next_n=next_n, pad_to=pad_to, seed=heads + page)
    out, lse = run(case)
    check_against_reference(case, out, lse)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_batches_match_reference(seed):
    """Random draws of the declared space: B 1-4, lengths 1..512, pages 4/16/64, next_n 1/2."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    next_n, page = pick([1, 2]), pick([4, 16, 64])
    B = int(torch.randint(1, 5, (1,), generator=g))
    seq_lens = [int(v) for v in torch.randint(next_n, 513, (B,), generator=g)]
    case = Case(TINY(num_heads=pick([1, 2, 4])), seq_lens, page_size=page, next_n=next_n,
                pad_to=B + int(torch.randint(0, 2, (1,), generator=g)), seed=seed)
    out, lse = run(case)
    check_against_reference(case, out, lse)


def test_split_count_is_chosen_on_the_host_from_the_longest_sequence():
    be = Case(TINY(2), [1], page_size=16).backend()
    got = {L: be._num_kv_splits(L) for L in (0, 1, 64, 65, 128, 129, 256, 257, 512, 100_000)}
    assert got == {0: 1, 1: 1, 64: 1, 65: 2, 128: 2, 129: 4, 256: 4, 257: 8, 512: 8, 100_000: 8}
    for lens, want in (([5, 64], 1), ([64, 300], 8), ([129], 4)):
        case = Case(TINY(2), lens, page_size=16)
        md = case.backend().build(case.batch)
        assert isinstance(md.num_kv_splits, int) and md.num_kv_splits == want
        assert md.workspace.shape[2] == want


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_any_frozen_split_count_is_correct(splits):
    """A graph replays the capture's split count on later batches: the kernel must be right
    for every count on every batch (here: a 300-key row, a 3-key row, MTP)."""
    case = Case(TINY(4), [300, 3], page_size=16, next_n=2, pad_to=3, seed=splits)
    be = case.backend()
    md = be.build(case.batch)
    md = dataclasses.replace(md, num_kv_splits=splits, workspace=be._workspace_for(3 * 2, splits))
    out, lse = be.forward(case.q, case.kv, md)
    check_against_reference(case, out, lse)


def test_lse_is_natural_log_of_scaled_scores_in_q_dtype():
    spec = TINY(2)
    case = Case(spec, [70], page_size=16, seed=4)
    _, lse = run(case)
    assert lse.dtype == case.q.dtype
    keys = mla_ref.gather_kv(case.kv, case.batch.block_table[0], 70, spec=spec, dtype=torch.float64)
    scores = case.q[0, 0].double() @ keys.T * spec.softmax_scale  # [h, 70]
    want = torch.logsumexp(scores, dim=-1)
    assert spec.softmax_scale == pytest.approx((spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5)
    torch.testing.assert_close(lse[0, :, 0].double(), want, atol=0, rtol=2e-3)
    assert not torch.allclose(lse[0, :, 0].double(), want / math.log(2), rtol=2e-3)  # not log2


def test_persistent_buffers_keep_their_addresses_and_padding():
    spec = TINY(4)
    be = Case(spec, [1], page_size=16, max_blocks=40).backend(max_batch=6)
    ptrs = None
    for lens, n, pad in (([5], 1, None), ([600, 3], 2, 6), ([40, 40, 200], 1, 4), ([2], 2, 1)):
        batch = Case(spec, lens, page_size=16, next_n=n, pad_to=pad, max_blocks=40).batch
        md = be.build(batch)
        assert isinstance(md, TritonDecodeMetadata)
        now = {f: getattr(md, f).data_ptr() for f in ("seq_lens", "block_table", "workspace")}
        assert ptrs is None or now == ptrs
        ptrs = now
        B, P = batch.batch_size, batch.padded_size
        assert md.seq_lens.tolist() == batch.seq_lens.tolist() + [0] * (P - B)
        assert md.block_table.shape == (P, 40) and bool((md.block_table[B:] == NULL).all())
        assert md.workspace.is_contiguous() and md.workspace.shape == (P * n, 4, md.num_kv_splits, 65)
        assert all(getattr(md, f).is_contiguous() for f in ("seq_lens", "block_table"))


def test_outputs_are_fresh_each_call():
    case = Case(TINY(2), [9], page_size=4, pad_to=2)
    be = case.backend()
    md = be.build(case.batch)
    a, b = be.forward(case.q, case.kv, md), be.forward(case.q, case.kv, md)
    assert a[0].data_ptr() != b[0].data_ptr() and a[1].data_ptr() != b[1].data_ptr()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _batch(seq_lens, q_lens, next_n=1, kv_dtype="fp16", **kw):
    B = len(seq_lens)
    return DecodeBatch(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                       q_lens=torch.tensor(q_lens, dtype=torch.int32), block_table=torch.ones(B, 4, dtype=torch.int32), slot_mapping=torch.full((B, next_n), -1),
                       page_size=16, next_n=next_n, kv_dtype=kv_dtype, **kw)


@pytest.mark.parametrize("batch,reason", [
    (lambda: _batch([5], [1], kv_dtype="fp8"), "fp8"),
    (lambda: _batch([5], [1], topk_indices=torch.zeros(1, 1, 4, dtype=torch.int32)), "sparse"),
    (lambda: _batch([5], [1], topk=4), "sparse"),
    (lambda: _batch([5], [3], next_n=3), "next_n=3"),
    (lambda: _batch([5, 6], [2, 1], next_n=2), "ragged"),
    (lambda: _batch([5, 6], [1, 1], next_n=2), "ragged"),
    (lambda: _batch([0, 6], [0, 1]), "seq_len 0"),
])
def test_unsupported_inputs_are_declined_with_a_reason(batch, reason):
    be = TritonDecodeBackend(TINY(2), device=DEV, max_batch=4, capture_sizes=(), graph_safe=True, next_n_max=4)
    with pytest.raises(Unsupported, match=reason):
        be.build(batch())


def test_capabilities_declare_what_build_accepts():
    caps = capabilities_of(TritonDecodeBackend)
    assert caps.kv_dtypes == ("bf16", "fp16") and caps.next_n == (1, 2) and caps.mtp == "uniform"
    assert caps.lse == "natural" and caps.lse_dtype == "q" and caps.schedule_may_differ
    assert not (caps.empty_rows or caps.sparse or caps.layer)
    be = TritonDecodeBackend(TINY(2), device=DEV, max_batch=4, capture_sizes=(), graph_safe=True, next_n_max=2)
    for n in caps.next_n:  # an all-padding step (B = 0) is the engine's, not a request's: accepted
        assert be.build(_batch([], [], next_n=n, pad_to=2)).seq_lens.tolist() == [0, 0]


def test_emulated_capture_replays_new_batches():
    """Capture at one batch (1 split), replay others (longer: the frozen split count covers
    them; shorter): the graph follows the buffers, and stays within the reference."""
    from mla_fuzz.harness.graphs import make_runner

    spec = TINY(4)
    first = Case(spec, [20, 9], page_size=16, next_n=2, pad_to=3, max_blocks=16, num_blocks=49, seed=1)
    be = first.backend(max_batch=3)
    kv, q = first.kv.clone(), first.q.clone()
    md = be.build(first.batch)
    graph = make_runner("emulated", poison_empty=True).capture(lambda: be.forward(q, kv, md))
    assert [op for op in graph.ops if op.startswith("mla_examples")] == [
        "mla_examples::triton_decode_stage1", "mla_examples::triton_decode_stage2"]
    try:
        for lens, seed in (([250, 31], 2), ([4, 2, 7], 3)):
            case = Case(spec, lens, page_size=16, next_n=2, pad_to=3, max_blocks=16, num_blocks=49, seed=seed)
            assert be.build(case.batch).num_kv_splits != md.num_kv_splits or lens[0] < 64
            kv.copy_(case.kv)
            q.copy_(case.q)
            out, lse = graph.replay()
            check_against_reference(case, out, lse)
    finally:
        graph.close()


def test_mutants_are_registered_with_their_diagnoses():
    assert EXPECTED["example-seq-lens-fresh"] == {"stale-address"}
    assert EXPECTED["example-workspace-realloc"] == {"stale-address"}
    assert EXPECTED["example-item-in-forward"] == {"host-sync"}
    for name in ("example-seq-lens-fresh", "example-workspace-realloc", "example-item-in-forward"):
        assert issubclass(MUTANTS[name], TritonDecodeBackend) and MUTANTS[name].name == name


def test_mutant_seq_lens_fresh_moves_the_address():
    spec = TINY(2)
    case = Case(spec, [5, 70], page_size=16, pad_to=3, max_blocks=8)
    be = case.backend(MUTANTS["example-seq-lens-fresh"])
    a, b = be.build(case.batch), be.build(case.batch)
    assert a.seq_lens.data_ptr() != b.seq_lens.data_ptr()
    assert a.block_table.data_ptr() == b.block_table.data_ptr()
    check_against_reference(case, *be.forward(case.q, case.kv, b))  # eager: still right


def test_mutant_workspace_realloc_moves_the_workspace_on_growth():
    spec = TINY(2)
    be = Case(spec, [1], page_size=16, max_blocks=8).backend(MUTANTS["example-workspace-realloc"], max_batch=4)
    small = be.build(Case(spec, [10], page_size=16, max_blocks=8).batch)
    same = be.build(Case(spec, [30, 3], page_size=16, max_blocks=8).batch)
    grown = be.build(Case(spec, [100, 3], page_size=16, max_blocks=8).batch)  # 2 splits: more room
    assert small.workspace.data_ptr() != grown.workspace.data_ptr()
    assert small.workspace.data_ptr() != same.workspace.data_ptr()  # 2 rows > 1 row
    clean = Case(spec, [1], page_size=16, max_blocks=8).backend(max_batch=4)
    assert len({clean.build(Case(spec, lens, page_size=16, max_blocks=8).batch).workspace.data_ptr()
                for lens in ([10], [30, 3], [100, 3])}) == 1


def test_mutant_item_in_forward_fails_capture_only():
    from mla_fuzz.harness.graphs import CaptureError, make_runner

    case = Case(TINY(2), [40, 3], page_size=16, pad_to=2)
    be = case.backend(MUTANTS["example-item-in-forward"])
    md = be.build(case.batch)
    check_against_reference(case, *be.forward(case.q, case.kv, md))  # eager: a sync, but right
    with pytest.raises(CaptureError, match="item|_local_scalar_dense"):
        make_runner("emulated").capture(lambda: be.forward(case.q, case.kv, md))


# ------------------------------------------------------------------ GPU: bf16, DeepSeek-V3 dims

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,page,next_n,seq_lens,pad_to", CASES)
def test_gpu_tiny_matches_reference(cuda_device, dtype, heads, page, next_n, seq_lens, pad_to):
    case = Case(TINY(num_heads=heads), seq_lens, page_size=page, next_n=next_n, pad_to=pad_to, dtype=dtype,
                seed=heads, device=cuda_device)
    check_against_reference(case, *run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("next_n,seq_lens,page", [(1, [1, 64, 513], 64), (2, [2000, 129, 40], 16),
                                                   (1, [4096, 300], 64)])
def test_gpu_deepseek_v3_matches_reference(cuda_device, dtype, next_n, seq_lens, page):
    case = Case(ModelSpec.deepseek_v3(), seq_lens, page_size=page, next_n=next_n, pad_to=len(seq_lens) + 1,
                dtype=dtype, seed=next_n, device=cuda_device)
    check_against_reference(case, *run(case))


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_new_batches(cuda_device):
    spec = ModelSpec.deepseek_v3()
    first = Case(spec, [20, 9], page_size=16, next_n=2, pad_to=3, max_blocks=40, num_blocks=121,
                 dtype=torch.bfloat16, device=cuda_device, seed=1)
    be = first.backend(max_batch=3)
    kv, q = first.kv.clone(), first.q.clone()
    md = be.build(first.batch)
    be.forward(q, kv, md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = be.forward(q, kv, md)
    for lens, seed in (([600, 31], 2), ([4, 2, 7], 3)):
        case = Case(spec, lens, page_size=16, next_n=2, pad_to=3, max_blocks=40, num_blocks=121,
                    dtype=torch.bfloat16, device=cuda_device, seed=seed)
        be.build(case.batch)
        kv.copy_(case.kv)
        q.copy_(case.q)
        graph.replay()
        check_against_reference(case, out, lse)
