"""The mutation detection matrix: every mutant in ``harness.mutants.ALL`` fuzzed with the
same seed and example count, plus the clean ``triton`` backend, each in a worker process.

A row says whether the mutant was caught, after how many examples and seconds, with
which diagnosis class, and whether that class is one ``harness.mutants.EXPECTED`` accepts.
A mutant that kills or hangs its worker is caught as ``crash`` / ``hang``.

Times count from the command's start (``started_at``): ``seconds_to_detect`` is the row's
first sight of a failure (the worker's ``found`` message, before shrinking; a worker's death
for crash/hang), ``seconds`` the row's end (shrunk and diagnosed), ``row_started_s`` when
the row was handed to a worker (rows wait for a free worker).

With ``warmup`` (a ``harness.warmup.WarmupPlan``), the rows' workers first run the warmup
phase (the clean backend's kernel variants compiled once, in parallel, into Triton's cache);
row times then include it, as they include every start-up cost.

With ``mps`` the workers share each GPU under a private CUDA MPS daemon (``harness.mps``):
rows side by side on one GPU run their kernels concurrently instead of time-slicing it. MPS
shares a fatal GPU fault among the processes of a GPU, so a row whose worker died or hung
there may have died of its neighbour's fault: each such row runs again, alone, in a worker
without MPS, and that run is the row (``mps_rerun``; its times still count from the command's
start).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .crash_repro import CLASSES, crash_repro
from .pool import Pool
from .repro import write_repro
from .throttle import OomThrottle

CLEAN = "triton"


#: ``mla-fuzz mutants --set``: which mutants, from which module and names
MUTANT_SETS = {"public": ("mutants", "ALL", "EXPECTED"),
               "heldout": ("mutants.heldout", "HELDOUT", "HELDOUT_EXPECTED")}


#: Hypothesis' wall-clock bound on shrinking a row's failure (its own default is 300 s, which
#: the Triton interpreter on a CPU can spend on one row); the row's diagnosis and repro are of
#: the smallest failure seen by then.
SHRINK_SECONDS = 60.0


def load_mutants(mutant_set: str = "public") -> tuple[dict, dict]:
    """``(ALL, EXPECTED)`` from ``harness.mutants`` (``mutant_set="public"``), or ``(HELDOUT,
    HELDOUT_EXPECTED)`` from ``harness.mutants.heldout`` (``"heldout"``: written after the
    search and diagnosis were tuned on the public set, and never run by the matrix tests);
    ValueError saying why if unavailable."""
    if mutant_set not in MUTANT_SETS:
        raise ValueError(f"unknown mutant set {mutant_set!r}; known: {', '.join(MUTANT_SETS)}")
    module, all_name, expected_name = MUTANT_SETS[mutant_set]
    try:
        import importlib
        mutants = importlib.import_module(f"{__package__}.{module}")
    except Exception as exc:
        raise ValueError(f"mla_fuzz.harness.{module} cannot be imported ({type(exc).__name__}: {exc})") from None
    all_ = getattr(mutants, all_name, None)
    if not isinstance(all_, dict) or not all_:
        raise ValueError(f"mla_fuzz.harness.{module}.{all_name} is missing or empty")
    return all_, dict(getattr(mutants, expected_name, {}) or {})


def run_matrix(names: list[str], expected: dict, *, graph: str, spec: str, examples: int, seed: int,
               worker_envs: list[dict], case_timeout: float | None, corpus: Path | None = None,
               on_row=None, max_seq_len: int | None = None, on_sight=None,
               started_at: float | None = None, warmup=None, on_warmup=None, on_note=None,
               mps: bool = False) -> list[dict]:
    """Fuzz each backend ref in ``names`` (``mutant:NAME`` or ``triton``) at ``spec`` (a name, or
    a list of them: a row per backend and spec); one dict per row in ``names`` order, its specs
    in ``spec``'s order (sequences up to ``max_seq_len``; None: per spec and device).
    ``on_row(row, done, total)`` is called as rows finish, ``on_sight(name, seconds,
    examples)`` when a row first sees a failure. Times count from ``started_at`` (epoch
    seconds; default now). On Ctrl-C the rows finished so far are returned (fewer than
    ``names``). ``warmup``: a warmup plan run on the rows' workers first (``on_warmup(outcome)``
    gets what it did, ``on_note(text)`` its progress lines). ``mps``: workers under private MPS
    daemons, one per GPU (``harness.mps.MpsError`` if one cannot start; module doc)."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    # a backend's rows at each size side by side, so the first findings at both sizes come early
    pairs = [(ref, sp) for ref in names for sp in specs]
    tasks = [{"op": "fuzz", "id": f"m{i}", "backend": ref, "graph": graph, "spec": sp, "examples": examples,
              "seed": seed, "budget_s": None, "shrink": True, "shrink_seconds": SHRINK_SECONDS,
              "max_seq_len": max_seq_len} for i, (ref, sp) in enumerate(pairs)]
    rows: dict[str, dict] = {}
    pending = list(tasks)
    clock = _Clock(time.time() if started_at is None else started_at)
    envs = worker_envs[: max(1, min(len(worker_envs), len(tasks)))]
    daemons = None
    if mps:
        from .mps import MpsDaemons
        daemons = MpsDaemons.for_envs(envs).start()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-matrix-") as logs:
        pool = Pool(envs if daemons is None else [daemons.client_env(e) for e in envs], logs,
                    case_timeout=case_timeout)
        try:
            pool.start()
            if on_note is not None and pool.launcher:
                on_note(f"{clock.now():.1f}s: workers: {pool.launcher}" + ("" if daemons is None else ", under MPS"))
            driver = _Rows(pending, rows, len(tasks), expected, graph, case_timeout, corpus, on_row, on_sight, clock,
                           on_note)
            if warmup is not None:
                out = _warmup(pool, warmup, clock, on_note, driver)
                if on_warmup is not None:
                    on_warmup(out)
            _drive(pool, driver)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            pool.close(kill=True)
            if daemons is not None:
                daemons.stop()
        if daemons is not None and not interrupted:
            _confirm_without_mps(tasks, rows, envs, logs, expected, graph, case_timeout, corpus, on_row, clock,
                                 on_note)
    return [rows[t["id"]] for t in tasks if t["id"] in rows]


