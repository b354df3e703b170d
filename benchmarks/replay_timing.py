"""Timing of CUDA-graph replays from a cold, clean L2 (GPU only), and the plain-read reference.

Why not ``triton.testing.do_bench``'s flush: it clears L2 by *writing* zeros over a 256 MB
buffer, which leaves L2 (50 MB on an H100) full of dirty lines. The timed kernel's first reads
then evict them, and their write-back lands inside the timed region: up to 50 MB of DRAM
writes charged to a kernel that wrote none of them. Measured on one H100 in one process
(``benchmarks/results/h100-2026-11-26-flush-ab.json``, medians of 60): a ``torch.sum`` over
151 MB took 77.2 us after do_bench's flush and 67.9 us after a read-only one; the planner +
decode + combine replay of bf16 h=16, B=8, L=16k (the same 151 MB) 87.4 and 79.5 us; at B=128,
L=16k (2.4 GB) 846.8 and 830.0 us. A flush that zeroes and then reads gave the read-only
flush's times (within 1.3%); no flush at all was slower than either (not investigated).

``L2Flush.clean`` instead *reads* a 256 MB buffer: the lines it leaves in L2 are clean and hold
none of the case's data, so the timed region pays for exactly the traffic the kernels make.
``read_ref_ms`` times the cheapest way torch has to read the same bytes (a sum over a bf16
view, captured in a graph and replayed the same way): a practical ceiling next to the copy
rate, which a 151 MB read reaches only 73% of (same json). ``read_floor_ms`` times a plain
Triton read kernel instead (``_read_kernel``: every SM's eight programs stream 16-byte words,
which is what torch's reduction does not do): the fastest read of those bytes we know how to
write, and so the floor a decode of them can be held to. Tuned over 72 launch shapes on an
H100 (``benchmarks/results/h100-2026-11-26-read-floor.json``): after the same flush it read
151 MB in 53 us (93% of the copy rate; torch's sum 69 us) and 38 MB in 17 us (torch 22).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_fuzz.kernels.hopper.pdl import grid_wait

#: bytes the flush reads: five times an H100's / H200's 50 / 60 MB L2
FLUSH_BYTES = 256 * 1024 * 1024


class L2Flush:
    """A 256 MB int32 buffer read (summed) before each timed replay; see the module doc."""

    def __init__(self, device: str = "cuda"):
        self.buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def clean(self) -> None:
        """Evict L2 by reading: afterwards it holds only clean lines of this buffer."""
        torch.sum(self.buf, dim=0, dtype=torch.int64, out=self.sink)


def median_replay_ms(fn, flush, *, warmup: int = 10, reps: int = 60) -> float:
    """Median wall time (ms, CUDA events) of ``fn()`` over ``reps`` runs, ``flush()`` before
    each (untimed), after ``warmup`` untimed flush + run pairs. ``fn`` is typically a
    ``CUDAGraph.replay``."""
    for _ in range(warmup):
        flush()
        fn()
    times = []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


#: the read floor's launch: warps a program, 32-bit words a program per load, programs an SM.
#: Within 2% of the best of 72 shapes at every size of the tuning run (module doc)
FLOOR_WARPS, FLOOR_WORDS, FLOOR_PROGRAMS_PER_SM = 8, 1024, 8
#: the read on a given number of SMs (``ReadReference.read_launch(programs=)``): one program an
#: SM, its warps and words a load (as many bytes in flight an SM as the floor's eight programs)
SM_WARPS, SM_WORDS = 32, 8192


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_words, y_ptr, n_y, z_ptr, n_z, WORDS: tl.constexpr, WAIT: tl.constexpr = False):
    # A grid-stride read of int32 words (contiguous per program, so 16-byte loads), folded with
    # xor into one word a program so the loads cannot be dropped; eight 8-warp programs an SM
    # keep enough bytes in flight to run at the copy rate. Then zeros over the first n_y words
    # of y and n_z of z (none when 0): in a decode's place, the partials it would store, so
    # that the combine after it finds them in L2 as it would. WAIT: launched with PDL in a
    # decode's place, it first waits for the planner as the decode does (kernels/hopper/pdl.py)
    if WAIT:
        grid_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0) * WORDS
    offs = tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int32)
    for base in range(pid * WORDS, n_words, step):
        o = base + offs
        acc ^= tl.load(x_ptr + o, mask=o < n_words, other=0)
    zero = tl.zeros([WORDS], dtype=tl.int32)
    for base in range(pid * WORDS, n_y, step):
        o = base + offs
        tl.store(y_ptr + o, zero, mask=o < n_y)
    for base in range(pid * WORDS, n_z, step):
        o = base + offs
        tl.store(z_ptr + o, zero, mask=o < n_z)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


class ReadReference:
    """``read_ref_ms(nbytes)``: the replay time of a graph that sums the first ``nbytes`` of one
    preallocated bf16 buffer into fp32 -- the same bytes a case's kernels read, read by torch's
    reduction, timed by ``median_replay_ms`` with the same flush."""

    def __init__(self, max_bytes: int, flush: L2Flush, device: str = "cuda"):
        self.data = torch.ones(max_bytes // 2 + 1, dtype=torch.bfloat16, device=device)
        self.out = torch.empty((), dtype=torch.float32, device=device)
        self.flush = flush

    def read_ref_ms(self, nbytes: int) -> float:
        """Median ms of summing ``nbytes`` (rounded down to whole bf16 values; at most the
        ``max_bytes`` given at construction) in a replayed CUDA graph."""
        n = nbytes // 2
        if n > self.data.numel():
            raise ValueError(f"read reference of {nbytes} bytes exceeds its buffer ({2 * self.data.numel()} bytes)")
        view = self.data[:n]
        torch.sum(view, dim=0, dtype=torch.float32, out=self.out)  # warm the kernel choice outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.sum(view, dim=0, dtype=torch.float32, out=self.out)
        try:
            return median_replay_ms(graph.replay, self.flush.clean)
        finally:
            del graph

    def read_launch(self, nbytes: int, *, after_grid: bool = False, programs: int = None, stores: tuple = ()):
        """A function launching ``_read_kernel`` over the first ``nbytes`` of the buffer (rounded
        down to whole 32-bit words; at most ``max_bytes``): at the floor's shape, or with
        ``programs`` one-SM programs (``SM_WARPS`` / ``SM_WORDS``: the read of that many SMs).
        ``after_grid``: launched with PDL, it waits for the previous grid first, as a decode
        launched in its place waits for the plan (the device must take PDL:
        ``kernels.hopper.pdl.pdl_on``). ``stores``: up to two contiguous tensors it then fills with
        zero bytes (sizes multiples of 4 bytes)."""
        n = nbytes // 4
        if n > self.data.numel() // 2:
            raise ValueError(f"read floor of {nbytes} bytes exceeds its buffer ({2 * self.data.numel()} bytes)")
        if len(stores) > 2:
            raise ValueError("at most two tensors to store")
        words = self.data[:2 * n].view(torch.int32)
        if programs is None:
            grid = FLOOR_PROGRAMS_PER_SM * torch.cuda.get_device_properties(words.device).multi_processor_count
            warps, per_load = FLOOR_WARPS, FLOOR_WORDS
        else:
            grid, warps, per_load = programs, SM_WARPS, SM_WORDS
        sink = torch.empty(grid, dtype=torch.int32, device=words.device)
        targets = [t.view(-1).view(torch.int32) for t in stores] + [sink] * (2 - len(stores))
        counts = [t.numel() for t in targets[:len(stores)]] + [0] * (2 - len(stores))
        opts = {"launch_pdl": True} if after_grid else {}

        def launch():
            _read_kernel[(grid,)](words, sink, n, targets[0], counts[0], targets[1], counts[1], WORDS=per_load,
                                  WAIT=after_grid, num_warps=warps, **opts)

        return launch

    def read_floor_ms(self, nbytes: int) -> float:
        """Median ms of ``_read_kernel`` reading the first ``nbytes`` (rounded down to whole
        32-bit words; at most ``max_bytes``) in a replayed CUDA graph: the module doc's floor."""
        launch = self.read_launch(nbytes)
        launch()  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        try:
            return median_replay_ms(graph.replay, self.flush.clean)
        finally:
            del graph
