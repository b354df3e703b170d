"""``mla-fuzz``: the command line (``run``, ``replay``, ``merge``, ``mutants``, ``bisect``, ``bench``,
``warmup``).

Exit codes: 0 nothing found (or every repro fixed); 1 failures found (a repro still
fails, a mutant escaped or the clean backend was flagged); 2 usage or input error (bad
flag, unknown backend or mutant, bad budget, missing or malformed repro file: one line
on stderr, never a traceback); 3 internal error (a worker that cannot start, a harness
bug: the traceback goes to stderr); 130 interrupted with nothing found.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

from .atomic import write_text_atomic

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
SPECS = ("tiny", "deepseek-v3")
#: ``--spec`` of ``run`` and ``warmup``: one spec, or ``both`` (interleaved chunks)
SPEC_CHOICES = SPECS + ("both",)
SPEC_HELP = ("model dimensions: tiny, deepseek-v3 or both (default: both on a GPU, interleaved chunks: tiny for "
             "speed, deepseek-v3 for the real kernels and tile shapes; tiny on CPU)")
GRAPHS = ("auto", "cuda", "emulated", "eager")
DEFAULT_BUDGET_S = 60.0
DEFAULT_CASE_TIMEOUT_S = 300.0

_IMPORTED = time.time()
# When the user started this command (epoch seconds): the process start for the console
# script, the call for an in-process ``main(argv)``; set by ``main``. Campaign times
# (``found_at_s``, the budget) and the mutants' seconds to detect count from it.
_COMMAND_START: float | None = None


def process_start() -> float:
    """Epoch time this process started (Linux ``/proc``, 10 ms ticks), so a time measured
    from it includes the interpreter's start and every import; elsewhere the time this
    module was imported."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        if 0.0 <= age <= time.time() - _IMPORTED + 3600.0:
            return time.time() - age
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORTED


def command_start() -> float:
    """``_COMMAND_START``, or now when ``main`` was not the caller."""
    return time.time() if _COMMAND_START is None else _COMMAND_START


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|h|m|s)?", re.IGNORECASE)
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2. ``prog`` names the
    (sub)command when the parser knows it."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage block and exit
        raise UsageError(message, self.prog)


def parse_duration(text: str, what: str = "--budget") -> float:
    """Seconds in ``"90"``, ``"60s"``, ``"5m"``, ``"1h30m"``, ``"1.5m"``, ``"500ms"``; UsageError otherwise."""
    s = str(text).strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if m is None:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise UsageError(f"{what}: expected a duration such as 90, 60s, 5m or 1h30m, got {text!r}")
    if total <= 0:
        raise UsageError(f"{what}: must be positive, got {text!r}")
    return total


MAX_SEQ_LEN_HELP = ("longest sequence drawn, in tokens (default per spec and device: tiny 512, deepseek-v3 256 "
                    "on CPU; tiny 4096, deepseek-v3 32768 on a GPU); never above the backend's own max_seq_len")


def _max_seq_len(args) -> int | None:
    return None if args.max_seq_len is None else _positive_int("--max-seq-len", args.max_seq_len)


def _positive_int(what: str, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"{what}: expected a positive integer, got {text!r}") from None
    if v < 1:
        raise UsageError(f"{what}: expected a positive integer, got {text!r}")
    return v


def _workers(text: str):
    return "auto" if str(text).strip().lower() == "auto" else _positive_int("--workers", text)


def _add_warmup_flags(parser, what: str = "the kernel variants the campaign reaches") -> None:
    grp = parser.add_argument_group("warmup", f"compile {what} once per machine, in parallel on the workers, "
                                    "as the first phase (default: on a GPU, unless a marker in Triton's cache "
                                    "folder says this machine already did; see `mla-fuzz warmup`)")
    ex = grp.add_mutually_exclusive_group()
    ex.add_argument("--warmup", action="store_true", help="run the warmup phase on CPU too (the interpreter "
                    "compiles nothing: for tests)")
    ex.add_argument("--no-warmup", action="store_true", help="no warmup phase: kernels compile on the way")