def _confirm_without_mps(tasks, rows, envs, logs, expected, graph, case_timeout, corpus, on_row, clock,
                         on_note) -> None:
    """Rows whose worker died or hung under MPS run again without it (module doc)."""
    again = [t for t in tasks if t["id"] in rows and rows[t["id"]].get("process_end")]
    if not again:
        return
    if on_note is not None:
        on_note(f"{clock.now():.1f}s: {len(again)} row(s) ended with their worker's death under MPS, where a "
                "neighbour's GPU fault ends every worker of the GPU: running them again without MPS")
    for t in again:
        clock.sights.pop(t["id"], None)
        clock.started.pop(t["id"], None)
        del rows[t["id"]]
    pool = Pool(envs[: len(again)], logs, case_timeout=case_timeout)
    try:
        pool.start()
        driver = _Rows(list(again), rows, len(tasks), expected, graph, case_timeout, corpus, on_row, None, clock,
                       on_note)
        _drive(pool, driver)
    except KeyboardInterrupt:
        pass
    finally:
        pool.close(kill=True)
    for t in again:
        if t["id"] in rows:
            rows[t["id"]]["mps_rerun"] = True


def _warmup(pool, plan, clock, on_note=None, rows: _Rows | None = None):
    """The warmup phase on the matrix's workers (``harness.warmup.run_warmup``); a worker that
    cannot start is a RuntimeError, as in the rows. Once every warmup scenario has a worker,
    ``rows`` gets the idle ones: the first rows start during the warmup's last scenarios."""
    from .warmup import WorkerFatal, run_warmup, skipped, summary_line

    def note(text: str) -> None:
        if on_note is not None:
            on_note(text)

    if plan.warm:
        out = skipped(plan)
        note(summary_line(out))
        return out
    last = [0.0, -1]

    def tick(done: int, total: int) -> None:
        now = clock.now()
        if done != last[1] and (now - last[0] >= 5.0 or done == total):
            last[0], last[1] = now, done
            note(f"{now:.1f}s: warmup {done}/{total} scenarios")

    note(f"{clock.now():.1f}s: warmup: {plan.describe()} on {len(pool.workers)} worker(s)")
    try:
        out = run_warmup(plan, pool, note=note, on_tick=tick,
                         on_idle=None if rows is None else (lambda w: rows.start(pool, w)),
                         on_event=None if rows is None else (lambda ev: rows.handle(ev, pool)))
    except WorkerFatal as exc:
        raise RuntimeError(str(exc)) from None
    note(f"{clock.now():.1f}s: " + summary_line(out, len(pool.workers)))
    return out


