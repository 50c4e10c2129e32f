"""Run records: one small JSON file per finished run of a study, kept in the repository
(``records: results/<study>`` in the study file) so that a study runs in several sittings, on
several machines, and its tables are generated from what was run (:mod:`.tables`).

Layout: ``<records>/<cell key>/seed_<s>.json``, each holding

* ``config``: the run's resolved config (:func:`run_fingerprint`: all but its output root and Spark
  session; the same fingerprint decides whether a run directory is finished; the launcher is part of
  it), and ``config_hash``, its hash;
* the study, cell, factors and seed;
* ``metrics``: the run's row of ``results.parquet`` (:func:`.results.run_metrics`);
* ``curve``: the validation and test evaluations (step, epoch, wall time, accuracy, loss);
* ``wall_s`` (the run's wall time, data preparation included), ``load_avg`` (the 1-minute load
  average before and after the run), the host's CPU count and the torch version, and ``finished``
  (UTC, ISO 8601).

A rerun of the study skips every run whose record holds the same config (:func:`same_config`), and
trains the others; a run whose config changed is trained again and its record replaced. A config
key that code added after the record was written counts as unchanged while the run leaves it at its
default (a new option, off unless set); set to anything else, or a recorded key that is gone or
holds another value, and the run is trained again. Records of format 1 hold only the hash: they
match only the very same config. A record is written
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

#: 2: the record holds the run's config; 1: only its hash (still read)
FORMAT = 2
READABLE_FORMATS = (1, 2)
#: the run config's keys that are not part of its fingerprint: where it writes, its Spark session
NOT_FINGERPRINTED = {"output_root", "spark"}
CURVE_KEYS = ("split", "step", "epoch", "wall_s", "virtual_s", "accuracy", "loss")


def records_root(records: Optional[str]) -> Optional[Path]:
    """The records folder of a study file's ``records`` (a relative path is the repository's)."""
    if not records:
        return None
    p = Path(records)
    return p if p.is_absolute() else REPO / p


def run_fingerprint(run_cfg) -> dict:
    """A run's resolved config as recorded and compared."""
    return run_cfg.model_dump(mode="json", exclude=NOT_FINGERPRINTED)


def config_hash(fingerprint: dict) -> str:
    return digest(fingerprint, 16)


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def same_config(rec: dict, run_cfg) -> bool:
    """Whether the record was written for this run's config: the same hash, or (a record that holds
    its config) the same value for every key both have, and every key only this config has at its
    default (the module docstring)."""
    fp = run_fingerprint(run_cfg)
    if rec.get("config_hash") == config_hash(fp):
        return True
    if not isinstance(rec.get("config"), dict):
        return False
    was, now = _flat(rec["config"]), _flat(fp)
    set_here = _flat(run_cfg.model_dump(mode="json", exclude=NOT_FINGERPRINTED, exclude_defaults=True))
    for k in was.keys() | now.keys():
        if k not in now or (k in was and was[k] != now[k]) or (k not in was and k in set_here):
            return False
    return True


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
    if not isinstance(rec, dict) or rec.get("format") not in READABLE_FORMATS or "metrics" not in rec:
        raise BadInputError(f"run record {path}: not a run record of format "
                            f"{' or '.join(map(str, READABLE_FORMATS))}")
    return rec


def recorded(root: Optional[Path], cell: Cell, seed: int, run_cfg) -> Optional[dict]:
    """The record of this run with the same config, or None (no record, or another config's)."""
    if root is None:
        return None
    path = record_path(root, cell, seed)
    if not path.is_file():
        return None
    rec = read_record(path)
    return rec if same_config(rec, run_cfg) else None


def compact_curve(curve: list[dict]) -> list[dict]:
    return [{k: r[k] for k in CURVE_KEYS if k in r} for r in curve if r.get("split") in ("val", "test")]


def write_record(root: Path, study: str, cell: Cell, seed: int, run_cfg, metrics: dict,
                 curve: list[dict], wall_s: Optional[float], load_before: Optional[float],
                 launcher: str) -> Path:
    import torch

    fingerprint = run_fingerprint(run_cfg)
    rec: dict[str, Any] = {
        "format": FORMAT, "study": study, "cell": cell.name, "cell_key": cell.key, "factors": cell.factors,
        "seed": seed, "config_hash": config_hash(fingerprint), "config": fingerprint,
        "launcher": launcher,
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
