"""Commits stopped at every step (tests/commit_drills.py) on each stage's real output layout, read
back with that stage's own readers (issue 34, item 3), on local disk.

Two real outputs (generations 0 and 1: 3 and 6 events ingested, features and shards of 12 and 25
events) of ingest_root, features and shard are made once; their committed files are then committed
over each other by processes stopped right after each commit step in turn. After every stop the stage's readers must find one
generation, whole:

* ingest_root: the feature stage's planner (:func:`pipeline.features.plan.plan_units`, reading
  ``_report.json`` and the parts it names);
* features: :func:`pipeline.committed.committed_files` of ``hlf/`` and ``llf/``,
  ``scaling.json`` through :func:`pipeline.outputs.read_json` and
  :class:`pipeline.features.scaling.ScalingModel`;
* shard: :func:`pipeline.shards.manifest.load_manifest` and
  :func:`pipeline.data.parquet.parquet_files` of every worker directory.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402
from commit_drills import drill_every_step  # noqa: E402

EVENTS = (12, 25)           # events of generation 0 and 1 (features, shard): every stage's output differs
INGESTED = (3, 6)           # of which ingest_root reads (its Parquet holds the events' particle collections)
COMPLETE = "_COMPLETE"


def _committed(out: Path) -> dict[str, bytes]:
    """A committed output as a generation: every file except its marker."""
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), out)
            if rel != COMPLETE:
                files[rel] = Path(root, n).read_bytes()
    assert not any(n.startswith(".") or "/." in n for n in files), sorted(files)
    return files


def _rows(files) -> list[int]:
    """The sample ids of Parquet files, in file order."""
    ids = []
    for f in files:
        ids.extend(pq.read_table(str(f), columns=["sample_id"]).column("sample_id").to_pylist())
    return ids


@pytest.fixture(scope="module")
def generations(spark, delphes_root, tmp_path_factory):
    """Per stage: the two generations ({name: bytes}) and what the readers must find in each."""
    from pipeline.features.delphes import REQUIRED_BRANCHES
    from pipeline.features.stage import FeaturesConfig, build_features
    from pipeline.ingest.root import IngestRootConfig, ingest_root
    from pipeline.shards.materialize import ShardConfig, shard

    base = tmp_path_factory.mktemp("stage-generations")
    colls = H.boosted(H.read_required(delphes_root))
    drills = tmp_path_factory.mktemp("stage-drills")
    samples = [{"name": "ttbar", "label": 1, "files": [f"{base}/*/ttbar.root"]}]
    gens: dict = {"ingest": [], "features": [], "shard": [], "samples": samples, "drills": drills}
    for g, events in enumerate(EVENTS):
        (base / f"root-{g}").mkdir()
        src = H.write_delphes_like(base / f"root-{g}" / "ttbar.root", H.take(colls, list(range(events))))
        ev, feats, shards = base / f"events-{g}", base / f"features-{g}", base / f"shards-{g}"
        # the drills pass a generation as one command-line argument (at most 128 KiB): a few events
        stop = INGESTED[g]
        rep = ingest_root(IngestRootConfig(input=str(src), tree="Delphes", output=str(ev), step_size=2,
                                           entry_stop=stop, filter_name=list(REQUIRED_BRANCHES),
                                           schema_dir=str(base / "schemas")), spark=spark)
        assert rep["rows"] == stop and len(rep["files"][0]["parts"]) >= 1 + g, rep["files"]
        gens["ingest"].append((_committed(ev), {"entries": stop}))

        frep = build_features(FeaturesConfig(input=str(src), samples=samples, output=str(feats), seed=g,
                                             test_fraction=0.2, val_fraction=0.1), spark=spark)
        hlf = sorted(_rows(sorted(str(p) for p in (feats / "hlf").rglob("*.parquet"))))
        llf = sorted(_rows(sorted(str(p) for p in (feats / "llf").rglob("*.parquet"))))
        assert hlf == llf == list(range(len(hlf))) and len(hlf) >= 3, (frep, hlf)
        scaling = json.loads((feats / "scaling.json").read_text())
        gens["features"].append((_committed(feats), {"rows": len(hlf), "scaling": scaling}))

        man = shard(ShardConfig(input=str(feats / "hlf"), output=str(shards), workers=2, row_group_rows=4,
                                seed=g), spark=spark)
        held = [sorted(_rows(sorted(str(p) for p in Path(w["path"]).glob("*.parquet")))) for w in man["workers"]]
        assert all(held), held
        files = _committed(shards)
        # the manifest names its directories by absolute path: the drill's output holds them
        drill_out = str(drills / "shards")
        files["manifest.json"] = files["manifest.json"].replace(str(shards).encode(), drill_out.encode())
        gens["shard"].append((files, {"n": man["n_train_samples"], "held": held}))
    for stage in ("ingest", "features", "shard"):
        for files, _ in gens[stage]:             # commit_drills passes a generation as one argument
            assert sum(len(v) for v in files.values()) * 4 / 3 < 120 * 1024, (stage, "too big for argv")
        a, b = (gens[stage][g][1] for g in (0, 1))
        assert a != b, stage                      # the readers can tell the generations apart
    return gens


def _which(stage: str, gens: dict, seen: dict) -> str:
    """The generation whose expectations ``seen`` meets, whole; AssertionError when neither."""
    for g in (0, 1):
        if seen == gens[stage][g][1]:
            return str(g)
    raise AssertionError(f"{stage}: the readers found neither generation whole: {seen}")


def _check_ingest(gens: dict, probe: Path):
    from pipeline.features.plan import plan_units
    from pipeline.features.stage import FeaturesConfig

    def check(out: str) -> str:
        files, units, labels, notes = plan_units(FeaturesConfig(input=out, samples=gens["samples"],
                                                                output=str(probe)))
        assert len(files) == 1 and not files[0].error and not notes, (files, notes)
        assert units and units[0].entry_start == 0, units
        assert all(a.entry_stop == b.entry_start for a, b in zip(units, units[1:])), units
        assert units[-1].entry_stop == files[0].entries, (units, files)
        for u in units:                          # each part the report names holds its entry range
            assert pq.ParquetFile(u.path).metadata.num_rows == u.entry_stop - u.entry_start, u
        return _which("ingest", gens, {"entries": files[0].entries})
    return check


def _check_features(gens: dict):
    from pipeline.committed import committed_files
    from pipeline.features.scaling import ScalingModel
    from pipeline.outputs import read_json

    def check(out: str) -> str:
        hlf = sorted(_rows(committed_files(f"{out}/hlf", ".parquet")))
        llf = sorted(_rows(committed_files(f"{out}/llf", ".parquet")))
        assert hlf == llf == list(range(len(hlf))), (hlf, llf)
        scaling = read_json(f"{out}/scaling.json")
        model = ScalingModel.load(f"{out}/scaling.json")
        assert model.hlf_count == scaling["hlf"]["count"] <= len(hlf)
        return _which("features", gens, {"rows": len(hlf), "scaling": scaling})
    return check


def _check_shard(gens: dict):
    from pipeline.data.parquet import parquet_files
    from pipeline.shards.manifest import load_manifest

    def check(out: str) -> str:
        man = load_manifest(f"{out}/manifest.json")
        held = []
        for w in man.workers:
            assert w.path.startswith(out + "/"), w.path
            ids = _rows(parquet_files(w.path))
            assert len(ids) == w.rows, (w, ids)
            held.append(sorted(ids))
        return _which("shard", gens, {"n": man.n_train_samples, "held": held})
    return check


# slow (about 90 s on 2 busy cores): it needs real outputs of three Spark stages (ingest_root,
# features and shard, twice each), and every one of the drills' stops is a Python process of its
# own (a stop is the committing driver's os._exit), several dozen per stage
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ingest", "features", "shard"])
def test_each_stage_output_stopped_at_any_commit_step_is_read_old_or_new_by_its_readers(stage, generations):
    """Each stage's real output committed over the other generation, the committing process stopped
    right after each commit step in turn: the stage's own readers find the old or the new output,
    whole, after every stop, and the rerun's output after it."""
    checks = {"ingest": lambda: _check_ingest(generations, generations["drills"] / "probe-features"),
              "features": lambda: _check_features(generations),
              "shard": lambda: _check_shard(generations)}
    check = checks[stage]()
    out = str(generations["drills"] / {"ingest": "events", "features": "features", "shard": "shards"}[stage])
    seen = drill_every_step(out, tuple(g[0] for g in generations[stage]), check, {})
    assert {"0", "1"} <= set(seen), seen           # stops before and after the commit point
    assert check(out) in ("0", "1")
    parent = os.path.dirname(out)
    assert os.path.basename(out) in os.listdir(parent)
    left = [n for n in os.listdir(parent) if n.startswith(".") or n.startswith(os.path.basename(out) + ".")]
    assert not left, left                           # no staging or set-aside output left