def _build_parser() -> _Parser:
    ap = _Parser(prog="mla-fuzz", description="Property-based fuzzer for MLA decode backends under CUDA graphs.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="fuzz campaign against a backend", description="Fuzz campaign: searches "
                         "scenarios in chunks over worker processes until the budget is spent; writes each distinct "
                         "failure as a repro file. Exit 0 nothing found, 1 failures found, 2 usage error.")
    target = run.add_argument_group("target")
    target.add_argument("--backend", default=None, metavar="REF",
                        help="'triton' (default), 'mutant:NAME' or 'package.module:Class'")
    target.add_argument("--mutant", default=None, metavar="NAME", help="shorthand for --backend mutant:NAME")
    target.add_argument("--graph", default="auto", choices=GRAPHS,
                        help="graph mode (default auto: cuda with a GPU, else emulated)")
    target.add_argument("--spec", default=None, choices=SPEC_CHOICES, help=SPEC_HELP)
    scope = run.add_argument_group("scope", "narrow what is drawn below what the backend declares "
                                   "(its `capabilities`; docs/backends.md#capabilities)")
    from . import narrowing  # (imports torch: after main() has started the workers' zygote)
    narrowing.add_arguments(scope)
    scope.add_argument("--max-seq-len", default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    scope.add_argument("--strict-contiguity", action="store_true",
                       help="flag any non-contiguous tensor a kernel gets, not only views of the metadata")
    lim = run.add_argument_group("limits")
    lim.add_argument("--budget", default=None, metavar="DURATION",
                     help=f"wall-clock budget: 90, 60s, 5m, 1h (default {DEFAULT_BUDGET_S:g}s; none when only "
                          "--examples is given)")
    lim.add_argument("--examples", default=None, metavar="N", help="stop after N examples (with --budget: "
                     "whichever comes first)")
    lim.add_argument("--case-timeout", default=None, metavar="SECONDS",
                     help=f"a step running longer is a 'hang' failure (default {DEFAULT_CASE_TIMEOUT_S:g})")
    lim.add_argument("--seed", default=None, metavar="S", help="campaign seed (default: random, printed)")
    lim.add_argument("--workers", default="1", metavar="N|auto",
                     help="worker processes: N, or auto = one per GPU (cuda) / per CPU core (emulated)")
    lim.add_argument("--chunk", default=None, metavar="N", help="examples per fuzz() call (default 100)")
    lim.add_argument("--shard", default=None, metavar="I/N",
                     help="run only chunks k with k %% N == I (0 <= I < N) of the seeded campaign, so N machines "
                          "share it; combine their reports with 'mla-fuzz merge' (default 0/1: all chunks)")
    lim.add_argument("--mps", action="store_true",
                     help="cuda: run the workers under private CUDA MPS daemons (one per GPU), so several workers share a "
                          "GPU concurrently (use with --workers N > GPUs); crash repros are then confirmed "
                          "without MPS")
    out = run.add_argument_group("output")
    out.add_argument("--corpus", default=".mla-fuzz/corpus", metavar="DIR",
                     help="where repro files go (default .mla-fuzz/corpus)")
    out.add_argument("--json", default=None, metavar="REPORT", help="write the campaign report as JSON")
    out.add_argument("--quiet", action="store_true", help="no live progress")
    out.add_argument("--no-reduce", action="store_true", help="do not reduce crash/hang repros")
    _add_warmup_flags(run)

    rep = sub.add_parser("replay", help="re-run repro files deterministically",
                         description="Re-run repro files; print the minimal steps and the diagnosis. Exit 1 if one "
                         "still fails, 0 if all pass (fixed), 2 for a missing, malformed or unsupported file.")
    rep.add_argument("files", nargs="+", metavar="FILE")
    rep.add_argument("--backend", default=None, metavar="REF", help="replay against this backend instead")
    rep.add_argument("--graph", default=None, choices=GRAPHS, help="replay in this graph mode instead")
    rep.add_argument("--isolate", action="store_true", default=None,
                     help="replay in a worker process (default only for crash/hang repros)")
    rep.add_argument("--case-timeout", default=None, metavar="SECONDS",
                     help=f"for isolated replays: a step running longer is a hang (default {DEFAULT_CASE_TIMEOUT_S:g})")
    rep.add_argument("--json", default=None, metavar="FILE", help="write the outcomes as JSON")

    mrg = sub.add_parser("merge", help="combine the reports and corpora of sharded campaigns",
                         description="Combine the --json reports of one campaign's shards (run --shard I/N): counts "
                                     "and coverage add up, failures are deduplicated by signature (the smaller repro "
                                     "wins) into one corpus. Exit 1 if any failure, 0 if none, 2 for a missing or "
                                     "malformed report or reports of different campaigns.")
    mrg.add_argument("reports", nargs="+", metavar="REPORT", help="campaign reports (mla-fuzz run --json)")
    mrg.add_argument("--corpus", required=True, metavar="DIR", help="where the merged repro files go")
    mrg.add_argument("--json", default=None, metavar="OUT", help="write the merged report as JSON")

    mut = sub.add_parser("mutants", help="mutation detection matrix",
                         description="Fuzz every mutant and the clean triton backend; one row each. Exit 1 if a "
                         "mutant escapes or the clean backend is flagged.")
    mut.add_argument("--graph", default="auto", choices=GRAPHS)
    mut.add_argument("--spec", default="tiny", choices=SPEC_CHOICES,
                     help="model dimensions: tiny (default), deepseek-v3, or both (each mutant a row at each size)")
    mut.add_argument("--examples", default="100", metavar="N", help="examples per backend (default 100)")
    mut.add_argument("--seed", default="0", metavar="S", help="seed for every row (default 0)")
    mut.add_argument("--max-seq-len", default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    mut.add_argument("--set", default="public", dest="mutant_set", choices=("public", "heldout"),
                     help="which mutants: public (harness.mutants.ALL, the default) or heldout "
                     "(harness.mutants.heldout.HELDOUT, never seen by the matrix tests)")
    mut.add_argument("--only", default=None, metavar="NAMES", help="comma-separated mutant names (of the --set)")
    mut.add_argument("--no-clean", action="store_true", help="skip the clean triton row")
    mut.add_argument("--workers", default="1", metavar="N|auto")
    mut.add_argument("--case-timeout", default=None, metavar="SECONDS")
    mut.add_argument("--corpus", default=None, metavar="DIR", help="also write each row's repro here")
    mut.add_argument("--strict", action="store_true", help="exit 1 also when a diagnosis is not an expected one")
    mut.add_argument("--mps", action="store_true",
                     help="cuda: the rows' workers share each GPU under a private CUDA MPS daemon (kernels of rows "
                     "side by side run concurrently instead of time-slicing the GPU); a row whose worker dies there "
                     "runs again without MPS (see run)")
    mut.add_argument("--json", default=None, metavar="FILE", help="write the matrix as JSON")
    _add_warmup_flags(mut, what="the clean triton backend's kernel variants, before the rows")

    wu = sub.add_parser("warmup", help="compile the kernel variants a campaign reaches, once per machine",
                        description="Run a fixed list of small scenarios spanning what the search draws for the "
                        "backend (its capabilities, narrowed by the scope flags), split across worker processes, "
                        "so Triton compiles each kernel variant once into its cache (TRITON_CACHE_DIR, else "
                        "~/.triton/cache) for every later worker; a marker there makes the next warmup, and run / "
                        "mutants on a GPU, skip it. A failure here is a warning, never a finding. Exit 0 done or "
                        "already warm, 2 usage error, 3 a worker could not start, 130 interrupted.")
    wu.add_argument("--backend", default="triton", metavar="REF",
                    help="'triton' (default), 'mutant:NAME' or 'package.module:Class'")
    wu.add_argument("--spec", default=None, choices=SPEC_CHOICES, help=SPEC_HELP)
    wu.add_argument("--graph", default="auto", choices=GRAPHS,
                    help="graph mode (default auto: cuda with a GPU, else emulated)")
    wu.add_argument("--workers", default="auto", metavar="N|auto",
                    help="worker processes sharing the scenarios (default auto: on a GPU one per CPU core, at most "
                         "8, at least one per GPU, since compiling is CPU work; on CPU one per core)")
    wscope = wu.add_argument_group("scope", "as mla-fuzz run's: a narrowed campaign reaches fewer variants")
    narrowing.add_arguments(wscope)
    wscope.add_argument("--max-seq-len", default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    wu.add_argument("--case-timeout", default=None, metavar="SECONDS",
                    help=f"a step running longer ends its scenario with a warning (default {DEFAULT_CASE_TIMEOUT_S:g})")
    wu.add_argument("--force", action="store_true", help="run the scenarios even when the marker says warm")
    wu.add_argument("--json", default=None, metavar="FILE", help="write what the warmup did as JSON")
    wu.add_argument("--quiet", action="store_true", help="no progress lines")

    sv = sub.add_parser("server", help="keep torch, triton and mla-fuzz imported between commands (opt-in)",
                        description="A background process that imports torch, torch._dynamo, triton and mla-fuzz's "
                        "own harness and kernels once and forks each later command of this environment, and its "
                        "workers, from there, so they start without those imports (docs/cli.md, 'The server'). It "
                        "never touches CUDA and never imports your backend. MLA_FUZZ_SERVER=0 makes a command ignore it. Exit 0 done, 2 usage error, 3 the "
                        "server could not start.")
    sv.add_argument("action", choices=("start", "stop", "status"),
                    help="start one for this environment (if none runs), stop it (or every one: --all), list them")
    sv.add_argument("--graph", default="auto", choices=GRAPHS,
                    help="the graph mode of the commands it is for (default auto: cuda with a GPU, else "
                         "emulated): on the CPU the workers import triton interpreted")
    sv.add_argument("--idle-minutes", default=None, metavar="M",
                    help="exit after M minutes without a command (default 30)")
    sv.add_argument("--all", action="store_true", help="with stop: every server of this user")

    from .bisect import add_bisect_parser  # stdlib-only module: cheap at parser build
    add_bisect_parser(sub)

    ben = sub.add_parser("bench", help="fuzzer throughput (cases/s) against the targets",
                         description="Time-bounded campaigns against the clean backend; cases/s per run, after an "
                         "untimed warm-up that fills Triton's kernel cache. cuda: GPUS x PER_GPU workers per run; "
                         "emulated/eager: WORKERS per run. Exit 0 when every run finished (a target not met is "
                         "reported, not an error), 1 if the clean backend was flagged, 2 usage error.")
    ben.add_argument("--backend", default="triton", metavar="REF", help="backend to fuzz (default triton)")
    ben.add_argument("--spec", default="tiny", metavar="SPECS", help="comma-separated: tiny,deepseek-v3 (default tiny)")
    ben.add_argument("--graph", default="auto", metavar="MODES",
                     help="comma-separated graph modes (default auto: cuda with a GPU, else emulated)")
    ben.add_argument("--gpus", default=None, metavar="LIST", help="cuda: GPU counts, e.g. 1,2 (default: 1 and all)")
    ben.add_argument("--per-gpu", default="1,8", metavar="LIST", help="cuda: worker processes per GPU (default 1,8)")
    ben.add_argument("--workers", default="1,auto", metavar="LIST", help="CPU modes: worker counts (default 1,auto)")
    ben.add_argument("--budget", default="30s", metavar="DURATION", help="per timed run (default 30s)")
    ben.add_argument("--warmup", default="30s", metavar="DURATION", help="untimed warm-up per spec and mode "
                     "(default 30s; 0 for none)")
    ben.add_argument("--seed", default="0", metavar="S")
    ben.add_argument("--max-seq-len", default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    ben.add_argument("--chunk", default="100", metavar="N", help="examples per fuzz() call (default 100, as run)")
    ben.add_argument("--case-timeout", default=None, metavar="SECONDS")
    ben.add_argument("--mps", action="store_true", help="cuda: workers under private CUDA MPS daemons, one per GPU (see run)")
    ben.add_argument("--corpus", default=".mla-fuzz/corpus", metavar="DIR",
                     help="where repro files of any failure go (default .mla-fuzz/corpus)")
    ben.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    return ap


# -- helpers -------------------------------------------------------------------------------
def _seed(text) -> int:
    if text is None:
        return secrets.randbelow(2**31)
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--seed: expected an integer, got {text!r}") from None


def _shard(text) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; UsageError otherwise."""
    if text is None:
        return (0, 1)
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if m is None or not int(m.group(1)) < int(m.group(2)):
        raise UsageError(f"--shard: expected I/N with 0 <= I < N (e.g. 0/8), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _case_timeout(text) -> float:
    return DEFAULT_CASE_TIMEOUT_S if text is None else parse_duration(text, "--case-timeout")


def _cuda() -> bool:
    import torch
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _use_interpreter_here(mode: str) -> None:
    """Kernels that run on CPU tensors in this process need Triton's interpreter, chosen
    before the kernels module is imported (Triton decides at decoration time)."""
    cpu = mode == "emulated" or (mode == "eager" and not _cuda()) or (mode == "cuda" and not _cuda())
    if cpu and not os.environ.get("TRITON_INTERPRET"):
        os.environ["TRITON_INTERPRET"] = "1"


def _gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible, without importing torch (its driver's device nodes)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return True
    except OSError:
        pass
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def _expected_worker_env(graph: str) -> dict:
    """The environment the command's workers will most likely have (``worker_envs``, with the
    GPU count guessed from the driver's device nodes), before torch is imported, for
    ``zygote.prestart``; a wrong guess costs only the head start (the pool then starts the
    zygote it needs)."""
    from .worker_env import worker_envs
    gpu = _gpu_present()
    mode = ("cuda" if gpu else "emulated") if graph == "auto" else graph
    return {**os.environ, **worker_envs(1, mode, device_count=int(gpu), cpu_count=1)[0]}


def _resolve_mode(graph: str) -> str:
    """``auto`` -> ``cuda`` with a GPU, else ``emulated`` (as ``harness.graphs.make_runner``).

    Decided here without building a runner: a CUDA runner would initialise CUDA in this
    process, which only supervises and should hold no GPU memory."""
    if graph == "auto":
        return "cuda" if _cuda() else "emulated"
    if graph == "cuda" and not _cuda():
        raise UsageError("--graph cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                         "use --graph emulated or auto")
    return graph


def _check_mps(mps: bool, mode: str) -> None:
    if not mps:
        return
    if mode != "cuda":
        raise UsageError(f"--mps shares GPUs between workers: it needs --graph cuda (here: {mode})")
    from .mps import CONTROL, find_control
    if find_control() is None:
        raise UsageError(f"--mps: {CONTROL} was not found (PATH, /usr/local/nvidia/bin); install the NVIDIA "
                         "driver utilities or set MLA_FUZZ_MPS_CONTROL")


def _check_backend(ref: str) -> None:
    from .loading import load_backend
    try:
        load_backend(ref)
    except (ValueError, ImportError) as exc:
        raise UsageError(f"--backend: {exc}") from None


def _check_writable_dir(flag: str, path: str) -> None:
    """Before any work: the folder exists or can be made, and takes files."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: not a writable folder")


def _check_writable_file(flag: str, path: str) -> None:
    """Before any work: ``path`` can be written (its folder exists and is writable, and it is
    not a folder), so a report is never lost after the whole budget."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def _narrow(args) -> dict:
    try:
        from . import narrowing
        return narrowing.parse(vars(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _capabilities_text(ref: str, narrow: dict, mode: str) -> tuple[str, list[str]]:
    """The effective capabilities as one line, and notices; UsageError when the narrowing
    leaves nothing to draw."""
    from .loading import effective_capabilities, load_backend
    cpu = mode == "emulated" or not _cuda()
    try:
        caps, notes = effective_capabilities(load_backend(ref), narrow, cpu=cpu)
    except ValueError as exc:
        raise UsageError(f"--backend {ref}: {exc}") from None
    return caps.describe(), notes


def write_json(path: str | os.PathLike, obj) -> Path:
    """Atomic JSON write (temp file + rename): a reader never sees half a report."""
    return write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def _print_lines(lines, stream=None) -> None:
    stream = stream or sys.stdout
    for ln in lines:
        print(ln, file=stream)
    stream.flush()


def _gpu_mode(mode: str) -> bool:
    """The kernels run on a GPU in this (resolved) graph mode."""
    return mode == "cuda" or (mode == "eager" and _cuda())


def _specs(text, mode: str) -> tuple:
    """``--spec``: ``None`` -> both specs on a GPU (interleaved), tiny on CPU (the interpreter is
    too slow for DeepSeek-V3 size to be a useful default); ``both`` -> both; else that one."""
    if text is None:
        return SPECS if _gpu_mode(mode) else ("tiny",)
    return SPECS if text == "both" else (text,)


def _warmup_plan(args, backend: str, specs, mode: str, narrow: dict, max_seq_len, force: bool = False):
    """The warmup phase of ``run`` / ``mutants`` (``harness.warmup.WarmupPlan``), or None: off with
    ``--no-warmup``, on with ``--warmup``, else on in GPU modes."""
    if getattr(args, "no_warmup", False) or not (getattr(args, "warmup", False) is True or _gpu_mode(mode)):
        return None
    from .warmup import prepare
    try:
        return prepare(backend, specs, mode, gpu=_gpu_mode(mode), narrow=narrow, max_seq_len=max_seq_len, force=force)
    except ValueError as exc:
        raise UsageError(f"warmup: {exc}") from None


# -- commands ------------------------------------------------------------------------------
def cmd_run(args) -> int:
    from .campaign import DEFAULT_CHUNK, CampaignOptions, CampaignRun, shard_chunks
    from .progress import make_progress
    from .render import summary_lines
    from .worker_env import worker_envs

    if args.backend and args.mutant:
        raise UsageError("give either --backend or --mutant, not both")
    backend = f"mutant:{args.mutant}" if args.mutant else (args.backend or "triton")
    examples = None if args.examples is None else _positive_int("--examples", args.examples)
    budget = parse_duration(args.budget) if args.budget is not None else (None if examples else DEFAULT_BUDGET_S)
    chunk = DEFAULT_CHUNK if args.chunk is None else _positive_int("--chunk", args.chunk)
    shard = _shard(args.shard)
    seed, case_timeout, workers = _seed(args.seed), _case_timeout(args.case_timeout), _workers(args.workers)
    mode = _resolve_mode(args.graph)
    specs = _specs(args.spec, mode)
    narrow = _narrow(args)
    max_seq_len = _max_seq_len(args)
    _check_writable_dir("--corpus", args.corpus)
    if args.json:
        _check_writable_file("--json", args.json)
    _check_backend(backend)
    caps_line, notes = _capabilities_text(backend, narrow, mode)
    _check_mps(args.mps, mode)
    warm = _warmup_plan(args, backend, specs, mode, narrow, max_seq_len)
    opts = CampaignOptions(backend=backend, graph=mode, spec=",".join(specs), budget_s=budget, examples=examples,
                           seed=seed, corpus=Path(args.corpus), worker_envs=worker_envs(workers, mode),
                           case_timeout=case_timeout, chunk=chunk, reduce=not args.no_reduce, mps=args.mps,
                           narrow=narrow, strict_contiguity=args.strict_contiguity, shard=shard,
                           max_seq_len=max_seq_len, started_at=command_start(), warmup=warm)
    print(f"mla-fuzz run: backend {backend}, graph {mode}, spec {opts.spec}"
          + (" (interleaved chunks)" if len(specs) > 1 else "") + f", seed {seed}, "
          + ("" if shard[1] == 1 else f"shard {shard[0]}/{shard[1]}, ")
          + f"{len(opts.worker_envs)} worker(s){' under MPS' if args.mps else ''}, "
          + ("no time limit" if budget is None else f"budget {budget:g}s")
          + ("" if examples is None else f", {examples} examples")
          + ("" if examples is None or shard[1] == 1 else
             f" ({sum(n for _, n in shard_chunks(examples, chunk, shard))} in this shard's chunks)"),
          file=sys.stderr, flush=True)
    print(f"capabilities: {caps_line}", file=sys.stderr, flush=True)
    for n in notes:
        print(n, file=sys.stderr, flush=True)
    if warm is not None:
        print(f"warmup: {warm.describe()}; kernels in {warm.cache_dir}", file=sys.stderr, flush=True)
    display = None if args.quiet else make_progress()
    try:
        if display is not None:
            with display:
                result = CampaignRun(opts, display).run()
        else:
            result = CampaignRun(opts).run()
    except ValueError as exc:  # harness.mps.MpsError: the daemon did not start
        raise UsageError(str(exc)) from None
    report = result.to_dict()
    if result.error_kind == "input":
        code = EXIT_USAGE
    elif result.error_kind is not None:
        code = EXIT_INTERNAL
    elif result.findings:
        code = EXIT_FOUND
    elif result.interrupted:
        code = EXIT_INTERRUPTED
    else:
        code = EXIT_OK
    report["exit_code"] = code
    _print_lines(summary_lines(result))
    if args.json:
        write_json(args.json, report)
        print(f"report: {args.json}")
    if result.error_kind == "input":
        print(f"mla-fuzz run: error: {result.errors[-1] if result.errors else 'bad input'}", file=sys.stderr)
    return code


def cmd_replay(args) -> int:
    from .worker_env import worker_envs
    from .render import scenario_lines
    from .repro import ReproError, load_repro
    from .replaying import replay

    case_timeout = _case_timeout(args.case_timeout)
    if args.json:
        _check_writable_file("--json", args.json)
    if args.backend:
        _check_backend(args.backend)
    code = EXIT_OK
    outcomes = []
    for path in args.files:
        try:
            data = load_repro(path)
        except ReproError as exc:
            print(f"mla-fuzz replay: error: {exc}", file=sys.stderr)
            code = EXIT_USAGE
            outcomes.append({"file": path, "error": str(exc)})
            continue
        mode = args.graph or data["graph_mode"]
        if mode == "cuda" and not _cuda():
            if args.graph == "cuda":
                raise UsageError("--graph cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                                 "use --graph emulated or auto")
            mode = "emulated"  # a repro recorded on a GPU: graph semantics kept, no GPU needed
        _use_interpreter_here(mode)
        isolate = args.isolate
        if isolate is None and "mla_fuzz.kernels" in sys.modules and _interp_mismatch(mode):
            isolate = True
        backend = args.backend or data["backend"]
        print(f"== {path}\nbackend {backend}, graph {mode}" + (" (in a worker process)" if isolate or (
            isolate is None and _is_process(data)) else ""))
        print("recorded: " + _failure_text(data.get("failure"), data.get("diagnosis")))
        if (data.get("search") or {}).get("unshrunk"):
            print("(unshrunk: the failure as first seen, before shrinking and diagnosis)")
        # the timeout the repro was recorded with (a hang's), unless --case-timeout says otherwise
        recorded = (data.get("search") or {}).get("case_timeout_s")
        timeout = case_timeout if args.case_timeout is not None or not recorded else float(recorded)
        try:
            out = replay(data, backend=args.backend, graph=mode, isolate=isolate,
                         env=worker_envs(1, mode)[0], case_timeout=timeout)
        except ValueError as exc:
            print(f"mla-fuzz replay: error: {path}: {exc}", file=sys.stderr)
            code = EXIT_USAGE
            outcomes.append({"file": path, "error": str(exc)})
            continue
        _print_lines(scenario_lines(data["config"], data["steps"], out.step if out.failed else None, out.oracle))
        if out.failed:
            print(f"STILL FAILS at step {out.step}: [{out.oracle}] {out.message}")
            if out.diagnosis:
                print(f"diagnosis: {out.diagnosis.get('cls')} -- {out.diagnosis.get('explanation')}")
            code = max(code, EXIT_FOUND)
        else:
            print(f"PASSES: no oracle fires ({out.seconds:.1f}s) -- fixed, or the failure needs the recorded backend")
        outcomes.append({"file": path, "failed": out.failed, "graph_mode": out.graph_mode, "oracle": out.oracle,
                         "step": out.step, "message": out.message, "diagnosis": out.diagnosis,
                         "isolated": out.isolated, "seconds": round(out.seconds, 3)})
    if args.json:
        write_json(args.json, {"format": "mla-fuzz-replay/1", "exit_code": code, "outcomes": outcomes})
    return code


def cmd_merge(args) -> int:
    from .merge import MergeError, merge_reports, summary_lines

    _check_writable_dir("--corpus", args.corpus)
    if args.json:
        _check_writable_file("--json", args.json)
    try:
        report = merge_reports(args.reports, Path(args.corpus))
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    _print_lines(summary_lines(report))
    if args.json:
        write_json(args.json, report)
        print(f"report: {args.json}")
    return report["exit_code"]


def _is_process(data) -> bool:
    from .crash_repro import is_process_failure
    return is_process_failure(data)


def _interp_mismatch(mode: str) -> bool:
    """True when this process imported the kernels with the wrong interpreter setting for
    ``mode`` (e.g. a cuda replay, then an emulated one on a GPU box)."""
    want_cpu = mode == "emulated" or (mode == "eager" and not _cuda())
    return want_cpu != bool(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def _failure_text(failure, diagnosis) -> str:
    f = failure or {}
    d = diagnosis or {}
    return f"[{f.get('oracle', '?')}] at step {f.get('step')}, diagnosis {d.get('cls', '?')}"


def cmd_mutants(args) -> int:
    from .worker_env import worker_envs
    from .matrix import CLEAN, load_mutants, matrix_json, row_label, run_matrix, verdict
    from .render import MATRIX_HEADERS, matrix_rows, table

    examples = _positive_int("--examples", args.examples)
    seed = _seed(args.seed)
    max_seq_len = _max_seq_len(args)
    case_timeout = _case_timeout(args.case_timeout)
    workers = _workers(args.workers)
    mode = _resolve_mode(args.graph)
    _check_mps(args.mps, mode)
    if args.corpus is not None:
        _check_writable_dir("--corpus", args.corpus)
    if args.json:
        _check_writable_file("--json", args.json)
    try:
        all_, expected = load_mutants(args.mutant_set)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    names = sorted(all_)
    if args.only is not None:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        if not wanted:
            raise UsageError(f"--only: expected comma-separated mutant names, got {args.only!r}; "
                             f"known: {', '.join(names)}")
        unknown = [n for n in wanted if n not in all_]
        if unknown:
            raise UsageError(f"--only: unknown mutant(s) {unknown} in the {args.mutant_set} set; known: "
                             f"{', '.join(names)}")
        names = wanted
    if args.only is None and (mode == "cuda" or (mode == "eager" and _cuda())):
        from .mutants import INTERPRETER_ONLY
        for n in sorted(set(names) & INTERPRETER_ONLY):
            print(f"mla-fuzz mutants: {n} not run on the GPU: its only symptom is an access outside the kernel's "
                  "tensors, which only the CPU interpreter's bounds check sees (--graph emulated)", file=sys.stderr)
        names = [n for n in names if n not in INTERPRETER_ONLY]
    refs = [f"mutant:{n}" for n in names] + ([] if args.no_clean else [CLEAN])
    specs = list(SPECS) if args.spec == "both" else [args.spec]
    print(f"mla-fuzz mutants: {len(refs)} backends" + ("" if args.mutant_set == "public" else f" ({args.mutant_set} set)")
          + f", graph {mode}, spec {args.spec}, {examples} examples, seed {seed}", file=sys.stderr, flush=True)

    # the clean backend's kernels are what every row shares (a mutant with kernels of its own
    # compiles them in its row)
    warm = _warmup_plan(args, CLEAN, specs, mode, {}, max_seq_len)
    warm_out = []
    if warm is not None:
        print(f"warmup: {warm.describe()}; kernels in {warm.cache_dir}", file=sys.stderr, flush=True)

    def on_row(row, done, total):
        when = "" if row.get("seconds_to_detect") is None else f", first seen at {row['seconds_to_detect']:.1f}s"
        what = (f"caught after {row['examples_to_detect']} examples{when}: {row['diagnosis']}" if row["caught"]
                else f"nothing found in {row['examples']} examples")
        print(f"[{done}/{total}] {row_label(row, len(specs) > 1)}: {what}"
              + (f" (error: {row['error']})" if row.get("error") else ""), file=sys.stderr, flush=True)

    def on_sight(row_name, seconds, examples_seen):
        print(f"[mla-fuzz] {seconds:.1f}s: {row_name}: FOUND at example {examples_seen} (shrinking...)",
              file=sys.stderr, flush=True)

    started = command_start()
    from .mps import MpsError
    try:
        rows = run_matrix(refs, expected, graph=mode, spec=specs, examples=examples, seed=seed,
                          worker_envs=worker_envs(workers, mode), case_timeout=case_timeout, max_seq_len=max_seq_len,
                          corpus=None if args.corpus is None else Path(args.corpus), on_row=on_row,
                          on_sight=on_sight, started_at=started, warmup=warm, on_warmup=warm_out.append,
                          on_note=lambda text: print(f"[mla-fuzz] {text}", file=sys.stderr, flush=True),
                          mps=args.mps)
    except MpsError as exc:  # the daemon did not start
        raise UsageError(str(exc)) from None
    code, reasons = verdict(rows, strict=args.strict)
    _print_lines(table(MATRIX_HEADERS, matrix_rows(rows, by_spec=len(specs) > 1), indent=""))
    for r in reasons:
        print("FAIL: " + r)
    if len(rows) < len(refs):
        print(f"INTERRUPTED after {len(rows)} of {len(refs)} rows")
        code = code or EXIT_INTERRUPTED
    if args.json:
        write_json(args.json, matrix_json(rows, graph=mode, spec=args.spec, examples=examples, seed=seed,
                                          seconds=time.time() - started,
                                          warmup=warm_out[0] if warm_out else None) | {"set": args.mutant_set, "exit_code": code})
    return code


def cmd_warmup(args) -> int:
    import signal
    import tempfile
    import threading

    from .worker_env import worker_envs
    from .pool import Pool
    from .warmup import REPORT_FORMAT, WorkerFatal, run_warmup, skipped, summary_line

    backend = args.backend
    mode = _resolve_mode(args.graph)
    specs = _specs(args.spec, mode)
    workers = _workers(args.workers)
    case_timeout = _case_timeout(args.case_timeout)
    narrow = _narrow(args)
    max_seq_len = _max_seq_len(args)
    if args.json:
        _check_writable_file("--json", args.json)
    _check_backend(backend)
    _capabilities_text(backend, narrow, mode)  # one line when the narrowing leaves nothing
    args.warmup = True
    plan = _warmup_plan(args, backend, specs, mode, narrow, max_seq_len, force=args.force)
    if workers == "auto" and _gpu_mode(mode):
        import torch
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        workers = max(torch.cuda.device_count(), min(8, cores))
    envs = worker_envs(workers, mode)
    tasks = sum(len(s.scenarios) for s in plan.todo)
    envs = envs[: max(1, min(len(envs), tasks))]
    if plan.warm:
        envs = []
    print(f"mla-fuzz warmup: backend {backend}, graph {mode}, spec {','.join(specs)}, {len(envs)} worker(s); "
          f"kernels in {plan.cache_dir}", file=sys.stderr, flush=True)
    if not _gpu_mode(mode):
        print("note: under Triton's interpreter (CPU) nothing is compiled: this warmup only runs its scenarios",
              file=sys.stderr, flush=True)
    code = EXIT_OK
    if plan.warm:
        out = skipped(plan)
    else:
        print(f"warmup: {plan.describe()}", file=sys.stderr, flush=True)
        stopped = [False]
        last = [0, 0.0]
        t0 = time.monotonic()

        def note(text: str) -> None:
            if not args.quiet:
                print(f"[mla-fuzz] {text}", file=sys.stderr, flush=True)

        def tick(done: int, total: int) -> None:
            now = time.monotonic()
            if done != last[0] and (now - last[1] >= 2.0 or done == total):
                last[0], last[1] = done, now
                note(f"{now - t0:.1f}s: warmup {done}/{total} scenarios")

        old = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGINT, lambda *_: stopped.__setitem__(0, True))
        try:
            with tempfile.TemporaryDirectory(prefix="mla-fuzz-warmup-") as logs:
                pool = Pool(envs, logs, case_timeout=case_timeout)
                pool.start()
                try:
                    out = run_warmup(plan, pool, note=note, on_tick=tick, kill=lambda: stopped[0])
                except WorkerFatal as exc:
                    print(f"mla-fuzz warmup: error: {exc}", file=sys.stderr)
                    return EXIT_INTERNAL
                finally:
                    pool.close(kill=stopped[0])
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        if stopped[0]:
            code = EXIT_INTERRUPTED
    print(summary_line(out, len(envs)))
    for w in out.warnings:
        print("warning: " + w)
    if code == EXIT_INTERRUPTED:
        print(f"INTERRUPTED after {out.ran} of {out.planned} scenarios (no marker for the specs not finished)")
    if args.json:
        write_json(args.json, {"format": REPORT_FORMAT, "graph_mode": mode, "spec": ",".join(specs),
                               "workers": len(envs), **out.to_dict(),
                               "elapsed_s": round(time.time() - command_start(), 3), "exit_code": code})
        print(f"report: {args.json}")
    return code


def cmd_bisect(args) -> int:
    from .bisect import run_bisect
    return run_bisect(args)


def _int_list(what: str, text: str, allow_auto: bool = False) -> tuple:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"{what}: expected a comma-separated list, got {text!r}")
    out = []
    for x in items:
        out.append("auto" if allow_auto and x.lower() == "auto" else _positive_int(what, x))
    return tuple(out)


def cmd_bench(args) -> int:
    from .throughput import HEADER, BenchPlan, run_bench, run_line, summary_lines, visible_gpu_ids

    specs = tuple(x.strip() for x in args.spec.split(",") if x.strip())
    bad = [x for x in specs if x not in SPECS]
    if not specs or bad:
        raise UsageError(f"--spec: expected a comma-separated subset of {', '.join(SPECS)}, got {args.spec!r}")
    modes = []
    for m in (x.strip() for x in args.graph.split(",") if x.strip()):
        if m not in GRAPHS:
            raise UsageError(f"--graph: expected modes among {', '.join(GRAPHS)}, got {m!r}")
        modes.append(_resolve_mode(m))
    if not modes:
        raise UsageError(f"--graph: expected a comma-separated list of modes, got {args.graph!r}")
    _check_writable_dir("--corpus", args.corpus)
    if args.json:
        _check_writable_file("--json", args.json)
    _check_backend(args.backend)
    if args.mps:
        for m in modes:
            _check_mps(True, m)
    ngpu = len(visible_gpu_ids()) if "cuda" in modes else 0
    gpus = _int_list("--gpus", args.gpus) if args.gpus else tuple(sorted({1, max(ngpu, 1)}))
    warmup = 0.0 if str(args.warmup).strip() in ("0", "0s") else parse_duration(args.warmup, "--warmup")
    plan = BenchPlan(backend=args.backend, specs=specs, modes=tuple(dict.fromkeys(modes)), gpus=gpus,
                     per_gpu=_int_list("--per-gpu", args.per_gpu),
                     cpu_workers=_int_list("--workers", args.workers, allow_auto=True),
                     budget_s=parse_duration(args.budget), warmup_s=warmup, seed=_seed(args.seed),
                     chunk=_positive_int("--chunk", args.chunk), case_timeout=_case_timeout(args.case_timeout),
                     corpus=args.corpus, mps=args.mps, max_seq_len=_max_seq_len(args))
    print(f"mla-fuzz bench: backend {plan.backend}, specs {','.join(specs)}, modes {','.join(plan.modes)}, "
          f"{plan.budget_s:g}s per run after a {plan.warmup_s:g}s warm-up", file=sys.stderr, flush=True)
    print(HEADER, flush=True)
    try:
        doc = run_bench(plan, on_run=lambda r: print(run_line(r), flush=True))
    except ValueError as exc:  # harness.mps.MpsError
        raise UsageError(str(exc)) from None
    _print_lines(summary_lines(doc["summary"]))
    flagged = [r for r in doc["runs"] if r.get("failures")]
    errors = [r for r in doc["runs"] if r.get("errors")]
    code = EXIT_FOUND if flagged else (EXIT_INTERNAL if errors else EXIT_OK)
    doc["exit_code"] = code
    if args.json:
        write_json(args.json, doc)
        print(f"results: {args.json}")
    if flagged:
        print(f"FAIL: the backend was flagged in {len(flagged)} run(s); see the failures in the JSON/corpus",
              file=sys.stderr)
    return code


def cmd_server(args) -> int:
    from . import server
    if args.action != "start" and args.idle_minutes is not None:
        raise UsageError("--idle-minutes goes with start")
    if args.action != "stop" and args.all:
        raise UsageError("--all goes with stop")
    if not server.enabled():
        raise UsageError("the server needs Linux (fork, Unix sockets); MLA_FUZZ_SERVER=0 and MLA_FUZZ_ZYGOTE=0 "
                         "turn it off")
    env = _expected_worker_env(args.graph)
    key = server.key_for(env)
    if args.action == "status":
        recs = server.records()
        if not recs:
            print("no mla-fuzz server runs for this user")
        for rec in recs:
            mine = " (this environment)" if rec["key"] == key else ""
            print(f"pid {rec['pid']}{mine}: graph {rec.get('graph')}, up {_ago(rec['since'])}, imports took "
                  f"{rec['preload_s']:.1f}s, exits after {rec['idle_s'] / 60:g} min idle; python {rec['python']}; "
                  f"socket {rec['socket']}")
        return EXIT_OK
    if args.action == "stop":
        recs = server.records() if args.all else [r for r in server.records() if r["key"] == key]
        if not recs:
            print("no mla-fuzz server runs" + ("" if args.all else " for this environment"))
        for rec in recs:
            done = server.stop(rec)
            print(f"server pid {rec['pid']}: " + ("stopped" if done else
                  "no longer takes commands; it exits when the commands it runs end"))
        return EXIT_OK
    idle = server.IDLE_MINUTES
    if args.idle_minutes is not None:
        try:
            idle = float(args.idle_minutes)
        except ValueError:
            idle = -1.0
        if not idle > 0:
            raise UsageError(f"--idle-minutes must be a positive number of minutes, got {args.idle_minutes!r}")
    tty = sys.stderr.isatty()

    def progress(waited: float) -> None:
        if tty:
            print(f"\r[mla-fuzz] server importing torch, torch._dynamo, triton... {waited:.0f}s", end="",
                  file=sys.stderr, flush=True)
    try:
        rec, new = server.start(env, args.graph, idle, progress=progress)
    except (RuntimeError, OSError) as exc:
        if tty:
            print(file=sys.stderr)
        print(f"mla-fuzz server: could not start: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    if tty:
        print(file=sys.stderr)
    if new:
        print(f"mla-fuzz server: ready, pid {rec['pid']}, imports took {rec['preload_s']:.1f}s; commands of this "
              f"environment (graph {args.graph}) now start in it; it exits after {idle:g} min without one, or with "
              "`mla-fuzz server stop`")
    else:
        print(f"mla-fuzz server: already running for this environment, pid {rec['pid']} (up {_ago(rec['since'])})")
    return EXIT_OK


def _ago(since: float) -> str:
    s = max(0, int(time.time() - since))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


COMMANDS = {"run": cmd_run, "replay": cmd_replay, "merge": cmd_merge, "mutants": cmd_mutants, "bisect": cmd_bisect,
            "bench": cmd_bench, "warmup": cmd_warmup, "server": cmd_server}


#: commands that run their work in worker processes (``harness.pool``)
_POOL_COMMANDS = ("run", "mutants", "warmup", "replay")


def _pool_graph(argv: list[str], *, replays: bool = False) -> str | None:
    """The ``--graph`` of a command in ``argv`` that starts workers (``replay`` only with
    ``--isolate``, unless ``replays``), else None. Reads only the command name and ``--graph``:
    the parser still judges them."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in _POOL_COMMANDS or any(a in ("-h", "--help") for a in argv):
        return None
    if words[0] == "replay" and "--isolate" not in argv and not replays:
        return None  # replays run in this process unless a repro is a crash or hang (then: no head start)
    graph = "auto"
    for i, a in enumerate(argv):
        if a == "--graph" and i + 1 < len(argv):
            graph = argv[i + 1]
        elif a.startswith("--graph="):
            graph = a.split("=", 1)[1]
    return graph


def _prestart_workers(argv: list[str]) -> None:
    """For a command that will start workers, start their zygote (``harness.zygote``) before
    this process imports torch (building the parser does), so the workers' imports overlap
    the command's own (a bad command line costs a zygote that exits with this process)."""
    graph = _pool_graph(argv)
    if graph is not None:
        from .zygote import prestart
        prestart(_expected_worker_env(graph))


def _in_server(argv: list[str], started: float) -> int | None:
    """A command that starts workers, or replays, runs in the mla-fuzz server for its
    environment when one runs (``harness.server``): its exit status, else None."""
    graph = _pool_graph(argv, replays=True)
    if graph is None:
        return None
    from . import server
    return server.run_command(argv, _expected_worker_env(graph), started)


def main(argv=None, started: float | None = None) -> int:
    """Entry point of the ``mla-fuzz`` console script; returns the exit status. ``started``:
    the epoch time the user started the command, when that was another process (the server's
    client)."""
    global _COMMAND_START
    # the console script / ``python -m`` (no argv): the user started the command when this
    # process started; an in-process call starts it now
    _COMMAND_START = started or (process_start() if argv is None else time.time())
    if argv is None:
        code = _in_server(sys.argv[1:], _COMMAND_START)
        if code is not None:
            return code
    _prestart_workers(sys.argv[1:] if argv is None else list(argv))
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.cmd:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if not _cuda() and not os.environ.get("TRITON_INTERPRET"):
            os.environ["TRITON_INTERPRET"] = "1"  # no GPU: kernels in this process can only be interpreted
        return COMMANDS[args.cmd](args)
    except UsageError as exc:
        cmd = getattr(locals().get("args"), "cmd", None)
        prog = exc.prog or ("mla-fuzz" + (f" {cmd}" if cmd else ""))
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:
        print("mla-fuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # a harness bug: keep the traceback, but never exit 1 ("found")
        import traceback
        traceback.print_exc()
        print("mla-fuzz: internal error (the traceback above); please report it", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
