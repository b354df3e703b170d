"""Self-contained JSON repro files: write atomically, load with validation, replay.

A repro holds everything needed to re-run a failure deterministically and nothing that
needs the search: backend reference, graph mode, scenario config (spec included), the
minimal steps (each with its seeds), the failure and diagnosis, and tool versions.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .atomic import read_json, write_text_atomic
from .diagnosis import Diagnosis, diagnose
from .executor import run_steps
from .loading import load_backend
from .oracles import OracleFailure, failure_dict
from .scenario import ScenarioConfig, validate_step

FORMAT = "mla-fuzz-repro/1"


class ReproError(ValueError):
    """A repro file that cannot be used: missing, not JSON, wrong format, bad fields."""


def versions() -> dict:
    import torch
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    try:
        from importlib.metadata import version
        mv = version("mla-fuzz")
    except Exception:
        mv = "unknown"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "triton": tv, "mla_fuzz": mv, "python": platform.python_version(),
            "device": dev}


def make_repro(backend_ref: str, graph_mode: str, cfg: ScenarioConfig, steps: list[dict],
               failure: OracleFailure, diagnosis: Diagnosis | None, search: dict | None = None) -> dict:
    return {
        "format": FORMAT,
        "backend": backend_ref,
        "graph_mode": graph_mode,
        "config": cfg.to_dict(),
        "steps": steps,
        "failure": failure_dict(failure),
        "diagnosis": None if diagnosis is None else diagnosis.to_dict(),
        "search": search or {},
        "versions": versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def signature(repro: dict) -> str:
    """Deduplication key: backend + diagnosis class + failure key (the oracle, and for a
    backend error the exception type and the backend's file:line; ``oracles.failure_key``)."""
    d = repro.get("diagnosis") or {}
    f = repro["failure"]
    return f"{repro['backend']}|{d.get('cls', '?')}|{f.get('key') or f['oracle']}"


def write_repro(repro: dict, directory: str | os.PathLike) -> Path:
    """Write atomically (temp file + fsync + rename): a killed process leaves either the
    whole file or none. The name is derived from the content, so reruns do not pile up."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    body = json.dumps(repro, indent=2, sort_keys=False)
    digest = hashlib.sha1(json.dumps([repro["backend"], repro["config"], repro["steps"]],
                                     sort_keys=True).encode()).hexdigest()[:10]
    # a failure as first seen, before shrinking and diagnosis, is named for what it is
    unshrunk = bool((repro.get("search") or {}).get("unshrunk"))
    cls = (repro.get("diagnosis") or {}).get("cls") or ("unshrunk" if unshrunk else "failure")
    path = directory / f"{cls}-{digest}.json"
    return write_text_atomic(path, body + "\n")


def load_repro(path: str | os.PathLike) -> dict:
    """Parse and validate a repro file; ``ReproError`` says what is wrong."""
    data = read_json(path, ReproError)
    check_repro(data, str(Path(path)))
    return data


def check_repro(data, where: str = "repro") -> None:
    """Validate a repro's fields, config and steps (what ``load_repro`` checks after parsing);
    ``ReproError`` names ``where`` and what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReproError(f"{where}: not an mla-fuzz repro (expected format {FORMAT!r}, "
                         f"got {data.get('format') if isinstance(data, dict) else type(data).__name__!r})")
    for key in ("backend", "graph_mode", "config", "steps"):
        if key not in data:
            raise ReproError(f"{where}: missing field {key!r}")
    try:
        cfg = ScenarioConfig.from_dict(data["config"])
        if not isinstance(data["steps"], list) or not data["steps"]:
            raise ValueError("'steps' must be a non-empty list")
        for s in data["steps"]:
            validate_step(s, cfg)
    except (ValueError, TypeError) as exc:
        raise ReproError(f"{where}: {exc}") from None


@dataclass
class ReplayResult:
    failure: OracleFailure | None
    diagnosis: Diagnosis | None
    graph_mode: str

    @property
    def failed(self) -> bool:
        return self.failure is not None


def replay_repro(data: dict, *, backend: str | None = None, graph_mode: str | None = None,
                 device=None, diagnose_failure: bool = True) -> ReplayResult:
    """Re-run a loaded repro (optionally against another backend / graph mode). A dict not
    read by ``load_repro`` (an edited or hand-built one) is validated the same way first:
    ``ReproError`` instead of a failure deep inside a step (a seq_len past the pages)."""
    check_repro(data)
    backend_cls = load_backend(backend or data["backend"])
    mode = graph_mode or data["graph_mode"]
    if mode == "cuda":
        import torch
        if not torch.cuda.is_available():
            mode = "emulated"
    cfg = ScenarioConfig.from_dict(data["config"])
    failure = run_steps(backend_cls, cfg, data["steps"], mode, device)
    diag = None
    if failure is not None and diagnose_failure:
        diag = diagnose(backend_cls, cfg, data["steps"], failure, mode, device)
    return ReplayResult(failure, diag, mode)
