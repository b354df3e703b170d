"""benchmarks/kernel_bench.py's measured ceilings: the best of several trials, all recorded."""
from __future__ import annotations

import pytest


def test_ceiling_is_best_of_trials_and_every_trial_is_logged(load_benchmark):
    """A ceiling measured low once (clocks not up, a neighbour) would flatter every ratio to
    it: the benchmark keeps the best of its trials, and the json gets all of them."""
    kb = load_benchmark("kernel_bench")
    rates = iter([693.0, 752.0, 748.0])
    assert kb._best_of("matmul_bf16_TFLOPs", lambda: next(rates), 3) == 752.0
    assert kb.RATE_LOG["matmul_bf16_TFLOPs"] == [693.0, 752.0, 748.0]
    calls = []
    assert kb._best_of("copy_TBps", lambda: calls.append(1) or 2.9, 0) == 2.9  # at least one trial
    assert calls == [1] and kb.RATE_LOG["copy_TBps"] == [2.9]
    assert kb.RATE_TRIALS >= 3


@pytest.mark.parametrize("method", ["read_ref_ms", "read_floor_ms"])
def test_read_reference_refuses_more_bytes_than_its_buffer(load_benchmark, method):
    """A read reference longer than its buffer would time a shorter read than the case's:
    it must refuse, not clip -- torch's sum and the Triton read floor (which reads the same
    buffer as 32-bit words) alike."""
    rt = load_benchmark("replay_timing")
    flush = type("F", (), {"clean": lambda self: None})()
    ref = rt.ReadReference(1000, flush, device="cpu")
    with pytest.raises(ValueError, match="exceeds its buffer"):
        getattr(ref, method)(4000)


def test_read_floor_kernel_reads_every_word(load_benchmark):
    """The floor's kernel (interpreted on CPU) folds every word it is given into its programs'
    outputs, and none past ``n_words``: the xor of the outputs is the xor of the words, over
    a length that leaves a ragged last block and programs that stride more than once. Its
    stores (a decode's partials, in ``design_floor``) cover exactly the words asked for."""
    import functools
    import operator

    import torch

    rt = load_benchmark("replay_timing")
    g = torch.Generator().manual_seed(5)
    # compiled where there is a GPU (the suite interprets kernels only without one)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (1000,), generator=g, dtype=torch.int32).to(dev)
    n = 997  # the last 3 words must not be read
    sink = torch.zeros(3, dtype=torch.int32, device=dev)
    y = torch.full((300,), 7, dtype=torch.int32, device=dev)
    z = torch.full((50,), 7, dtype=torch.int32, device=dev)
    rt._read_kernel[(3,)](words, sink, n, y, 0, z, 0, WORDS=64)
    want = functools.reduce(operator.xor, words[:n].tolist())
    assert functools.reduce(operator.xor, sink.tolist()) == want
    assert want != functools.reduce(operator.xor, words.tolist())  # the tail would show
    assert (y == 7).all() and (z == 7).all()  # nothing to store: nothing stored
    # in a decode's place: zeros over y's first 250 words and z's first 41, nothing past them
    rt._read_kernel[(3,)](words, sink, n, y, 250, z, 41, WORDS=64)
    assert functools.reduce(operator.xor, sink.tolist()) == want
    assert (y[:250] == 0).all() and (y[250:] == 7).all()
    assert (z[:41] == 0).all() and (z[41:] == 7).all()


@pytest.mark.gpu
def test_replay_timing_flushes_before_every_timed_run_gpu(load_benchmark):
    """Every timed run (and every warm-up run) follows its own flush, so no run starts with
    the previous one's lines in L2."""
    import torch

    rt = load_benchmark("replay_timing")
    order = []
    x = torch.ones(1 << 20, device="cuda")
    ms = rt.median_replay_ms(lambda: order.append("run") or x.sum(), lambda: order.append("flush"), warmup=3, reps=5)
    assert order == ["flush", "run"] * 8
    assert ms > 0.0
