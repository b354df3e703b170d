"""A fuzz campaign: many ``fuzz()`` chunks over a pool of worker processes.

The search runs in chunks of ``chunk`` examples; chunk ``k`` gets the seed
``chunk_seed(seed, k)`` whichever worker runs it, so worker seeds are disjoint and an
example-bounded campaign explores the same scenarios with 1 or N workers. Results merge
in the parent: counts and coverage add up, failures are deduplicated by
``harness.repro.signature`` and each distinct one is written to the corpus (atomically)
as soon as it arrives -- so Ctrl-C or a killed worker never loses a repro already found.

A failure is reported the moment a worker first sees it (its ``found`` message): the
finding, its unshrunk repro in the corpus and a live line, before Hypothesis shrinks it.
The chunk's shrunk, diagnosed repro then replaces that file in the same finding; if it
never comes (the worker died, the campaign was killed), the unshrunk repro is the finding.
Every time (``found_at_s``, ``elapsed``, the budget) counts from the command's start
(``CampaignOptions.started_at``). Counts (examples, steps, coverage) are of searched
examples only; shrink re-runs and diagnosis time are counted apart.

Before the first chunk, a warmup phase (``CampaignOptions.warmup``, ``harness.warmup``) may
run a fixed list of scenarios on the same workers, so the kernel variants are compiled
once, in parallel, into Triton's cache; it is skipped when a marker says this machine
already did it. Its time is inside the campaign's clock (times still count from the
command's start) and reported apart (``warmup_s``).

Two specs (``CampaignOptions.spec`` ``"tiny,deepseek-v3"``) are fuzzed interleaved: chunk ``k``
fuzzes ``chunk_spec(specs, k)`` (even chunks the first spec, odd ones the second), seeded
``chunk_seed(seed, k)`` as ever.

A worker that dies or hangs mid-step becomes a ``crash`` / ``hang`` failure with a repro
built from its in-flight scenario (``harness.crash_repro``), reduced in fresh workers, and
the campaign goes on with a restarted worker.
"""
from __future__ import annotations

import hashlib
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .crash_repro import StepReducer, crash_repro
from .pool import Pool, exit_text
from .repro import signature, write_repro
from .scenario import ScenarioConfig, add_note, scenario_coverage, step_coverage, withdraw_notes
from .throttle import OomThrottle

DEFAULT_CHUNK = 100
# Reductions of a crash found near the end may finish this long after the budget.
REDUCE_GRACE_S = 30.0
# After the budget, running chunks get this long to end on their own before being stopped.
STOP_GRACE_S = 2.0
#: the share of a ``--budget`` the warmup may start scenarios in (the search has the rest)
WARMUP_SHARE = 0.5
# Consecutive worker deaths before any step (nothing to replay) that abort the campaign.
MAX_BLIND_DEATHS = 3


