"""In-kernel timelines of Gluon decode kernels (GPU only to run; CPU to build).

Where does a small launch's time go inside the decode kernel? CUPTI gives a kernel's start
and end; this gives the moments between. ``instrument(name)`` builds a copy of one shipping
kernel module (``kernels/hopper/decode_wgmma_pp.py`` or ``decode_wgmma_ws64.py``, the 64-row
kernels; ``decode_wgmma_rs.py``, FP8 in 16- or 32-row blocks; ``decode_wgmma_kt.py``,
16-bit in 16- or 32-row blocks) with one
extra pointer argument and a ``%globaltimer`` read stored at each of a few points (``EVENTS``:
the plan's arrival, q and the first tiles landing, the loop's end, the result stored, and from
slot 16 on when each of a request's first ``CADENCE`` tiles reaches its QK),
by rewriting the module's source at anchors that must each occur as often as expected: the shipping
kernels stay untouched (no argument, no instruction of this tool in them), and a kernel edit
that moves an anchor makes ``instrument`` fail loudly rather than time the wrong point.

``install(ts)`` routes the launches of those kernels (``kernels.routes.LAUNCHERS``) to the copies,
which store into ``ts`` (int64 ``[programs, 32]``, program ``pid_m * num_parts + pid_p``,
column = event; every thread of the partition stores its own reading, so a slot holds one of
its threads'); ``summarize`` turns one launch's slots into per-event spreads over programs,
in microseconds after the first program's entry. ``%globaltimer`` ticks in steps of about
0.26 us on an H100 (observed), the resolution of every figure here.

The copies are written to a temporary directory and imported from there: Gluon compiles only
functions defined in a file.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

__all__ = ["EVENTS", "STORED", "kernel_for", "instrument", "install", "summarize"]

#: slots a program has in the buffer, and how many of a request's first tiles get a slot each
#: (slots 16 on: the cadence of the loop)
SLOTS = 32
CADENCE = 16
#: event slot -> what it marks, per kernel
EVENTS = {
    "pp": {0: "entry", 1: "plan visible (after griddepcontrol.wait)", 2: "A: q landed (first request)",
           3: "A: first tile's QK begins (waits for the tile's copy groups as they land)",
           4: "A: first QK done", 5: "A: loop end (first request)",
           6: "A or B: result stored (last request)", 7: "B: entry",
           8: "B: first own tile's QK begins (waits for its copy groups)",
           **{16 + k: f"A: tile {2 * k}'s QK begins (first request)" for k in range(CADENCE)}},
    "ws64": {0: "entry", 1: "plan visible (after griddepcontrol.wait)", 2: "consumer: q landed (first request)",
             3: "consumer: first tile ready", 4: "consumer: second tile ready", 5: "consumer: loop end",
             6: "consumer: result stored", 7: "producer: entry", 8: "producer: first tile converted",
             9: "producer: second tile converted",
             **{16 + k: f"consumer: tile {k} ready (first request)" for k in range(CADENCE)}},
    "rs": {0: "entry", 1: "plan visible (after griddepcontrol.wait)", 2: "WG0: q stored (first request)",
           3: "WG0: first tile ready", 4: "WG1: first tile ready", 5: "WG0: first tile's scores exchanged",
           6: "WG0: loop end (last request)", 7: "producer: entry", 8: "WG0: result stored (last request)",
           9: "WG1: result stored (last request)",
           **{16 + k: f"WG0: the program's tile {k} ready" for k in range(CADENCE)}},
    "kt": {0: "entry", 1: "plan visible (after griddepcontrol.wait)", 2: "consumer: q stored (first request)",
           3: "consumer: first tile ready", 4: "consumer: first QK done", 5: "consumer: loop end (last request)",
           6: "consumer: result stored (last request)", 7: "producer: entry", 8: "consumer: first stage freed",
           **{16 + k: f"consumer: the program's tile {k} ready" for k in range(CADENCE)}},
}

#: per kernel, the event that marks a program's (last) result stored
STORED = {"pp": 6, "ws64": 6, "rs": 8, "kt": 6}


def kernel_for(kv: str, h: int, s_q: int):
    """The instrumented kernel (a key of ``EVENTS``) that a Hopper launch of ``kv`` ('bf16' / 'fp8')
    at ``h`` heads x ``s_q`` tokens runs at the default config, or None when none is: 64-row
    launches (more than 32 query rows) run pp (16-bit) or ws64 (FP8), FP8 at up to 16 rows rs,
    16-bit at up to 32 rows kt."""
    rows = h * s_q
    if rows > 32:
        return "ws64" if kv == "fp8" else "pp"
    if kv != "fp8":
        return "kt"
    return "rs" if rows <= 16 else None


_MODULES = {"pp": "mla_fuzz.kernels.hopper.decode_wgmma_pp", "ws64": "mla_fuzz.kernels.hopper.decode_wgmma_ws64",
            "rs": "mla_fuzz.kernels.hopper.decode_wgmma_rs", "kt": "mla_fuzz.kernels.hopper.decode_wgmma_kt"}
#: each module's launcher, by the route table's kernel name (``kernels.routes.LAUNCHERS``)
_LAUNCHERS = {"pp": ("wgmma_pp", "launch_decode_wgmma_pp"), "ws64": ("wgmma_ws64", "launch_decode_wgmma_ws64"),
              "rs": ("wgmma_rs", "launch_decode_wgmma_rs"), "kt": ("wgmma_kt", "launch_decode_wgmma_kt")}

_HELPER = '''
if gluon is not None:
    @gluon.jit
    def _ts(ts_ptr, e):
        # this thread's %globaltimer into the program's slot ``e``
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        pid = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        gl.store(ts_ptr + pid * 32 + e, t)

#: the int64 [programs, 32] buffer the next launch stores into (``install``)
TS = [None]

'''

# Edits, each of whose anchors must occur exactly ``count`` times: ("sub", old, new, count)
# replaces text; ("before" / "after", anchor, lines, count[, indent]) puts ``lines`` before /
# after each source line containing the anchor, at that line's indentation (or ``indent``
# spaces).
_ONCE = ("if nreq == 0:", "    if j == 0:")  # pp: the first tile of the first request


def _timer(e, *guards):
    # ``guards`` (nested ifs) then the timer store of event ``e``
    return [*guards, "    " * len(guards) + f"_ts(ts_ptr, {e})"]


# the launcher passes the buffer ``install`` set, after the partial lse
_LAUNCH_TS = ("sub", "partial_o, partial_lse, block_table.shape[1]",
              "partial_o, partial_lse, TS[0], block_table.shape[1]", 1)
_KERNEL_WAIT = "wait_prior_grid(PDL)  # before any read of the plan"
_WORKER_WAIT = "wait_prior_grid(PDL)  # this partition's warps too"
# every kernel: the launcher's buffer, and the kernel's entry and plan-visible timers
_ENTRY = [_LAUNCH_TS, ("before", _KERNEL_WAIT, _timer(0), 1), ("after", _KERNEL_WAIT, _timer(1), 1)]
# the kernel signature of pp and kt (ws64 and rs break theirs over other lines)
_KERNEL_SIG = ("sub", "lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: gl.constexpr,",
               "lse_ptr, po_ptr, plse_ptr, ts_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: gl.constexpr,", 1)
_EDITS = {
    "pp": [
        # the partitions' signatures and their argument tuples in the kernel, then the kernel's
        ("sub", "po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s",
         "po_ptr, plse_ptr, ts_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s", 4),
        _KERNEL_SIG,
        *_ENTRY,
        ("after", "mbarrier.arrive(qready.index(0))", _timer(2, "if nreq == 0:"), 1),
        ("before", "s = _pp_scores(q_lat_s, q_rope_s, kr_s, k_s, z, z, _S_L)", _timer(3, *_ONCE), 1),
        ("before", "s = _pp_scores(q_lat_s, q_rope_s, kr_s, k_s, z, z, _S_L)",
         ["if nreq == 0:", "    if j < 16:", "        _ts(ts_ptr, 16 + j)"], 1),
        ("after", "s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))", _timer(4, *_ONCE), 1),
        ("before", "nreq += 1", _timer(6), 2),  # after each partition's _pp_finish
        ("before", "_pp_finish(acc, m_i, l_i, lx_s, lready, 0, nreq", _timer(5, "if nreq == 0:"), 1),
        ("after", _WORKER_WAIT, _timer(7), 1),
        ("after", "# own QK runs while A's softmax does", _timer(8, *_ONCE), 1),
    ],
    "ws64": [
        ("sub", "out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,\n",
         "out_ptr, lse_ptr, po_ptr, plse_ptr, ts_ptr, bt_stride, partial_cap, qk_scale, SQ, H,\n", 1),
        # the 64-row consumer's signature and argument tuple
        ("sub", "po_ptr,\n                      plse_ptr, partial_cap, qk_scale",
         "po_ptr,\n                      plse_ptr, ts_ptr, partial_cap, qk_scale", 1),
        ("sub", "                                 po_ptr, plse_ptr, partial_cap, qk_scale",
         "                                 po_ptr, plse_ptr, ts_ptr, partial_cap, qk_scale", 1),
        ("sub", "nsplit_ptr, off_ptr, bt_stride,", "nsplit_ptr, off_ptr, ts_ptr, bt_stride,", 3),  # the producer's
        *_ENTRY,
        ("after", _WORKER_WAIT, _timer(7), 1),
        ("after", "mbarrier.arrive(ready.index(s))", _timer(8, "if it == 0:") + _timer(9, "if it == 1:"), 1),
        ("after", "RANK, ROPE, Q_L, QR_L)", _timer(2, "if it == 0:"), 1, 16),  # start_request_rows' 2nd line
        # both consumers' turn to a tile
        ("after", "acc = _w64_take_buffer(acc, it, tile, t0, ready, empty, NB)",
         _timer(3, "if it == 0:") + _timer(4, "if it == 1:") + ["if it < 16:", "    _ts(ts_ptr, 16 + it)"], 2),
        ("before", "if STAGE_PART and nsplit > 1 and b == b_last:", _timer(5), 1),
        # (the last line of the stores' if / else: the statement's indentation is the if's)
        ("after", "                                      STAGE_OUT)", _timer(6), 1, 16),
    ],
    "rs": [
        ("sub", "po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale,",
         "po_ptr, plse_ptr, ts_ptr, bt_stride, partial_cap, qk_scale,", 1),  # the kernel's signature
        # the consumers' signature and their two argument tuples, then the producer's
        ("sub", "plse_ptr, partial_cap, qk_scale, SQ, H, codes_s",
         "plse_ptr, ts_ptr, partial_cap, qk_scale, SQ, H, codes_s", 3),
        ("sub", "off_ptr, bt_stride,\n" + " " * 21 + "codes_s,",
         "off_ptr, ts_ptr, bt_stride,\n" + " " * 21 + "codes_s,", 1),
        ("sub", "off_ptr,\n" + " " * 28 + "bt_stride, codes_s,",
         "off_ptr,\n" + " " * 28 + "ts_ptr, bt_stride, codes_s,", 1),
        *_ENTRY,
        ("after", _WORKER_WAIT, _timer(7), 1),  # the producer's
        ("after", "copy_q_rope_now(q_rope_s, q_row, r_rope, c_rope, ROWS, RANK)", _timer(2, "if it == 0:"), 1),
        ("after", "mbarrier.wait(ready.index(s), (it // NS) & 1)",
         ["if WG == 0:", "    if it == 0:", "        _ts(ts_ptr, 3)", "    if it < 16:", "        _ts(ts_ptr, 16 + it)",
          "else:", "    if it == 0:", "        _ts(ts_ptr, 4)"], 1),
        ("after", "other = sx_s.index(2 * x + 1 - WG).load(MMA_L)", _timer(5, "if WG == 0:", "    if it == 0:"), 1),
        ("before", "l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))", _timer(6, "if WG == 0:"), 1),
        # each group's store call's second line: WG 0's reading after its lse, WG 1's after its second group
        ("after", "                                out_ptr, po_ptr, ROWS, RANK)", _timer(9, "if WG == 1:"), 2, 16),
        ("after", "store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)",
         _timer(8), 1),
    ],
    "kt": [
        _KERNEL_SIG,
        # the consumer's signature and argument tuple, then the producer's
        ("sub", "plse_ptr, partial_cap, qk_scale, SQ, H, k_s, q_lat_s",
         "plse_ptr, ts_ptr, partial_cap, qk_scale, SQ, H, k_s, q_lat_s", 2),
        ("sub", "nsplit_ptr, off_ptr, bt_stride, k_s, ready, empty,",
         "nsplit_ptr, off_ptr, ts_ptr, bt_stride, k_s, ready, empty,", 2),
        *_ENTRY,
        ("after", _WORKER_WAIT, _timer(7), 1),
        ("after", "ROPE, Q_L, QR_L)", _timer(2, "if it == 0:"), 1, 16),  # start_request_rows' 2nd line
        ("after", "mbarrier.wait(ready.index(s), (it // NS) & 1)",
         _timer(3, "if it == 0:") + ["if it < 16:", "    _ts(ts_ptr, 16 + it)"], 1),
        ("after", "sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))", _timer(4, "if it == 0:"), 1),
        ("after", "mbarrier.arrive(empty.index(s))", _timer(8, "if it == 0:"), 1),
        ("before", "l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))", _timer(5), 1),
        ("after", "store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)",
         _timer(6), 1),
    ],
}


def _apply(src: str, edit, where: str) -> str:
    kind, anchor, what, count = edit[:4]
    found = src.count(anchor)
    if found != count:
        raise ValueError(f"{where}: anchor found {found} times, expected {count}: {anchor[:90]!r}")
    if kind == "sub":
        return src.replace(anchor, what)
    out = []
    for line in src.split("\n"):
        if anchor in line:
            pad = " " * edit[4] if len(edit) > 4 else line[:len(line) - len(line.lstrip())]
            block = [pad + x for x in what]
            out.extend(block + [line] if kind == "before" else [line] + block)
        else:
            out.append(line)
    return "\n".join(out)


_BUILT: dict = {}


def instrument_source(name: str) -> str:
    """The instrumented source of kernel module ``name`` (a key of ``EVENTS``): its shipping
    source with the relative imports made absolute, the timer helper added and every edit of
    ``_EDITS[name]`` applied. Raises ``ValueError`` naming the first anchor that does not
    occur exactly as often as expected (the kernel changed: update the anchors)."""
    if name not in _EDITS:
        raise ValueError(f"no timeline for kernel {name!r}; known: {sorted(_EDITS)}")
    module = importlib.import_module(_MODULES[name])
    src = inspect.getsource(module).replace("from ..", "from mla_fuzz.kernels.").replace(
        "from .", "from mla_fuzz.kernels.hopper.")
    marker = "\n__all__ = ["
    if src.count(marker) != 1:
        raise ValueError(f"{_MODULES[name]}: no single '__all__' line to put the timer helper before")
    src = src.replace(marker, "\n" + _HELPER + marker.lstrip("\n"), 1)
    for edit in _EDITS[name]:
        src = _apply(src, edit, _MODULES[name])
    return src


def instrument(name: str):
    """The instrumented copy of kernel module ``name`` as an imported module (built once per
    process, from a file in a temporary directory)."""
    if name not in _BUILT:
        src = instrument_source(name)
        path = os.path.join(tempfile.mkdtemp(prefix="mla_timeline_"), f"timeline_{name}.py")
        with open(path, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location(f"_mla_timeline_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # Gluon resolves a jit function's globals through its module
        spec.loader.exec_module(mod)
        _BUILT[name] = mod
    return _BUILT[name]


def install(ts: torch.Tensor):
    """Route the pp, ws64, rs and kt launches (``kernels.routes.LAUNCHERS``) to the instrumented copies,
    storing into ``ts`` (int64 ``[programs, 32]``, zeroed by the caller before each launch to be read).
    Returns a function that restores the shipping launchers."""
    from mla_fuzz.kernels import routes
    if ts.dtype != torch.int64 or ts.dim() != 2 or ts.shape[1] != SLOTS:
        raise ValueError(f"ts must be int64 [programs, 32], got {tuple(ts.shape)} {ts.dtype}")
    saved = {}
    for name, (kernel, launcher) in _LAUNCHERS.items():
        mod = instrument(name)
        mod.TS[0] = ts
        saved[kernel] = routes.LAUNCHERS[kernel]
        routes.LAUNCHERS[kernel] = getattr(mod, launcher)

    def restore():
        routes.LAUNCHERS.update(saved)

    return restore


def summarize(ts: torch.Tensor, events: dict) -> dict:
    """One launch's slots ``ts`` (int64 ``[programs, 32]``, ns, 0 = not reached) -> for each
    event of ``events`` reached by some program: ``[min, median, max]`` over those programs of
    its time in microseconds after the earliest entry (slot 0), plus ``programs`` (those that
    entered)."""
    t = ts.detach().cpu().to(torch.float64)
    entered = t[:, 0] > 0
    if not bool(entered.any()):
        raise ValueError("no program recorded its entry (slot 0): was the instrumented kernel launched?")
    t = t[entered]
    t0 = t[:, 0].min()
    out = {"programs": int(entered.sum())}
    for e, what in events.items():
        col = t[:, e]
        col = col[col > 0]
        if col.numel():
            rel = (col - t0) / 1000.0
            q = torch.quantile(rel, torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist()
            out[f"{e}: {what}"] = [round(x, 3) for x in q]
    return out