class _Clock:
    """Seconds since the command's start (epoch ``origin``), on the monotonic clock."""

    def __init__(self, origin: float):
        self._t0 = time.monotonic() - max(0.0, time.time() - origin)
        self.started: dict[str, float] = {}   # task id -> row handed to a worker
        self.sights: dict[str, tuple] = {}    # task id -> (seconds, examples) of its first failure
        self.oom_retries: dict[str, int] = {}  # task id -> times it ran out of GPU memory and ran again

    def now(self) -> float:
        return time.monotonic() - self._t0


class _Rows:
    """The rows still to run and the events of those running: hands an idle worker its next
    row (``start``) and turns a row's end into its dict (``handle``)."""

    def __init__(self, pending, rows, total, expected, graph, case_timeout, corpus, on_row, on_sight, clock,
                 on_note):
        self.pending, self.rows, self.total, self.expected = pending, rows, total, expected
        self.graph, self.case_timeout, self.corpus = graph, case_timeout, corpus
        self.on_row, self.on_sight, self.clock, self.on_note = on_row, on_sight, clock, on_note
        self.throttle = OomThrottle()
        self.by_spec = len({t.get("spec") for t in pending}) > 1

    @property
    def left(self) -> bool:
        return bool(self.pending or self.throttle.retry)

    def start(self, pool, w) -> bool:
        """Give the idle worker ``w`` a row (one that ran out of memory first), if one may start."""
        if not self.throttle.allows(pool.running):
            return False
        task = self.throttle.next_retry(pool.running)
        if task is None:
            if not self.pending:
                return False
            task = self.pending.pop(0)
        self.clock.started.setdefault(task["id"], self.clock.now())
        pool.submit(w, task)
        return True

    def handle(self, ev, pool) -> None:
        clock = self.clock
        if ev.kind == "fatal":
            raise RuntimeError(f"worker could not start: {ev.msg.get('error')}\n"
                               + "\n".join(ev.msg.get("log_tail") or []))
        if self.throttle.retries(ev):
            # not the row's finding: it runs again with fewer rows beside it (a failure it
            # had already sighted keeps that first sight)
            line = self.throttle.ran_out(ev.task, pool.running + 1)
            clock.oom_retries[ev.task["id"]] = clock.oom_retries.get(ev.task["id"], 0) + 1
            if self.on_note is not None:
                self.on_note(f"{clock.now():.1f}s: notice: {line}: {ev.msg.get('error')}")
            return
        if ev.kind == "found" and ev.task is not None:
            at = clock.now()
            clock.sights.setdefault(ev.task["id"], (at, ev.msg.get("examples_to_detect")))
            if self.on_sight is not None:
                label = row_label({"name": _name(ev.task["backend"]), "spec": ev.task.get("spec")}, self.by_spec)
                self.on_sight(label, at, ev.msg.get("examples_to_detect"))
            return
        if ev.kind in ("step", "phase", "ready", "found") or ev.task is None:
            return
        row = _row(ev, self.expected, self.graph, self.case_timeout, self.corpus)
        tid = ev.task["id"]
        row["row_started_s"] = _round(clock.started.get(tid))
        row["seconds"] = _round(clock.now())
        row["oom_retries"] = clock.oom_retries.get(tid, 0)
        if row["caught"]:
            sight = clock.sights.get(tid)
            if sight is not None:
                row["seconds_to_detect"] = _round(sight[0])
            elif ev.kind in ("died", "hung"):
                row["seconds_to_detect"] = row["seconds"]  # the death is its first sight
            elif row.get("search_seconds_to_detect") is not None and tid in clock.started:
                row["seconds_to_detect"] = _round(clock.started[tid] + row["search_seconds_to_detect"])
            else:
                row["seconds_to_detect"] = row["seconds"]
        self.rows[tid] = row
        if self.on_row is not None:
            self.on_row(row, len(self.rows), self.total)


def _drive(pool, rows: _Rows) -> None:
    while rows.left or pool.busy:
        for w in pool.idle():
            if not rows.start(pool, w):
                break
        for ev in pool.poll(0.25):
            rows.handle(ev, pool)