def chunk_seed(seed: int, k: int) -> int:
    """Seed of chunk ``k`` of a campaign seeded ``seed``: distinct per chunk, independent
    of which worker runs it."""
    h = hashlib.blake2b(f"mla-fuzz:{seed}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def chunk_spec(specs, k: int) -> str:
    """The spec chunk ``k`` fuzzes when a campaign interleaves ``specs`` (a tuple of spec names):
    they take turns, ``specs[k % len(specs)]``, whichever worker or shard runs the chunk."""
    return specs[k % len(specs)]


def shard_chunks(examples: int, chunk: int, shard: tuple = (0, 1)) -> list[tuple[int, int]]:
    """``(k, examples)`` of the chunks that shard ``I/N`` of an ``examples``-bounded campaign
    runs: the unsharded campaign's chunks ``k`` (``examples`` in chunks of ``chunk``) with
    ``k % N == I``, each with the examples the unsharded campaign gives it."""
    i, n = shard
    count = -(-examples // chunk)
    return [(k, min(chunk, examples - k * chunk)) for k in range(i, count, n)]


@dataclass
class CampaignOptions:
    """What ``mla-fuzz run`` asked for; ``graph`` is already resolved (cuda/emulated/eager)."""

    backend: str = "triton"
    graph: str = "emulated"
    # one spec name, or several comma-separated ("tiny,deepseek-v3"): chunks take turns
    # (``chunk_spec``)
    spec: str = "tiny"
    budget_s: float | None = 60.0
    examples: int | None = None
    seed: int = 0
    corpus: Path = Path(".mla-fuzz/corpus")
    worker_envs: list = field(default_factory=lambda: [{}])
    case_timeout: float | None = 300.0
    chunk: int = DEFAULT_CHUNK
    reduce: bool = True
    # run the workers under a private CUDA MPS daemon (harness.mps); crash/hang repros are
    # then confirmed by a replay without MPS at the end instead of being reduced
    mps: bool = False
    # with ``mps``: MPS daemons already running (harness.mps.MpsDaemons, one per GPU; a bench shares them
    # across campaigns); None = start a private one for this campaign
    mps_daemons: object = None
    # the user's narrowing of the backend's capabilities (``Capabilities.narrow`` keywords)
    narrow: dict = field(default_factory=dict)
    # judge every tensor a kernel gets for contiguity, not only the metadata's views
    strict_contiguity: bool = False
    # (I, N): run only the chunks k with k % N == I, each seeded as in the unsharded campaign
    # (with ``examples``: the unsharded campaign's chunks covering them; see ``shard_chunks``)
    shard: tuple = (0, 1)
    # the longest sequence drawn; None: per spec and device (fuzz.default_max_seq_len)
    max_seq_len: int | None = None
    # when the user started the command (epoch seconds, e.g. the process start of
    # ``mla-fuzz run``): the campaign's clock counts from there; None = when ``run()`` starts
    started_at: float | None = None
    # the warmup phase before the first chunk (``harness.warmup.WarmupPlan``); None: none
    warmup: object = None

    @property
    def specs(self) -> tuple:
        """The spec names the campaign fuzzes, in turn order."""
        return tuple(x.strip() for x in str(self.spec).split(",") if x.strip())

    @property
    def device(self) -> str:
        """``cuda`` when the workers run the kernels on a GPU, else ``cpu`` (for per-spec defaults)."""
        if self.graph == "cuda":
            return "cuda"
        env = self.worker_envs[0] if self.worker_envs else {}
        return "cuda" if self.graph == "eager" and env.get("CUDA_VISIBLE_DEVICES") not in (None, "") else "cpu"

    def max_seq_len_of(self, spec: str) -> int:
        """The longest sequence drawn for ``spec``: ``max_seq_len`` when given, else the spec's
        default on this device (``fuzz.default_max_seq_len``)."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        from .fuzz import default_max_seq_len
        return default_max_seq_len(spec, self.device)


#: The class of a failure seen but not yet shrunk and diagnosed (its repro has no diagnosis).
UNDIAGNOSED = "undiagnosed"


@dataclass
class Finding:
    """One distinct failure (one signature) and where its repro is."""

    signature: str
    cls: str
    oracle: str
    message: str
    path: Path | None
    repro: dict
    count: int = 1
    found_at_s: float = 0.0                # first sight, seconds from the command's start
    examples_to_detect: int | None = None  # searched examples of the campaign up to the first sight
    reduced_from: int | None = None        # steps before shrinking / crash reduction
    shrunk: bool = True                    # False: the repro is the failure as first seen (undiagnosed)
    reduced_at_s: float | None = None      # when the shrunk, diagnosed repro was written

    def to_dict(self) -> dict:
        return {"signature": self.signature, "class": self.cls, "oracle": self.oracle, "message": self.message,
                "path": None if self.path is None else str(self.path), "count": self.count,
                "steps": len(self.repro["steps"]), "found_at_s": round(self.found_at_s, 3),
                "examples_to_detect": self.examples_to_detect, "reduced_from": self.reduced_from,
                "shrunk": self.shrunk,
                "reduced_at_s": None if self.reduced_at_s is None else round(self.reduced_at_s, 3)}


@dataclass
class CampaignResult:
    options: CampaignOptions
    started: float = field(default_factory=time.time)
    elapsed: float = 0.0
    examples: int = 0
    steps: int = 0
    chunks: int = 0
    coverage: dict = field(default_factory=dict)
    unsupported: Counter = field(default_factory=Counter)  # reason -> scenarios the backend declined
    capabilities: dict | None = None                  # what was drawn (``Capabilities.to_dict``)
    findings: dict = field(default_factory=dict)      # signature -> Finding
    failures: Counter = field(default_factory=Counter)  # diagnosis class -> occurrences
    restarts: int = 0
    launcher: str | None = None                       # how the workers started (``Pool.launcher``)
    interrupted: bool = False
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    error_kind: str | None = None                     # "input" | "internal" when the campaign could not run
    workers: int = 1
    state: str = "starting"
    startup_s: float | None = None                    # until the first worker was ready
    chunks_run: list = field(default_factory=list)    # [k, seed] of every chunk dispatched
    setup_s: float = 0.0                              # command start -> campaign start (imports, checks)
    shrink_runs: int = 0                              # scenarios re-run by Hypothesis' shrinking
    shrink_s: float = 0.0                             # chunk time from first sight to the end of the search
    diagnose_s: float = 0.0                           # chunk time spent diagnosing the failures found
    warmup: object = None                             # the warmup phase (``warmup.WarmupOutcome``), if any
    by_spec: dict = field(default_factory=dict)       # spec -> {"examples", "steps", "chunks"} (searched)
    oom_retries: int = 0                              # tasks run again after the GPU ran out of memory

    def count_spec(self, spec: str | None, examples: int = 0, steps: int = 0, chunks: int = 0) -> None:
        if spec is None:
            return
        d = self.by_spec.setdefault(spec, {"examples": 0, "steps": 0, "chunks": 0})
        d["examples"] += int(examples)
        d["steps"] += int(steps)
        d["chunks"] += int(chunks)

    def specs_dict(self) -> dict:
        """Per spec: searched examples, steps, chunks and the longest sequence drawn."""
        o = self.options
        out = {}
        for spec in o.specs:
            d = self.by_spec.get(spec, {"examples": 0, "steps": 0, "chunks": 0})
            try:
                longest = o.max_seq_len_of(spec)
            except Exception:  # an unknown spec name: the campaign's own error says so
                longest = o.max_seq_len
            out[spec] = {**d, "max_seq_len": longest}
        return out

    @property
    def rate(self) -> float:
        return self.examples / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict:
        o = self.options
        w = None if self.warmup is None else self.warmup.to_dict()
        return {
            "format": "mla-fuzz-report/1", "backend": o.backend, "graph_mode": o.graph, "spec": o.spec,
            "seed": o.seed, "budget_s": o.budget_s, "examples_limit": o.examples, "workers": self.workers,
            "case_timeout_s": o.case_timeout, "chunk": o.chunk, "corpus": str(o.corpus),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "elapsed_s": round(self.elapsed, 3), "examples": self.examples, "steps": self.steps,
            "shrink_runs": self.shrink_runs, "shrink_s": round(self.shrink_s, 3),
            "diagnose_s": round(self.diagnose_s, 3), "setup_s": round(self.setup_s, 3),
            "startup_s": None if self.startup_s is None else round(self.startup_s, 3),
            "cases_per_s": round(self.rate, 3), "chunks": self.chunks, "restarts": self.restarts,
            "workers_started": self.launcher,
            "interrupted": self.interrupted, "coverage": self.coverage,
            "capabilities": self.capabilities, "narrow": o.narrow, "max_seq_len": o.max_seq_len,
            "unsupported": dict(self.unsupported),
            "failures_by_class": dict(self.failures),
            "failures": [f.to_dict() for f in self.findings.values()], "errors": self.errors,
            "warnings": self.warnings, "shard": list(o.shard), "chunks_run": sorted(self.chunks_run),
            "specs": self.specs_dict(), "oom_retries": self.oom_retries,
            # the warmup phase: null when there was none; warm true when a marker said this
            # machine had done it (nothing ran), false when it ran here
            "warm": None if w is None else w["warm"], "warmup_s": None if w is None else w["seconds"],
            "warmup_scenarios": None if w is None else w["scenarios"], "warmup": w,
            "clock": "every time (elapsed_s, found_at_s, reduced_at_s, the budget) counts from the command's start: "
                     "imports, worker start-up and the warmup phase included",
        }


def shrink_seconds(budget_s: float | None) -> float | None:
    """Hypothesis' wall-clock bound on shrinking one failure: a quarter of the budget,
    between 5 s and 60 s; its own default (300 s) without a budget."""
    return None if budget_s is None else max(5.0, min(60.0, budget_s / 4))


def merge_coverage(into: dict, cov: dict) -> None:
    """Add ``cov`` (key -> {value: count}) into ``into`` (maxima for ``MAX_KEYS``)."""
    for key, values in (cov or {}).items():
        for v, n in values.items():
            add_note(into, key, v, int(n))


def _size(repro: dict) -> tuple:
    steps = repro["steps"]
    return (len(steps), sum(len(s["batch"]["seq_lens"]) for s in steps))


def clean_stale_temps(corpus: Path, older_than_s: float = 60.0) -> None:
    """Remove temp files a killed writer left in the corpus (``write_repro`` names them
    ``.tmp-*``); young ones may belong to a campaign writing right now."""
    if not corpus.is_dir():
        return
    now = time.time()
    for p in corpus.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                p.unlink()
        except OSError:
            pass


class _Live:
    """Counters of a running fuzz chunk, from its step messages (reports come at the end)."""

    __slots__ = ("examples", "steps", "coverage", "spec")

    def __init__(self, spec: str | None = None):
        self.examples = 0
        self.steps = 0
        self.spec = spec
        self.coverage: dict = {}  # merged only when the chunk dies before its report

    def note(self, notes) -> None:
        for key, value in notes:
            add_note(self.coverage, key, value)

    def declined(self, cfg) -> None:
        """The scenario last announced was declined by the backend: not a searched example."""
        self.examples -= 1
        if cfg is not None:
            withdraw_notes(self.coverage, scenario_coverage(cfg))


class CampaignRun:
    """Drives one campaign; ``run()`` returns the ``CampaignResult``.

    ``display`` (optional) gets ``update(result, live_examples, live_steps)`` about four
    times a second (the live counts are those of chunks still running) and ``note(text)``
    for events worth a line (a new failure and its repro path).
    """

    def __init__(self, opts: CampaignOptions, display=None, log_dir: str | None = None):
        self.opts = opts
        self.display = display
        self.result = CampaignResult(opts, workers=len(opts.worker_envs))
        self._log_dir = log_dir
        self._next_chunk = opts.shard[0]
        self._dispatched = 0
        # examples this campaign dispatches (its shard's share of ``--examples``)
        self._quota = opts.examples
        if opts.examples is not None and opts.shard[1] > 1:
            self._quota = sum(n for _, n in shard_chunks(opts.examples, opts.chunk, opts.shard))
            if self._quota == 0:
                i, n = opts.shard
                self.result.warnings.append(
                    f"shard {i}/{n} has no chunks to run: --examples {opts.examples} in chunks of {opts.chunk} "
                    f"make {-(-opts.examples // opts.chunk)} chunk(s), fewer than the {n} shards")
        self._live: dict[str, _Live] = {}
        # task id -> its first sight: {"at", "examples", "key", "sig" (the finding it made, or None)}
        self._sights: dict[str, dict] = {}
        self._reducers: dict[str, StepReducer] = {}   # signature -> reducer
        self._reducing: dict[str, str] = {}           # task id -> signature
        self._known: set[str] = set()                 # failure keys found so far (oracles.failure_key)
        self._throttle = OomThrottle()                # tasks that ran out of GPU memory, run again
        self._stopping = False
        self._hard = False
        self._stop_sent = False
        self._blind = 0
        self._t0 = 0.0

    # -- public --------------------------------------------------------------------------
    def interrupt(self) -> None:
        """First call: stop at the next step of every chunk and keep what was found; second
        call: kill the workers now."""
        if self._stopping and self.result.interrupted:
            self._hard = True
        self._stopping = True
        self.result.interrupted = True
        self.result.state = "stopping (Ctrl-C again to kill the workers)"

    def run(self, handle_sigint: bool = True) -> CampaignResult:
        opts = self.opts
        opts.corpus = Path(opts.corpus)
        clean_stale_temps(opts.corpus)
        tmp = None
        if self._log_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="mla-fuzz-workers-")
            self._log_dir = tmp.name
        envs, daemon = opts.worker_envs, None
        if opts.mps and opts.mps_daemons is not None:
            envs = [opts.mps_daemons.client_env(e) for e in envs]
        elif opts.mps:
            from .mps import MpsDaemons
            daemon = MpsDaemons.for_envs(envs).start()  # MpsError (a ValueError) if one cannot start
            envs = [daemon.client_env(e) for e in envs]
        pool = Pool(envs, self._log_dir, case_timeout=opts.case_timeout)
        old_handler = None
        if handle_sigint and threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, lambda *_: self.interrupt())
        self._t0 = time.monotonic()
        if opts.started_at is not None:
            # the clock counts from the command's start (process start of ``mla-fuzz run``)
            self.result.setup_s = max(0.0, time.time() - opts.started_at)
            self._t0 -= self.result.setup_s
            self.result.started = opts.started_at
        try:
            pool.start()
            self.result.launcher = pool.launcher
            self.result.state = "starting workers"
            if opts.warmup is not None:
                self._warmup(pool)
            self._loop(pool)
        finally:
            pool.close(kill=self._hard or self.result.interrupted)
            self.result.elapsed = time.monotonic() - self._t0
            if daemon is not None:
                daemon.stop()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            self.result.restarts = pool.restarts
            self._absorb_live()
            self.result.state = "interrupted" if self.result.interrupted else "done"
            if tmp is not None:
                tmp.cleanup()
        if opts.mps:
            self._confirm_process_failures()
        return self.result

    def _confirm_process_failures(self) -> None:
        """Under MPS a fatal GPU fault in one worker also ends the other workers on that GPU,
        so a worker's death does not prove that *its* step crashed. Each crash/hang repro
        found under MPS is replayed alone, in a worker without MPS: kept when it still
        dies (or hangs), else moved to ``<corpus>/unconfirmed/`` with a warning."""
        from .crash_repro import PROCESS_ORACLES
        from .replaying import replay_isolated

        for sig, f in list(self.result.findings.items()):
            if f.cls not in ("crash", "hang"):
                continue
            if self.result.interrupted:
                self.result.warnings.append(f"{f.path}: found under MPS, not confirmed (interrupted)")
                continue
            self.result.state = f"confirming {f.cls} repro without MPS"
            try:
                out = replay_isolated(f.repro, None, self.opts.graph, self.opts.worker_envs[0],
                                      self.opts.case_timeout)
            except (RuntimeError, ValueError) as exc:
                self.result.warnings.append(f"{f.path}: found under MPS, could not be confirmed: {exc}")
                continue
            if out.failed and out.oracle in PROCESS_ORACLES:
                continue
            moved = None
            if f.path is not None and f.path.exists():
                dest = f.path.parent / "unconfirmed"
                dest.mkdir(parents=True, exist_ok=True)
                moved = dest / f.path.name
                os.replace(f.path, moved)
            del self.result.findings[sig]
            self.result.failures[f.cls] -= f.count
            if self.result.failures[f.cls] <= 0:
                del self.result.failures[f.cls]
            self.result.warnings.append(
                f"a worker {'died' if f.cls == 'crash' else 'hung'} under MPS in a scenario that passes when replayed "
                f"alone without MPS: most likely another worker's GPU fault ended it (MPS shares faults among the "
                f"processes on a GPU); its repro is kept in {moved}")

    def _warmup(self, pool: Pool) -> None:
        """The warmup phase (``harness.warmup``) on the campaign's workers, before any chunk:
        skipped when every spec's marker is there; stopped by the budget or Ctrl-C (its running
        scenarios are ended: nothing is lost, they find nothing)."""
        from .warmup import WorkerFatal, run_warmup, skipped, summary_line

        plan = self.opts.warmup
        if plan.warm:
            self.result.warmup = skipped(plan)
            self._note(summary_line(self.result.warmup))
            return
        n = sum(len(s.scenarios) for s in plan.todo)
        self.result.state = f"warmup 0/{n} scenarios"
        self._note(f"{self._elapsed():.1f}s: warmup: compiling the kernel variants of {n} scenario(s) "
                   f"({plan.describe()}) on {len(pool.workers)} worker(s) into {plan.cache_dir} "
                   f"(--no-warmup skips it; `mla-fuzz warmup` does it ahead)")
        last = [0.0]

        def tick(done: int, total: int) -> None:
            if self.result.startup_s is None and any(w.ready for w in pool.workers):
                self.result.startup_s = self._elapsed()
            self.result.state = f"warmup {done}/{total} scenarios"
            now = time.monotonic()
            if self.display is not None and now - last[0] >= 0.25:
                last[0] = now
                self._draw()

        def stop() -> bool:
            # a budget leaves the search at least its other half: a cold warmup on a short
            # budget would otherwise search nothing (what it does not run compiles on the way)
            b = self.opts.budget_s
            return self._stopping or (b is not None and self._elapsed() >= WARMUP_SHARE * b)

        def kill() -> bool:
            left = self._time_left()
            return self._hard or self.result.interrupted or (left is not None and left < -STOP_GRACE_S)

        def start_chunk(w) -> bool:
            # once every scenario has a worker, idle ones start the search (its first chunks
            # run beside the warmup's last scenarios instead of after them)
            return self._start_one(pool, w)

        def on_event(ev) -> None:
            self._event(ev, pool)
            if self.result.error_kind is not None:
                self._hard = True

        try:
            out = run_warmup(plan, pool, note=self._note, on_tick=tick, stop=stop, kill=kill, on_idle=start_chunk,
                             on_event=on_event)
        except WorkerFatal as exc:
            self.result.errors.append(str(exc))
            self.result.error_kind = "internal"
            self._hard = True
            return
        self.result.warmup = out
        self.result.warnings += ["warmup: " + w for w in out.warnings]
        if not out.completed and not self.result.interrupted and not self._hard:
            # only the budget's half (``stop``) ends a warmup early here; an error ends the campaign
            self.result.warnings.append(
                f"warmup: stopped at half the budget after {out.ran} of {out.planned} scenarios, so the search has "
                f"the rest; what it did not run compiles on the way (run `mla-fuzz warmup` once to pay it ahead)")
        self.result.state = "running" if any(w.ready for w in pool.workers) else "starting workers"
        self._note(f"{self._elapsed():.1f}s: " + summary_line(out, len(pool.workers)))

    # -- loop ----------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    def _time_left(self) -> float | None:
        b = self.opts.budget_s
        return None if b is None else b - self._elapsed()

    def _chunks_left(self) -> bool:
        if self._stopping:
            return False
        left = self._time_left()
        if left is not None and left <= 0.2:
            return False
        return self._quota is None or self._dispatched < self._quota

    def _reduce_allowed(self) -> bool:
        if self._stopping and self.result.interrupted:
            return False
        left = self._time_left()
        return left is None or left > -REDUCE_GRACE_S

    def _next_task(self) -> dict | None:
        opts = self.opts
        if self._reduce_allowed():
            for sig, red in self._reducers.items():
                if sig in self._reducing.values():
                    continue
                cand = red.candidate()
                if cand is None:
                    continue
                tid = f"r{len(self._reducing)}-{red.tries}-{time.monotonic_ns()}"
                self._reducing[tid] = sig
                f = self.result.findings[sig]
                return {"op": "replay", "id": tid, "backend": f.repro["backend"], "graph": opts.graph,
                        "config": f.repro["config"], "steps": cand, "diagnose": False}
        if not self._chunks_left():
            return None
        k = self._next_chunk
        if opts.examples is None:
            n = opts.chunk
        elif opts.shard[1] == 1:
            n = min(opts.chunk, opts.examples - self._dispatched)
        else:
            # chunk k gets what the unsharded campaign gives it; past those (examples a dead
            # chunk never ran came back), further chunks of this shard take the rest
            planned = opts.examples - k * opts.chunk
            n = min(opts.chunk, self._quota - self._dispatched, *([planned] if planned > 0 else []))
        self._next_chunk += opts.shard[1]
        self._dispatched += n
        tid = f"c{k}"
        spec = chunk_spec(opts.specs, k)
        self._live[tid] = _Live(spec)
        seed = chunk_seed(opts.seed, k)
        self.result.chunks_run.append([k, seed])
        return {"op": "fuzz", "id": tid, "backend": opts.backend, "graph": opts.graph, "spec": spec,
                "examples": n, "seed": seed, "budget_s": self._time_left(), "shrink": True,
                "shrink_seconds": shrink_seconds(opts.budget_s), "chunk": k, "narrow": opts.narrow,
                "strict_contiguity": opts.strict_contiguity, "known": sorted(self._known),
                "max_seq_len": opts.max_seq_len}

    def _start_one(self, pool: Pool, w) -> bool:
        """Give the idle worker ``w`` its next task (one that ran out of memory first), if one
        may start now."""
        if self._hard or not self._throttle.allows(pool.running):
            return False
        task = self._retry_task(pool.running) or self._next_task()
        if task is None:
            return False
        pool.submit(w, task)
        return True

    def _retry_task(self, running: int) -> dict | None:
        """A task that ran out of GPU memory, to run again now (``harness.throttle``): a chunk
        (its examples already counted against the quota) with the budget left now and the
        failures known now, while the budget lasts; a reduction replay while reductions may.
        Past those, it is dropped with a warning."""
        while True:
            task = self._throttle.next_retry(running)
            if task is None:
                return None
            left = self._time_left()
            if task["op"] == "fuzz" and not self._stopping and (left is None or left > 0.2):
                self._live[task["id"]] = _Live(task.get("spec"))
                own = (self._sights.get(task["id"]) or {}).get("key")
                return dict(task, budget_s=left, known=sorted(k for k in self._known if k != own))
            if task["op"] == "replay" and task["id"] in self._reducing and self._reduce_allowed():
                return task
            if task["op"] == "fuzz":
                self.result.warnings.append(f"chunk {task.get('chunk')} (seed {task.get('seed')}) ran out of GPU "
                                            f"memory and the budget ended before it could run again")
            self._reducing.pop(task["id"], None)

    def _work_left(self) -> bool:
        if self._throttle.retry:
            return True
        if self._chunks_left():
            return True
        return self._reduce_allowed() and any(r.candidate() is not None for s, r in self._reducers.items()
                                              if s not in self._reducing.values())

    def _loop(self, pool: Pool) -> None:
        last_draw = 0.0
        while not self._hard:
            if not self._stopping and self._time_left() is not None and self._time_left() <= 0:
                self._stopping = True
                self.result.state = "finishing"
            left = self._time_left()
            overdue = left is not None and left < -STOP_GRACE_S
            if (self.result.interrupted or overdue) and not self._stop_sent:
                # fuzz() checks its budget between scenarios only; a slow scenario (the
                # interpreter, a big spec) is cut at its next step instead.
                self._stop_sent = True
                pool.request_stop()
                if self.result.interrupted:
                    # Reductions re-run failures already on disk: nothing to lose by ending them.
                    pool.kill_busy(lambda task: task.get("op") == "replay")
            for w in pool.idle():
                if not self._start_one(pool, w):
                    break
            if not pool.busy and not self._work_left():
                break
            for ev in pool.poll(0.25):
                self._event(ev, pool)
                if self.result.error_kind is not None:
                    self._hard = True
            if self.result.state == "starting workers" and any(w.ready for w in pool.workers):
                self.result.state = "running"
                self.result.startup_s = self._elapsed()
            now = time.monotonic()
            if self.display is not None and now - last_draw >= 0.25:
                last_draw = now
                self._draw()
        self._draw()

    def _draw(self) -> None:
        if self.display is None:
            return
        self.result.elapsed = self._elapsed()
        live_e = sum(v.examples for v in self._live.values())
        live_s = sum(v.steps for v in self._live.values())
        self.display.update(self.result, live_e, live_s)

    def _absorb_live(self) -> None:
        """Chunks that never reported (killed, interrupted) still count what they ran."""
        for v in self._live.values():
            self.result.examples += v.examples
            self.result.steps += v.steps
            self.result.count_spec(v.spec, v.examples, v.steps)
            merge_coverage(self.result.coverage, v.coverage)
        self._live.clear()

    # -- events --------------------------------------------------------------------------
    def _event(self, ev, pool: Pool) -> None:
        task = ev.task or {}
        tid = task.get("id")
        if ev.kind == "fatal":
            self.result.errors.append(f"worker {ev.slot} could not start: {ev.msg.get('error')}"
                                      + _tail_text(ev.msg.get("log_tail")))
            self.result.error_kind = "internal"
            return
        if ev.kind == "step":
            live = self._live.get(tid)
            if live is not None and not ev.msg.get("shrinking"):
                # an empty step list announces a new scenario (see fuzz's on_step)
                try:
                    cfg = ScenarioConfig.from_dict(ev.msg["cfg"])
                except (KeyError, TypeError, ValueError):
                    cfg = None
                if ev.msg.get("declined"):
                    live.declined(cfg)
                elif ev.msg.get("steps"):
                    live.steps += 1
                    if cfg is not None:
                        live.note(step_coverage(cfg, ev.msg["steps"][-1]))
                else:
                    live.examples += 1
                    if cfg is not None:
                        live.note(scenario_coverage(cfg))
            return
        if ev.kind == "found":
            self._sighted(tid, ev.msg)
            return
        if self._throttle.retries(ev):
            # Not a finding: the chunk runs again with fewer tasks beside it, and counts its
            # cases then (same seed, same cases). A failure it had sighted keeps its unshrunk
            # finding and the chunk's sight, so the rerun (told every known failure but that
            # one) finds, shrinks and diagnoses it, and finishes that finding.
            self._live.pop(tid, None)
            line = self._throttle.ran_out(task, pool.running + 1) + f": {ev.msg.get('error')}"
            self.result.oom_retries += 1
            self._note("notice: " + line)
            return
        if ev.kind == "error":
            self._live.pop(tid, None)
            self._sights.pop(tid, None)  # a finding it made keeps its unshrunk repro
            self._reducing.pop(tid, None)
            self.result.errors.append(f"{ev.msg.get('error')}" + (
                "" if ev.msg.get("kind") == "input" else "\n" + (ev.msg.get("traceback") or "")))
            self.result.error_kind = ev.msg.get("kind") or "internal"
            return
        if ev.kind == "done":
            if tid in self._reducing:
                self._reduced(self._reducing.pop(tid), False)
                return
            self._live.pop(tid, None)
            rep = ev.msg["report"]
            self.result.chunks += 1
            self.result.examples += int(rep.get("examples") or 0)
            self.result.steps += int(rep.get("steps") or 0)
            self.result.count_spec(task.get("spec"), rep.get("examples") or 0, rep.get("steps") or 0, 1)
            self.result.shrink_runs += int(rep.get("shrink_runs") or 0)
            self.result.shrink_s += float(rep.get("shrink_seconds") or 0.0)
            self.result.diagnose_s += float(rep.get("diagnose_seconds") or 0.0)
            merge_coverage(self.result.coverage, rep.get("coverage"))
            self.result.unsupported.update(rep.get("unsupported") or {})
            if rep.get("capabilities") and self.result.capabilities is None:
                self.result.capabilities = rep["capabilities"]
            if rep.get("lost"):
                self.result.warnings.append(
                    f"chunk {task.get('chunk')} (seed {task.get('seed')}) was ended by the budget or a stop while "
                    f"Hypothesis was shrinking a failure, which is lost ({rep['lost']}); a longer --budget or "
                    f"--examples finds it again")
                if self.display is not None:
                    self.display.note("warning: " + self.result.warnings[-1])
            if rep.get("repro") is not None:
                self._found(rep["repro"], rep.get("examples_to_detect"), tid)
            elif tid in self._sights:
                sight = self._sights.pop(tid)
                f = self.result.findings.get(sight.get("sig"))
                if f is not None and not f.shrunk:
                    self.result.warnings.append(
                        f"chunk {task.get('chunk')} (seed {task.get('seed')}) ended without a shrunk repro of the "
                        f"failure it found at {sight['at']:.1f}s; the unshrunk repro is kept: {f.path}")
            return
        if ev.kind in ("died", "hung"):
            self._process_failure(ev, task)

    def _process_failure(self, ev, task: dict) -> None:
        tid = task.get("id")
        if tid in self._reducing:
            sig = self._reducing.pop(tid)
            if self.result.interrupted:
                return  # killed by the interrupt, not by the candidate
            want = self.result.findings[sig].cls
            self._reduced(sig, (ev.kind == "died" and want == "crash") or (ev.kind == "hung" and want == "hang"))
            return
        live = self._live.pop(tid, None)
        if live is not None:
            self.result.examples += live.examples
            self.result.steps += live.steps
            self.result.count_spec(live.spec, live.examples, live.steps, 1)
            merge_coverage(self.result.coverage, live.coverage)
            self.result.chunks += 1
            if self.opts.examples is not None:
                # The examples the dead chunk never ran go back to be dispatched (new seed).
                self._dispatched -= max(0, int(task.get("examples", 0)) - live.examples)
        search = {"seed": task.get("seed"), "chunk": task.get("chunk"), "campaign_seed": self.opts.seed,
                  "worker": ev.slot, "case_timeout_s": self.opts.case_timeout}
        repro = crash_repro(ev.kind, self.opts.backend, self.opts.graph, ev.msg, search, self.opts.case_timeout)
        if repro is None:
            self._blind += 1
            self.result.failures["crash" if ev.kind == "died" else "hang"] += 1
            self.result.errors.append(f"worker {ev.slot} {exit_text(ev.msg.get('returncode'))} before its first "
                                      f"step (no scenario to replay)" + _tail_text(ev.msg.get("log_tail")))
            if self._blind >= MAX_BLIND_DEATHS:
                self.result.errors.append(f"{MAX_BLIND_DEATHS} workers in a row died before running a step; "
                                          "giving up")
                self.result.error_kind = "internal"
            return
        self._blind = 0
        # a death while diagnosing the chunk's failure finishes the finding its first sight made
        new = self._found(repro, None, tid)
        # under MPS a candidate's "death" may be a neighbour's fault: no reduction there
        if new and self.opts.reduce and not self.opts.mps and len(repro["steps"]) > 1:
            self._reducers[signature(repro)] = StepReducer(repro["steps"])

    def _note(self, text: str) -> None:
        if self.display is not None:
            self.display.note(text)

    def _sighted(self, tid: str, msg: dict) -> None:
        """A chunk's first failure, as seen, before shrinking: a finding with its unshrunk
        repro written now, unless the same failure (key) is already reported."""
        repro = msg.get("repro")
        if not isinstance(repro, dict) or not repro.get("steps"):
            return
        fail = repro.get("failure") or {}
        key = _key(repro)
        if (self._sights.get(tid) or {}).get("key") == key:
            return  # a chunk run again (out of GPU memory) seeing its failure again: the first sight stands
        at = self._elapsed()
        examples = self.result.examples + sum(v.examples for v in self._live.values())
        sight = {"at": at, "examples": examples, "key": key, "sig": None}
        self._sights[tid] = sight
        self._known.add(key)  # chunks started from now on search past it
        if any(_key(f.repro) == key for f in self.result.findings.values()):
            return
        sig = signature(repro)
        path = write_repro(repro, self.opts.corpus)
        self.result.findings[sig] = Finding(sig, UNDIAGNOSED, fail.get("oracle", "?"), fail.get("message", ""), path,
                                            repro, found_at_s=at, examples_to_detect=examples, shrunk=False)
        self.result.failures[UNDIAGNOSED] += 1
        sight["sig"] = sig
        self._note(f"{at:.1f}s: FOUND {fail.get('oracle')} failure at example {examples} (unshrunk, shrinking...): "
                   f"{_short(fail.get('message', ''), 100)} -> {path}")

    def _uncount(self, cls: str, n: int = 1) -> None:
        self.result.failures[cls] -= n
        if self.result.failures[cls] <= 0:
            del self.result.failures[cls]

    def _found(self, repro: dict, examples_to_detect, tid: str | None = None) -> bool:
        """Record a failure; write its repro if its signature is new (or it is smaller than
        the one already written this campaign). True when the signature is new.

        The finding a first sight made for this failure (``_sighted``: same failure key, its
        repro unshrunk) is finished by the first repro of that key to arrive, from task
        ``tid`` or another chunk: same entry, first-sight time, the shrunk repro replacing
        the unshrunk file. Each chunk's sighting counts once, whichever repro finishes it."""
        sig = signature(repro)
        cls = (repro.get("diagnosis") or {}).get("cls") or "unknown"
        key = _key(repro)
        fail = repro.get("failure") or {}
        now = self._elapsed()
        sight = self._sights.pop(tid, None) if tid is not None else None
        if sight is not None and sight["key"] != key:
            sight = None  # another failure (the worker died shrinking): its first sight stays unshrunk
        at = now if sight is None else sight["at"]
        examples = examples_to_detect if sight is None else sight["examples"]
        # 1 for this repro's own occurrence, unless its sighting was already counted (below)
        count = 0 if sight is not None and sight.get("counted") else 1
        self._known.add(key)  # later chunks search past it
        first = next((f for f in self.result.findings.values() if not f.shrunk and _key(f.repro) == key), None)
        if first is not None:
            self._uncount(UNDIAGNOSED)
            if sight is None or sight.get("sig") != first.signature:
                # another chunk's sighting: counted here; that chunk's own repro will not count it again
                count += 1
                for other in self._sights.values():
                    if other.get("sig") == first.signature:
                        other["counted"], other["sig"] = True, None
            if first.found_at_s < at:
                at, examples = first.found_at_s, first.examples_to_detect
        self.result.failures[cls] += count
        old = self.result.findings.get(sig)
        if first is not None and old is None:
            # the first sight's entry becomes this signature's finding, in its place
            self.result.findings = {(sig if k == first.signature else k): v for k, v in self.result.findings.items()}
            first.signature, first.cls, first.oracle = sig, cls, fail.get("oracle", first.oracle)
            first.count, first.found_at_s, first.examples_to_detect = count, at, examples
            if len(repro["steps"]) < len(first.repro["steps"]):
                first.reduced_from = len(first.repro["steps"])
            first.shrunk, first.reduced_at_s = True, now
            self._replace(first, repro, how="shrunk and diagnosed")
            return True
        if first is not None:
            # this signature is already reported: its entry absorbs the first sight
            del self.result.findings[first.signature]
            self._drop(first, old)
        if old is not None:
            old.count += count
            if at < old.found_at_s:
                old.found_at_s, old.examples_to_detect = at, examples
            if _size(repro) < _size(old.repro):
                self._replace(old, repro)
            return False
        path = write_repro(repro, self.opts.corpus)
        self.result.findings[sig] = Finding(sig, cls, fail.get("oracle", "?"), fail.get("message", ""), path, repro,
                                            count=max(count, 1), found_at_s=at, examples_to_detect=examples,
                                            reduced_at_s=now)
        if count == 0:
            self.result.failures[cls] += 1
        self._note(f"{cls}: [{fail.get('oracle')}] {_short(fail.get('message', ''))} -> {path}")
        return True

    def _drop(self, first: Finding, into: Finding) -> None:
        """Remove the unshrunk repro of a first sight that turned out to be a failure already
        reported; the line that named its file says where that failure is."""
        if first.path is not None and first.path != into.path:
            try:
                first.path.unlink()
            except OSError:
                pass
            self._note(f"{into.cls}: the unshrunk {first.path} was replaced: the same failure is {into.path}")

    def _replace(self, finding: Finding, repro: dict, how: str = "smaller") -> None:
        """Swap in a smaller (or the shrunk, diagnosed) repro of the same failure: the new file
        is complete before the old one goes, so the corpus always holds one of them."""
        path = write_repro(repro, self.opts.corpus)
        old = finding.path
        if old is not None and old != path:
            try:
                old.unlink()
            except OSError:
                pass
        finding.path = path
        finding.repro = repro
        finding.message = (repro.get("failure") or {}).get("message", finding.message)
        if how == "smaller":
            if old is not None and old != path:  # the line that named the old file must not mislead
                self._note(f"{finding.cls}: {old} replaced by a smaller repro -> {path}")
            return
        steps = len(repro["steps"])
        was = "" if finding.reduced_from is None else f" (from {finding.reduced_from})"
        self._note(f"{self._elapsed():.1f}s: {finding.cls}: [{finding.oracle}] {_short(finding.message, 100)} -> "
                   f"{path} ({how}: {steps} step(s){was}; replaces the unshrunk {old})")

    def _reduced(self, sig: str, reproduced: bool) -> None:
        red = self._reducers[sig]
        finding = self.result.findings[sig]
        before = len(red.best)
        red.result(reproduced)
        if reproduced and len(red.best) < before:
            repro = dict(finding.repro)
            repro["steps"] = red.best
            repro["failure"] = dict(repro["failure"], step=len(red.best) - 1)
            msg = repro["failure"].get("message", "")
            repro["failure"]["message"] = msg.replace(f"step {before - 1} (", f"step {len(red.best) - 1} (", 1)
            repro["diagnosis"] = dict(repro["diagnosis"], explanation=repro["diagnosis"]["explanation"].replace(
                f"step {before - 1} (", f"step {len(red.best) - 1} (", 1))
            if finding.reduced_from is None:
                finding.reduced_from = len(finding.repro["steps"])
            self._replace(finding, repro)


def _key(repro: dict) -> str:
    """The failure key of a repro (``oracles.failure_key``; the oracle for older repros)."""
    f = repro.get("failure") or {}
    return f.get("key") or f.get("oracle") or "?"


def _short(text: str, n: int = 140) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _tail_text(lines) -> str:
    lines = [ln for ln in (lines or []) if ln.strip()]
    return "" if not lines else "\n  worker log:\n    " + "\n    ".join(lines[-12:])
