"""Pay compilation once: the warmup phase (issue #44, item 1).

On a GPU most of a fresh campaign's first minute is Triton compiling kernel variants, and
every worker process compiled the same variants again on its own. The warmup runs a fixed,
deterministic list of small scenarios (``plan_scenarios``) once per machine, split across
the campaign's worker processes (one scenario a task, to whichever worker is idle), so each
variant is compiled about once, into Triton's on-disk cache (``TRITON_CACHE_DIR``, else
Triton's default ``~/.triton/cache``) that every later worker process reads.

Generic, for any backend: the scenarios are ordinary ``ScenarioConfig`` + steps run by
``executor.ScenarioRunner`` (the worker's ``warmup`` task), spanning what the search draws
inside the backend's declared capabilities (``loading.effective_capabilities``, narrowed by
the user): each KV dtype with its query dtype, each head count the spec varies, next_n 1 and
the largest (every next_n where the spec has one head count), each data path
(``strategies.PATHS``, sparse with and without the device indexer), each page size, short and
long scenarios (long rows make split kernels run), two capture sizes with replays at both (and
a middle length where the short and long ones leave a
class of Triton's integer specialization unreached, ``dimensions``). Their product is far too
large, so the list covers every *pair* of values of any two of those dimensions
(``pairwise``): about 50 scenarios at tiny size on a GPU, 20 at DeepSeek-V3 size. Each scenario captures after an eager warm-up forward on the
capture's own build, replays long, full, padded and one-row batches, and runs a padded eager
forward; a ragged-MTP backend also replays with one query token where ``next_n`` is larger.

A failure during the warmup is not a finding: it is a warning naming the scenario, and the
warmup goes on (the campaign searches it properly). When every scenario of a spec has run,
a marker (JSON) is written in the cache folder, keyed by the backend reference, the spec,
the graph mode, the device, the torch / triton / CUDA versions, a hash of the backend's and
our kernels' source files and a hash of the scenario list itself (so a narrowing or another
``--max-seq-len`` is another key): the next warmup on this machine finds it and has nothing
to do.
"""
from __future__ import annotations

import glob
import hashlib
import inspect
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the marker files' folder inside Triton's cache folder, and their format
MARKER_DIR = "mla-fuzz-warmup"
FORMAT = "mla-fuzz-warmup/1"
REPORT_FORMAT = "mla-fuzz-warmup-report/1"
#: the capture sizes of every warmup scenario: one row, and the largest the search draws
#: (``strategies.CAPTURE_POOL``): padded batches, both planner shapes, the Hopper kernels'
#: small-batch and many-block routes
SMALL, BIG = 1, 8
#: at most this many source files of a third-party backend's package are hashed into the key
MAX_SOURCE_FILES = 400


# --------------------------------------------------------------------------- the scenarios

@dataclass(frozen=True)
class WarmupScenario:
    """One scenario of the list: its spec name, a readable name, the config and the steps (JSON)."""

    spec: str
    name: str
    config: dict
    steps: list


def pairwise(sizes: list[int]) -> list[tuple]:
    """Rows of value indices, one per dimension of ``sizes``, such that every pair of values
    of any two dimensions is in at least one row (greedy, deterministic; a dimension of one
    value is in every row)."""
    n = len(sizes)
    if n == 0 or any(s < 1 for s in sizes):
        return []
    if n == 1:
        return [(a,) for a in range(sizes[0])]
    uncovered = {(i, a, j, b) for i in range(n) for j in range(i + 1, n)
                 for a in range(sizes[i]) for b in range(sizes[j])}
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row = {i: a, j: b}
        for k in range(n):
            if k in row:
                continue

            def gain(v, k=k):
                return sum(((k, v, m, row[m]) if k < m else (m, row[m], k, v)) in uncovered for m in row)

            row[k] = max(range(sizes[k]), key=lambda v: (gain(v), -v))
        t = tuple(row[k] for k in range(n))
        rows.append(t)
        uncovered -= {(p, t[p], q, t[q]) for p in range(n) for q in range(p + 1, n)}
    return rows


def _device_kind(graph: str, gpu: bool) -> str:
    return "cuda" if graph == "cuda" or (graph == "eager" and gpu) else "cpu"