def _row(ev, expected: dict, graph: str, case_timeout, corpus) -> dict:
    ref = ev.task["backend"]
    name = _name(ref)
    row = {"name": name, "backend": ref, "spec": ev.task.get("spec"), "caught": False, "examples": None,
           "examples_to_detect": None, "seconds_to_detect": None, "seconds": None, "row_started_s": None,
           "search_seconds_to_detect": None, "shrink_runs": None, "diagnosis": None, "oracle": None,
           "expected": sorted(expected.get(name, ())), "matches": None, "repro": None, "message": None,
           "error": None, "process_end": None}
    repro = None
    if ev.kind == "done":
        rep = ev.msg["report"]
        repro = rep.get("repro")
        row["examples"] = rep.get("examples")
        row["examples_to_detect"] = rep.get("examples_to_detect")
        row["shrink_runs"] = rep.get("shrink_runs")
        if repro is not None:  # from the search's own start (after the row's backend was built)
            row["search_seconds_to_detect"] = _round(rep.get("seconds_to_detect"))
    elif ev.kind == "error":
        row["error"] = ev.msg.get("error")
    else:  # died / hung
        row["process_end"] = ev.kind
        repro = crash_repro(ev.kind, ref, graph, ev.msg, {"seed": ev.task.get("seed")}, case_timeout)
        if repro is None:
            row["diagnosis"] = CLASSES[ev.kind]
            row["caught"] = True
    if repro is not None:
        row["caught"] = True
        row["diagnosis"] = (repro.get("diagnosis") or {}).get("cls")
        row["oracle"] = (repro.get("failure") or {}).get("oracle")
        # what the finding said, so a flagged clean backend or an unexpected diagnosis can be
        # judged from the matrix alone (the whole repro goes to --corpus)
        row["message"] = _first_line((repro.get("failure") or {}).get("message"))
        if corpus is not None:
            row["repro"] = str(write_repro(repro, corpus))
    if ref != CLEAN and row["caught"] and row["expected"]:
        row["matches"] = row["diagnosis"] in row["expected"]
    return row


def _first_line(text, limit: int = 400):
    if not text:
        return None
    line = str(text).strip().splitlines()[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _round(v):
    return None if v is None else round(float(v), 3)


def _name(ref: str) -> str:
    """A row's name: the mutant's for ``mutant:NAME``, else the reference itself."""
    return ref.split(":", 1)[1] if ref.startswith("mutant:") else ref


def row_label(row: dict, by_spec: bool) -> str:
    """The row's name, with its spec when the matrix has rows at several sizes."""
    return f"{row['name']} ({row.get('spec')})" if by_spec else row["name"]


def verdict(rows: list[dict], strict: bool = False) -> tuple[int, list[str]]:
    """Exit status and reasons: 1 when a mutant escaped, the clean backend was flagged, a
    row errored, or (``strict``) a diagnosis is not an expected one."""
    bad = []
    by_spec = len({r.get("spec") for r in rows}) > 1
    for r in rows:
        name = row_label(r, by_spec)
        if r.get("error"):
            bad.append(f"{name}: error: {r['error']}")
        elif r["backend"] == CLEAN and r["caught"]:
            where = f" ({r.get('spec')})" if by_spec else ""
            bad.append(f"clean backend{where} flagged: {r['diagnosis']}" + _said(r))
        elif r["backend"] != CLEAN and not r["caught"]:
            bad.append(f"{name} escaped ({r['examples']} examples)")
        elif strict and r.get("matches") is False:
            bad.append(f"{name} diagnosed {r['diagnosis']}, expected one of {r['expected']}" + _said(r))
    return (1 if bad else 0), bad


def _said(row: dict) -> str:
    return f" ({row['oracle']}: {row['message']})" if row.get("message") else ""


def matrix_json(rows: list[dict], *, graph: str, spec: str, examples: int, seed: int, seconds: float,
                warmup=None) -> dict:
    """The matrix as JSON; ``warmup`` (a ``harness.warmup.WarmupOutcome``): the warmup phase's
    fields (``warm``, ``warmup_s``, ``warmup_scenarios``, ``warmup``; null without one)."""
    w = None if warmup is None else warmup.to_dict()
    return {"format": "mla-fuzz-matrix/1", "graph_mode": graph, "spec": spec, "examples": examples, "seed": seed,
            "wall_s": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "warm": None if w is None else w["warm"], "warmup_s": None if w is None else w["seconds"],
            "warmup_scenarios": None if w is None else w["scenarios"], "warmup": w,
            "clock": "row times count from the command's start: imports, worker start-up and the warmup included",
            "rows": rows}
