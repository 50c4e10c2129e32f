"""Run records: one small JSON file per finished run of a study, kept in the repository
(``records: results/<study>`` in the study file) so that a study runs in several sittings, on
several machines, and its tables are generated from what was run (:mod:`.tables`).

Layout: ``<records>/<cell key>/seed_<s>.json``, each holding

* ``config_hash``: the hash of the run's resolved config (the same fingerprint that decides whether
  a run directory is finished; the launcher is part of it);
* the study, cell, factors and seed;
* ``metrics``: the run's row of ``results.parquet`` (:func:`.results.run_metrics`);
* ``curve``: the validation and test evaluations (step, epoch, wall time, accuracy, loss);
* ``wall_s`` (the run's wall time, data preparation included), ``load_avg`` (the 1-minute load
  average before and after the run), the host's CPU count and the torch version, and ``finished``
  (UTC, ISO 8601).

A rerun of the study skips every run whose record holds the same config hash, and trains the
others; a run whose config changed is trained again and its record replaced. A record is written
atomically (a temporary file in the same folder, then a rename), after the run's output is
committed, so a study stopped at any point leaves only whole records.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import BadInputError
from .grid import REPO, Cell, digest

FORMAT = 1
CURVE_KEYS = ("split", "step", "epoch", "wall_s", "accuracy", "loss")


def records_root(records: Optional[str]) -> Optional[Path]:
    """The records folder of a study file's ``records`` (a relative path is the repository's)."""
    if not records:
        return None
    p = Path(records)
    return p if p.is_absolute() else REPO / p


def config_hash(fingerprint: dict) -> str:
    return digest(fingerprint, 16)


def record_path(root: Path, cell: Cell, seed: int) -> Path:
    return root / cell.key / f"seed_{seed}.json"


def load_avg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def read_record(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInputError(f"run record {path}: not readable JSON ({e})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or "metrics" not in rec:
        raise BadInputError(f"run record {path}: not a run record of format {FORMAT}")
    return rec


def recorded(root: Optional[Path], cell: Cell, seed: int, fingerprint: dict) -> Optional[dict]:
    """The record of this run with the same config, or None (no record, or another config's)."""
    if root is None:
        return None
    path = record_path(root, cell, seed)
    if not path.is_file():
        return None
    rec = read_record(path)
    return rec if rec.get("config_hash") == config_hash(fingerprint) else None


def compact_curve(curve: list[dict]) -> list[dict]:
    return [{k: r[k] for k in CURVE_KEYS if k in r} for r in curve if r.get("split") in ("val", "test")]


def write_record(root: Path, study: str, cell: Cell, seed: int, fingerprint: dict, metrics: dict,
                 curve: list[dict], wall_s: Optional[float], load_before: Optional[float],
                 launcher: str) -> Path:
    import torch

    rec: dict[str, Any] = {
        "format": FORMAT, "study": study, "cell": cell.name, "cell_key": cell.key, "factors": cell.factors,
        "seed": seed, "config_hash": config_hash(fingerprint), "launcher": launcher,
        "metrics": {k: v for k, v in metrics.items()},
        "curve": compact_curve(curve),
        "wall_s": None if wall_s is None else round(float(wall_s), 1),
        "load_avg": {"before": load_before, "after": load_avg()},
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = record_path(root, cell, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(v: Any):
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return str(v)


def study_records(root: Path) -> list[dict]:
    """Every record under a study's records folder, in a stable order (cell key, seed)."""
    if not root.is_dir():
        return []
    return [read_record(p) for p in sorted(root.glob("*/seed_*.json"),
                                           key=lambda p: (p.parent.name, int(p.stem.split("_")[1])))]