def dimensions(backend_cls, spec: str, device: str, narrow: dict | None = None,
               max_seq_len: int | None = None) -> tuple[list, object]:
    """``([(name, values), ...], caps)``: what the search draws for ``backend_cls`` at ``spec`` on
    ``device`` (``"cuda"`` / ``"cpu"``), as ``strategies.configs`` and ``fuzz.fuzz`` draw it.
    ValueError (one line) when the narrowing leaves nothing."""
    from mla_fuzz.mla_ref import ModelSpec

    from .fuzz import default_max_seq_len
    from .loading import effective_capabilities, supports_layer, supports_sparse
    from .strategies import FP8_FORMATS, TINY_HEADS, paths_allowed, scenario_lengths

    caps, _notes = effective_capabilities(backend_cls, narrow, cpu=device == "cpu")
    base = ModelSpec.from_name(spec)
    big = base.num_heads > 16
    # as strategies.configs: heads varied at tiny size, inside caps.heads
    heads = TINY_HEADS if not big else (base.num_heads,)
    if caps.heads is not None:
        heads = tuple(h for h in heads if h in caps.heads) or caps.heads
    dtypes = [(k, k if k not in FP8_FORMATS else ("bf16" if "bf16" in caps.q_dtypes else "fp16"))
              for k in ("bf16", "fp8", "fp16", "fp8_e4m3")
              if k in caps.kv_dtypes and (k in FP8_FORMATS or k in caps.q_dtypes)]
    if not dtypes:
        raise ValueError("no KV dtype of the backend can be read with a query dtype it takes")
    # the head count and next_n together: the query rows per request, which pick the kernel's
    # row blocks and with them the launch's integer arguments (a persistent grid's part count is
    # the SMs over the row blocks, its partial buffer twice that; the token count may be 1):
    # with one head count (DeepSeek-V3 size) every next_n, since each gives other classes of
    # those integers (at 128 heads on 132 SMs, 4 tokens give 32 partial rows, a multiple of 16,
    # and 2 or 3 give 66 or 44, neither); with head counts varied, next_n's ends already give
    # ten row counts
    if len(heads) == 1:
        next_n = tuple(sorted(set(caps.next_n)))
    else:
        next_n = tuple(dict.fromkeys((min(caps.next_n), max(caps.next_n))))
    shapes = [(h, n) for h in heads for n in next_n]
    paths = []
    for p in paths_allowed(supports_layer(backend_cls) and caps.layer, supports_sparse(backend_cls) and caps.sparse):
        paths += ["sparse", "sparse+indexer"] if p == "sparse" else [p]
    pages = (64,) if big else (4, 16, 64)
    if caps.page_sizes is not None:
        pages = tuple(p for p in pages if p in caps.page_sizes) or caps.page_sizes
    top = max_seq_len or default_max_seq_len(base, device)
    if caps.max_seq_len is not None:
        top = min(top, caps.max_seq_len)
    drawn = scenario_lengths(max(1, top))
    lengths = (drawn[0], drawn[-1])
    # Triton compiles a variant per class of each integer argument (equal to 1, a multiple
    # of 16, neither), and a block table's row stride is the pages per sequence: when both
    # ends of the range fall in the first two (1 and 512 pages at DeepSeek-V3 size, with
    # 64-token pages only), the general variant is left to the search, compiled by every
    # worker on its own. Then a middle length of that class goes in too.
    def general(n: int) -> bool:
        return n > 1 and n % 16 != 0
    if not any(general(max(1, length // p)) for length in lengths for p in pages):
        middle = [length for length in drawn[1:-1] if any(general(length // p) for p in pages)]
        lengths = (drawn[0], *middle[-1:], drawn[-1])
    lengths = tuple(dict.fromkeys(lengths))
    return [("dtype", dtypes), ("shape", shapes), ("path", paths), ("page", list(pages)),
            ("length", list(lengths))], caps


def plan_scenarios(backend_cls, spec: str, device: str, narrow: dict | None = None,
                   max_seq_len: int | None = None) -> list[WarmupScenario]:
    """The warmup scenarios of ``spec`` on ``device``: every pair of values of the dimensions
    (``dimensions``) in at least one scenario, in a fixed order. ValueError (one line) when
    the narrowing leaves nothing to draw."""
    from mla_fuzz.mla_ref import ModelSpec

    from .scenario import outside_capabilities, validate_step

    dims, caps = dimensions(backend_cls, spec, device, narrow, max_seq_len)
    base = ModelSpec.from_name(spec)
    out = []
    for i, row in enumerate(pairwise([len(v) for _, v in dims])):
        (kv, q), (heads, next_n), path, page, length = (dims[d][1][row[d]] for d in range(len(dims)))
        cfg, steps = _scenario(base, kv, q, heads, next_n, path, page, length, caps, seed=i)
        if outside_capabilities(cfg, steps, caps) is not None:
            continue  # never drawn by the search either
        for s in steps:
            validate_step(s, cfg)
        ends = dims[4][1]
        kind = "short" if length == ends[0] or len(ends) == 1 else "long" if length == ends[-1] else "middle"
        name = (f"{spec}: kv {kv} q {q}, {heads} head(s), next_n {next_n}, {path}, page {page}, "
                f"{kind} ({cfg.max_seq_len} tokens)")
        out.append(WarmupScenario(spec, name, cfg.to_dict(), steps))
    return out


def _scenario(base, kv: str, q: str, heads: int, next_n: int, path: str, page: int, length: int, caps,
              seed: int):
    """One warmup scenario: captures at ``SMALL`` and ``BIG`` (each after an eager forward on its
    own build), replays with every row long, one long row padded (poisoned) and one long row
    alone, a padded eager forward with mixed rows; ragged MTP: a replay with one query token."""
    from mla_fuzz.mla_ref import ModelSpec

    from .scenario import ScenarioConfig
    from .strategies import TOPK_TINY, WEIGHT_SEEDS, pool_for, token_budget

    spec = base if heads == base.num_heads else ModelSpec(**{**base.to_dict(), "num_heads": heads})
    pages = max(1, length // page)
    if caps.max_seq_len is not None:
        pages = max(1, min(pages, caps.max_seq_len // page))
    sizes = [SMALL, BIG]
    cfg = ScenarioConfig(spec=spec.to_dict(), kv_dtype=kv, q_dtype=q, page_size=page, next_n=next_n,
                         capture_sizes=sizes, max_pages_per_seq=pages, layer=path in ("layer", "layer+fp8_out"),
                         fp8_out=path == "layer+fp8_out", seed=seed, pool_pages=pool_for(BIG, pages * page, page),
                         weights_seed=seed % WEIGHT_SEEDS)
    if path.startswith("sparse"):
        topks = TOPK_TINY if base.num_heads <= 16 else (64, 2048)
        cfg.sparse, cfg.indexer = True, path == "sparse+indexer"
        cfg.topk = topks[-1] if length > 64 else topks[0]
    top = cfg.max_seq_len
    floor = next_n                      # every real row holds next_n query tokens
    short = min(top, max(floor, page + 1))
    each = max(floor, min(top, token_budget(cfg) // BIG))
    zero = [0] if caps.empty_rows else []

    def batch(s: int, lens: list, mdl: int = next_n) -> dict:
        d = {"seed": s, "seq_lens": lens, "q_lens": [0 if n == 0 else mdl for n in lens], "max_decode_len": mdl}
        if kv == "fp8_e4m3":
            d["k_scale"] = 0.5 if s % 2 else 1.0
        return d

    steps = [
        {"op": "capture", "size": SMALL, "batch": batch(1, [short]), "warmups": 1, "share": True},
        {"op": "capture", "size": BIG, "batch": batch(2, [short, short]), "warmups": 1, "share": True},
        {"op": "replay", "size": BIG, "batch": batch(3, [each] * BIG), "poison": False},
        {"op": "replay", "size": BIG, "batch": batch(4, [top]), "poison": True},
        {"op": "replay", "size": SMALL, "batch": batch(5, [top]), "poison": False},
        {"op": "eager", "batch": batch(6, zero + [short, top]), "pad_to": BIG, "poison": True},
    ]
    if caps.mtp == "ragged" and next_n > 1:
        steps.append({"op": "replay", "size": BIG, "batch": batch(7, [short, top], mdl=1), "poison": False})
    return cfg, steps


# --------------------------------------------------------------------------- where, and the key

def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels for the workers: ``TRITON_CACHE_DIR``, else Triton's
    own default (``~/.triton/cache``)."""
    env = os.environ.get("TRITON_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        from triton import knobs
        if knobs.cache.dir:
            return Path(knobs.cache.dir).expanduser()
    except Exception:
        pass
    try:  # Triton before the knobs
        from triton.runtime.cache import default_cache_dir
        return Path(default_cache_dir()).expanduser()
    except Exception:
        pass
    return Path.home() / ".triton" / "cache"


def device_name(gpu: bool) -> str:
    """The GPU model(s) of this machine (``NVIDIA H100 80GB HBM3``), read without initialising
    CUDA in this process (the driver's ``/proc`` files, else ``nvidia-smi``); ``cpu`` when
    the kernels run under the interpreter."""
    if not gpu:
        return "cpu"
    names = set()
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as fh:
                for line in fh:
                    if line.startswith("Model:"):
                        names.add(line.split(":", 1)[1].strip())
        except OSError:
            pass
    if not names:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20)
            names = {ln.strip() for ln in out.stdout.splitlines() if ln.strip()}
        except (OSError, subprocess.SubprocessError):
            pass
    return " + ".join(sorted(names)) or "cuda (model unknown)"


def sources_digest(backend_cls) -> str:
    """A hash of our kernels' source files (``mla_fuzz/kernels``, every ``.py``) and the
    backend's: its module's file, or every ``.py`` of its package folder (not below), plus
    the installed version of its top-level package when it has one."""
    files = []
    try:
        import mla_fuzz.kernels as k
        kdir = Path(k.__file__).parent
        files += sorted(kdir.rglob("*.py"))
    except Exception:
        kdir = None
    extra = ""
    try:
        src = inspect.getsourcefile(backend_cls)
    except (TypeError, OSError):
        src = None
    if src:
        p = Path(src)
        files += sorted(p.parent.glob("*.py"))[:MAX_SOURCE_FILES] if (p.parent / "__init__.py").exists() else [p]
    top = (getattr(backend_cls, "__module__", "") or "").split(".")[0]
    if top and top != "mla_fuzz":
        try:
            from importlib.metadata import version
            extra = f"{top}=={version(top)}"
        except Exception:
            pass
    h = hashlib.blake2b(digest_size=12)
    h.update(extra.encode())
    for f in dict.fromkeys(files):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        h.update(f"{f.parent.name}/{f.name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _versions() -> dict:
    import torch
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    return {"torch": torch.__version__, "triton": tv, "cuda": getattr(torch.version, "cuda", None)}


def plan_digest(scenarios: list[WarmupScenario]) -> str:
    data = json.dumps([[s.name, s.config, s.steps] for s in scenarios], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(data.encode(), digest_size=12).hexdigest()


# --------------------------------------------------------------------------- the plan

@dataclass
class SpecWarmup:
    """The warmup of one spec: its scenarios, its marker's key and file, and whether that
    marker was found (``warm``: nothing to do)."""

    spec: str
    scenarios: list
    key: dict
    marker: Path
    warm: bool = False
    marker_info: dict | None = None

    def to_dict(self) -> dict:
        return {"warm": self.warm, "scenarios": len(self.scenarios), "marker": str(self.marker),
                "warmed_at": (self.marker_info or {}).get("written")}


@dataclass
class WarmupPlan:
    """What the warmup phase of a command will do: per spec, run its scenarios unless its
    marker says this machine already did (``todo``)."""

    backend: str
    graph: str
    cache_dir: Path
    specs: list = field(default_factory=list)
    check_s: float = 0.0

    @property
    def todo(self) -> list:
        return [s for s in self.specs if not s.warm]

    @property
    def warm(self) -> bool:
        return not self.todo

    def tasks(self) -> list[dict]:
        """One ``warmup`` task per scenario still to run: the larger spec's first (its kernels
        take longest to compile), then in list order."""
        out = []
        order = sorted(self.todo, key=lambda s: -_heads(s.spec))
        for sw in order:
            for i, sc in enumerate(sw.scenarios):
                out.append({"op": "warmup", "id": f"w-{sw.spec}-{i}", "backend": self.backend, "graph": self.graph,
                            "spec": sw.spec, "name": sc.name, "config": sc.config, "steps": sc.steps})
        return out

    def describe(self) -> str:
        """``tiny 52 scenario(s), deepseek-v3 warm``."""
        return ", ".join(f"{s.spec} warm" if s.warm else f"{s.spec} {len(s.scenarios)} scenario(s)"
                         for s in self.specs)


def _heads(spec: str) -> int:
    from mla_fuzz.mla_ref import ModelSpec
    return ModelSpec.from_name(spec).num_heads


def prepare(backend: str, specs, graph: str, *, gpu: bool, narrow: dict | None = None,
            max_seq_len: int | None = None, force: bool = False, cache_dir: Path | None = None) -> WarmupPlan:
    """The warmup plan of ``backend`` (a reference) for ``specs`` in graph mode ``graph`` (resolved):
    the scenarios per spec and whether each spec's marker is already in the cache folder
    (``force``: ignore it). ValueError (one line) for a backend that cannot be loaded or a
    narrowing that leaves nothing."""
    from .loading import load_backend

    t0 = time.monotonic()
    cls = load_backend(backend)
    device = _device_kind(graph, gpu)
    cache = Path(cache_dir) if cache_dir is not None else triton_cache_dir()
    common = {"format": FORMAT, "backend": backend, "graph": graph, "device": device_name(device == "cuda"),
              **_versions(), "sources": sources_digest(cls)}
    plan = WarmupPlan(backend=backend, graph=graph, cache_dir=cache)
    for spec in specs:
        scenarios = plan_scenarios(cls, spec, device, narrow, max_seq_len)
        key = {**common, "spec": spec, "plan": plan_digest(scenarios), "scenarios": len(scenarios)}
        digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()
        sw = SpecWarmup(spec, scenarios, key, cache / MARKER_DIR / f"{spec}-{digest}.json")
        if not force:
            sw.marker_info = read_marker(sw.marker, key)
            sw.warm = sw.marker_info is not None
        plan.specs.append(sw)
    plan.check_s = time.monotonic() - t0
    return plan


def read_marker(path: Path, key: dict) -> dict | None:
    """The marker at ``path`` when it is one of ``key`` (None: missing, unreadable or another key)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def write_marker(sw: SpecWarmup, seconds: float, warnings: list[str]) -> None:
    """Record that ``sw``'s scenarios all ran on this machine (atomic; a folder that cannot be
    written is ignored: the next command warms up again)."""
    from .atomic import write_text_atomic
    data = {"format": FORMAT, "key": sw.key, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "scenarios": len(sw.scenarios), "seconds": round(seconds, 3), "warnings": warnings}
    try:
        sw.marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(sw.marker, json.dumps(data, indent=2) + "\n")
    except OSError:
        pass


# --------------------------------------------------------------------------- running it

class WorkerFatal(RuntimeError):
    """A worker process could not start (as in a campaign: nothing can run)."""


@dataclass
class WarmupOutcome:
    """What a warmup phase did (``to_dict`` is the report's ``warmup`` entry)."""

    plan: WarmupPlan
    ran: int = 0                 # scenarios that ran to an outcome (passed, declined, failed, crashed)
    planned: int = 0
    seconds: float = 0.0
    failed: int = 0
    unsupported: int = 0
    crashed: int = 0
    completed: bool = True       # every scenario planned ran (not stopped by the budget or Ctrl-C)
    warnings: list = field(default_factory=list)
    by_spec: dict = field(default_factory=dict)   # spec -> scenarios that ran

    @property
    def warm(self) -> bool:
        return self.planned == 0 and self.plan.warm

    def to_dict(self) -> dict:
        p = self.plan
        return {"warm": self.warm, "seconds": round(self.seconds, 3), "scenarios": self.ran, "planned": self.planned,
                "completed": self.completed, "failed": self.failed, "unsupported": self.unsupported,
                "crashed": self.crashed, "check_s": round(p.check_s, 3), "cache_dir": str(p.cache_dir),
                "backend": p.backend, "specs": {s.spec: {**s.to_dict(), "ran": self.by_spec.get(s.spec, 0)}
                                                for s in p.specs},
                "warnings": list(self.warnings)}


def _never() -> bool:
    return False


def run_warmup(plan: WarmupPlan, pool, *, note=None, on_tick=None, stop=None, kill=None, on_idle=None,
               on_event=None) -> WarmupOutcome:
    """Run ``plan``'s scenarios on ``pool`` (started; its workers idle): one task per scenario to
    whichever worker is free, so the workers compile different variants at the same time.
    ``note(text)`` gets a line for each warning, ``on_tick(done, total)`` is called about four
    times a second; ``stop()`` true: dispatch no more (running scenarios finish), ``kill()``
    true: end the running ones now. A scenario that fails, is declined, kills or hangs its
    worker is a warning, never a finding (the pool restarts a dead worker). Writes the marker
    of each spec whose scenarios all ran. ``WorkerFatal`` when a worker cannot start.

    Once every scenario has a worker, ``on_idle(worker)`` may give an idle worker other work
    (True when it did), and ``on_event(event)`` gets every event of that work, so the command's
    own tasks start during the warmup's last scenarios instead of after them."""
    from .pool import exit_text
    from .throttle import OomThrottle

    stop, kill = stop or _never, kill or _never
    tasks = plan.tasks()
    names = {t["id"]: t for t in tasks}
    out = WarmupOutcome(plan, planned=len(tasks))
    pending = list(tasks)
    done: set = set()
    killed = False
    throttle = OomThrottle()
    t0 = time.monotonic()

    def warn(text: str) -> None:
        out.warnings.append(text)
        if note is not None:
            note("warning: warmup: " + text)

    while True:
        if pending and stop():
            pending = []
        if not killed and kill():
            killed = True
            pending = []
            pool.kill_busy(lambda task: task.get("op") == "warmup")
        for w in pool.idle():
            if not throttle.allows(pool.running):
                break
            task = None if killed else throttle.next_retry(pool.running)
            if task is None:
                if not pending:
                    if not killed and on_idle is not None and on_idle(w):
                        continue
                    break
                task = pending.pop(0)
            pool.submit(w, task)
        if not pending and not any(w.busy and (w.task or {}).get("op") == "warmup" for w in pool.workers) \
                and (killed or not throttle.retry):
            break
        for ev in pool.poll(0.25):
            task = ev.task or {}
            if ev.kind == "fatal":
                tail = "\n".join(ev.msg.get("log_tail") or [])
                raise WorkerFatal(f"worker {ev.slot} could not start: {ev.msg.get('error')}"
                                  + (f"\n  worker log:\n    {tail}" if tail else ""))
            tid = task.get("id")
            if tid not in names:
                if on_event is not None and ev.kind != "ready":
                    on_event(ev)
                continue
            if ev.kind in ("ready", "step", "phase", "found"):
                continue
            sc = names[tid]
            label = sc["name"]
            if ev.kind == "done":
                res = ev.msg.get("outcome") or {}
                status = res.get("status")
                if status == "failed":
                    out.failed += 1
                    warn(f"scenario '{label}' failed: {res.get('message')} (not a finding: the campaign searches "
                         f"it and reports it properly)")
                elif status == "unsupported":
                    out.unsupported += 1
            elif throttle.retries(ev) and not killed:
                line = throttle.ran_out(task, pool.running + 1)
                if note is not None:
                    note(f"notice: warmup: {line}")
                continue
            elif ev.kind == "error":
                out.failed += 1
                warn(f"scenario '{label}' raised {ev.msg.get('error')} (not a finding)")
            elif ev.kind in ("died", "hung"):
                if killed:
                    continue  # ended by the stop, not by the scenario
                out.crashed += 1
                tail = [ln for ln in (ev.msg.get("log_tail") or []) if ln.strip()]
                what = ("hung (a step outlived the case timeout)" if ev.kind == "hung"
                        else f"killed its worker ({exit_text(ev.msg.get('returncode'))})")
                warn(f"scenario '{label}' {what}; not a finding: the campaign searches it and reports it properly"
                     + (f"; worker log: {tail[-1].strip()[:200]}" if tail else ""))
            else:
                continue
            done.add(tid)
            out.by_spec[sc["spec"]] = out.by_spec.get(sc["spec"], 0) + 1
        if on_tick is not None:
            on_tick(len(done), len(tasks))
    out.ran = len(done)
    out.seconds = time.monotonic() - t0
    out.completed = out.ran == len(tasks)
    for sw in plan.todo:
        mine = [t["id"] for t in tasks if t["spec"] == sw.spec]
        if all(t in done for t in mine):
            write_marker(sw, out.seconds, [w for w in out.warnings if f"'{sw.spec}:" in w])
    return out


def skipped(plan: WarmupPlan) -> WarmupOutcome:
    """The outcome of a phase with nothing to run (every spec warm)."""
    return WarmupOutcome(plan)


def summary_line(outcome: WarmupOutcome, workers: int | None = None) -> str:
    """``warmup: 72 scenario(s) in 41.3s on 8 worker(s), 1 warning(s); kernels in CACHE`` or
    ``warmup: warm (tiny, deepseek-v3), nothing to do; kernels in CACHE``."""
    p = outcome.plan
    if outcome.warm:
        return (f"warmup: warm ({', '.join(s.spec for s in p.specs)}: compiled by an earlier warmup on this machine), "
                f"nothing to do (checked in {p.check_s:.2f}s); kernels in {p.cache_dir}")
    on = "" if workers is None else f" on {workers} worker(s)"
    part = "" if outcome.completed else f" of {outcome.planned} (stopped early: no marker for the rest)"
    warm = [s.spec for s in p.specs if s.warm]
    return (f"warmup: {outcome.ran} scenario(s){part} in {outcome.seconds:.1f}s{on}"
            + (f", {len(outcome.warnings)} warning(s)" if outcome.warnings else "")
            + (f" ({', '.join(warm)} already warm)" if warm else "") + f"; kernels in {p.cache_dir}")
