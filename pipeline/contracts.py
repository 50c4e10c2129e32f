"""Every typed contract between stages, and its published JSON Schema.

:data:`CONTRACTS` maps a contract's name to the pydantic model that defines it
(``"module:Class"``, imported only when asked for). The JSON Schema of each lives in
``schemas/contracts/<name>.json``; ``python -m pipeline.contracts`` rewrites them from the models
and ``python -m pipeline.contracts --check`` exits 1 naming the first file that differs (the test
suite runs the check, so the published files cannot drift from the code).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Optional

CONTRACTS: dict[str, str] = {
    "shard_manifest": "pipeline.shards.manifest:ShardManifest",          # shards/manifest.json
    "scaling": "pipeline.features.scaling:ScalingFile",                   # features/scaling.json
    "dag_hep": "pipeline.dag_settings:HepDagSettings",                    # configs/dag_hep.yaml
    "dag_images": "pipeline.dag_settings:ImagesDagSettings",              # configs/dag_images.yaml
    "dag_hep_ingest_daily": "pipeline.dag_settings:HepIngestDailyDagSettings",   # configs/dag_hep_ingest_daily.yaml
    "training_plan": "pipeline.train.plan:TrainingPlan",                  # launch.make_plan -> every worker
}
CONTRACTS_DIR = Path(__file__).resolve().parents[1] / "schemas" / "contracts"


def model_of(name: str):
    """The pydantic model class of contract ``name``."""
    module, _, cls = CONTRACTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def json_schema(name: str) -> dict:
    """The JSON Schema of contract ``name`` as published (with a ``$id`` naming the contract)."""
    schema = model_of(name).model_json_schema()
    return {"$id": f"hep-pipeline/contracts/{name}.json", **schema}


def render(name: str) -> str:
    return json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n"


def write_all(out_dir: Path = CONTRACTS_DIR) -> list[Path]:
    """Write every contract's JSON Schema under ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in CONTRACTS:
        p = out_dir / f"{name}.json"
        p.write_text(render(name))
        paths.append(p)
    return paths


def stale(out_dir: Path = CONTRACTS_DIR) -> list[str]:
    """Names of the contracts whose published file is missing or differs from the model."""
    return [n for n in CONTRACTS
            if not (out_dir / f"{n}.json").is_file() or (out_dir / f"{n}.json").read_text() != render(n)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.contracts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a published schema differs from its model")
    ap.add_argument("--out", type=Path, default=CONTRACTS_DIR, help="folder of the published schemas")
    a = ap.parse_args(argv)
    if a.check:
        bad = stale(a.out)
        if bad:
            print(f"error: {a.out / (bad[0] + '.json')} differs from {CONTRACTS[bad[0]]}; "
                  "run python -m pipeline.contracts", file=sys.stderr)
            return 1
        print(f"{len(CONTRACTS)} contract schemas up to date in {a.out}")
        return 0
    for p in write_all(a.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
