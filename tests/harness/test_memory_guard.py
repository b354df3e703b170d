"""The interpreter's bounds check (``harness.memory_guard``): an interpreted kernel that
reads or writes outside the tensors of its launch raises at its own ``tl.load``/``tl.store``
line instead of reading host memory or killing the process; in-bounds and masked-off
accesses pass; the fuzzer turns the error into a ``bounds`` finding named at the kernel's
line, and its diagnosis names padded rows as the cause when they are."""
import inspect
import os

import pytest
import torch
import triton
import triton.language as tl

from mla_fuzz.harness import memory_guard
from mla_fuzz.harness.fuzz import fuzz

pytestmark = pytest.mark.skipif(not memory_guard.interpreting(), reason="the check guards Triton's CPU interpreter")


@triton.jit
def _copy(src, dst, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + offs + shift, mask=offs < n, other=0.0)  # the guarded load
    tl.store(dst + offs, x, mask=offs < n)


def _load_line() -> int:
    src, start = inspect.getsourcelines(_copy.fn)
    return start + next(i for i, line in enumerate(src) if "the guarded load" in line)


@pytest.fixture(autouse=True)
def _guard():
    memory_guard.install_for_interpreter()
    assert memory_guard.installed()


def test_in_bounds_and_masked_off_lanes_pass():
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    _copy[(1,)](src, dst, 10, 6, BLOCK=16)  # lanes 10.. would reach past src, but are masked off
    torch.testing.assert_close(dst[:10], src[6:16])
    assert (dst[10:] == 0).all()


def test_a_read_past_the_end_raises_at_the_kernels_line():
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    before = dst.clone()
    with pytest.raises(Exception) as info:
        _copy[(1,)](src, dst, 12, 6, BLOCK=16)  # lanes 10, 11 read src[16], src[17]
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    oob = next(x for x in chain if isinstance(x, memory_guard.OutOfBounds))
    assert "out-of-bounds load" in str(oob) and "past the end of 'src'" in str(oob)
    import traceback
    frames = traceback.extract_tb(oob.__traceback__)
    assert any(f.filename == __file__ and f.lineno == _load_line() for f in frames)
    assert torch.equal(dst, before)  # nothing was stored: the kernel stopped at the load


def test_a_store_before_the_start_raises():
    @triton.jit
    def poke(dst, where):
        tl.store(dst + where, 1.0)

    dst = torch.zeros(8)
    with pytest.raises(Exception, match="out-of-bounds store"):
        poke[(1,)](dst, -4)
    poke[(1,)](dst, 7)  # the last element is fine
    assert dst[7] == 1.0


@pytest.mark.skipif(os.environ.get("MLA_FUZZ_PLAIN_INTERPRETER") not in (None, "", "0"),
                    reason="timed for the patched interpreter")
def test_search_finds_a_padded_row_that_reads_before_the_cache():
    """The fresh mutant ``example-padded-page-minus-one`` (padded rows: seq_len 1, page -1):
    found by the search, as ``bounds`` at the example kernel's K load, named out-of-bounds
    because of the padded rows; the clean example passes the same scenario."""
    from mla_fuzz.harness.repro import replay_repro

    report = fuzz("mutant:example-padded-page-minus-one", spec="tiny", graph_mode="emulated", examples=200, seed=3,
                  shrink_seconds=20)
    assert report.failed
    f = report.repro["failure"]
    assert f["oracle"] == "bounds", f
    assert "examples/triton_decode.py:" in f["message"] and "out-of-bounds load" in f["message"]
    assert report.repro["diagnosis"]["cls"] == "out-of-bounds"
    assert not replay_repro(report.repro, backend="mla_fuzz.examples.triton_decode:TritonDecodeBackend",
                            diagnose_failure=False).failed
