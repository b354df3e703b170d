"""mla_decode_masked (no host reads, graph-capturable) computes mla_decode's function: same
out and lse on random paged batches (fp32 and fp64 agreement, FP8 caches, MTP, zero-length
rows, NaN past every request's keys), and it runs inside an emulated capture."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import ModelSpec


@st.composite
def cases(draw):
    spec = ModelSpec.tiny(num_heads=draw(st.sampled_from([1, 3, 4])))
    ps = draw(st.sampled_from([1, 4, 16]))
    B = draw(st.integers(1, 4))
    s_q = draw(st.integers(1, 3))
    nb = draw(st.integers(1, 4))
    seq = [draw(st.integers(0, nb * ps)) for _ in range(B)]
    ql = [0 if s == 0 else draw(st.integers(1, min(s, s_q))) for s in seq]
    kv = draw(st.sampled_from(["fp64", "fp8"]))
    return spec, ps, seq, ql, s_q, nb, kv, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(cases())
def test_masked_equals_mla_decode(case):
    spec, ps, seq, ql, s_q, nb, kv, seed = case
    g = torch.Generator().manual_seed(seed)
    B = len(seq)
    blocks = 1 + B * nb
    latent = torch.randn(blocks * ps, spec.kv_lora_rank, generator=g)
    rope = torch.randn(blocks * ps, spec.qk_rope_head_dim, generator=g)
    if kv == "fp8":
        cache = mla_ref.quantize_kv_fp8(latent, rope, spec=spec).reshape(blocks, ps, -1)
        q = torch.randn(B, s_q, spec.num_heads, spec.d_qk, generator=g)
    else:
        cache = torch.cat([latent, rope], -1).double().reshape(blocks, ps, 1, spec.d_qk)
        q = torch.randn(B, s_q, spec.num_heads, spec.d_qk, generator=g).double()
    perm = torch.randperm(blocks - 1, generator=g) + 1
    bt = perm[: B * nb].reshape(B, nb).to(torch.int32)
    # keys past each request's length hold NaN: they must never reach out or lse
    for b in range(B):
        for t in range(seq[b], nb * ps):
            page, off = int(bt[b, t // ps]), t % ps
            cache[page, off].view(torch.uint8).fill_(0xFF)
    sl, qlt = torch.tensor(seq, dtype=torch.int32), torch.tensor(ql, dtype=torch.int32)
    want_o, want_l = mla_ref.mla_decode(q, cache, bt, sl, spec=spec, q_lens=qlt)
    got_o, got_l = mla_ref.mla_decode_masked(q, cache, bt, sl, spec=spec, q_lens=qlt)
    tol = 1e-9 if kv == "fp64" else 1e-5
    torch.testing.assert_close(got_o.double(), want_o.double(), atol=tol, rtol=tol, equal_nan=False)
    # the reference returns lse in fp32 whatever the compute dtype: one fp32 rounding
    torch.testing.assert_close(got_l.double(), want_l.double(), atol=max(tol, 2e-7), rtol=max(tol, 2e-7))


def test_masked_runs_inside_an_emulated_capture():
    """No host read: the emulator (which refuses them as CUDA does) captures and replays it."""
    from mla_fuzz.harness.graphs import make_runner
    spec = ModelSpec.tiny(num_heads=2)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(5, 4, 1, spec.d_qk, generator=g)
    q = torch.randn(2, 1, 2, spec.d_qk, generator=g)
    bt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    sl = torch.tensor([5, 3], dtype=torch.int32)
    graph = make_runner("emulated", "cpu").capture(lambda: mla_ref.mla_decode_masked(q, cache, bt, sl, spec=spec))
    sl.copy_(torch.tensor([8, 1], dtype=torch.int32))  # a new batch in the same buffers
    out, lse = graph.replay()
    want_o, want_l = mla_ref.mla_decode(q, cache, bt, sl, spec=spec)
    torch.testing.assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)
