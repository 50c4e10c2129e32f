"""Commits stopped at every step (tests/commit_drills.py) on each stage's real output layout, read
back with that stage's own readers (issue 34, item 3), on local disk and, for the stages where it
adds coverage (features: committed files and JSON through ``pyarrow.fs``; shard: the manifest's
worker paths on the object store), on the S3 server.

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
  :func:`pipeline.data.parquet.parquet_files` of every worker directory;
* simulate (4 events in one file, 6 in two): the sidecar ``simulation.json`` through
  :func:`pipeline.outputs.read_json`, the ROOT files that ingest_root's input resolution
  (:func:`pipeline.ingest.root.files.resolve_files`) finds under the output, opened with uproot;
* ingest_images (30 and 50 digits): the shard stage's input reading
  (:func:`pipeline.inputs.dataset_files`, ``parquet_schema_of``, its ``check_schema``, ``read_parquet``);
* train (1 and 2 epochs of the local launcher on 64 digits): :func:`pipeline.studies.results.run_metrics`
  (``summary.json`` and ``metrics.jsonl``), the report's :func:`pipeline.report.curves.load_runs` and
  ``model.pt`` loaded with ``torch.load``.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402
from commit_drills import drill_every_step  # noqa: E402
from servers import environment  # noqa: E402
from store_fixtures import s3  # noqa: E402,F401

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
    """The sample ids of Parquet files (local or ``s3://``), in file order."""
    from pipeline.inputs import read_parquet

    ids = []
    for f in files:
        ids.extend(read_parquet(str(f), columns=["sample_id"]).column("sample_id").to_pylist())
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
    samples = [{"name": "ttbar", "label": 1, "files": [f"{base}/*/ttbar.root"]}]
    gens: dict = {"ingest": [], "features": [], "shard": [], "samples": samples, "shard_dirs": []}
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
        # the manifest names its directories by absolute path: each drill rewrites them to its output
        gens["shard_dirs"].append(str(shards))
        gens["shard"].append((_committed(shards), {"n": man["n_train_samples"], "held": held}))
    for stage in ("ingest", "features", "shard"):
        a, b = (gens[stage][g][1] for g in (0, 1))
        assert a != b, stage                      # the readers can tell the generations apart
    return gens


@pytest.fixture(scope="module")
def simulate_generations(spark, tmp_path_factory):
    from pipeline.simulate import SimulateConfig
    from pipeline.simulate.stage import generate

    base = tmp_path_factory.mktemp("simulate-generations")
    gens = []
    for g, (events, per_file) in enumerate(((4, 4), (6, 3))):
        out = base / f"sim-{g}"
        rep = generate(SimulateConfig(processes=["ttbar"], events=events, events_per_file=per_file, seed=10 + g,
                                      output=str(out), progress=False), spark=spark)
        assert rep["events"] == {"ttbar": events} and len(rep["files"]["ttbar"]) == 1 + g, rep
        side = json.loads((out / "simulation.json").read_text())
        gens.append((_committed(out), {"seed": side["seed"], "events": [f["events"] for p in side["processes"].values()
                                                                        for f in p["files"]]}))
    assert gens[0][1] != gens[1][1]
    return {"simulate": gens}


@pytest.fixture(scope="module")
def images_generations(spark, tmp_path_factory):
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images

    base = tmp_path_factory.mktemp("images-generations")
    gens = []
    for g, (limit, per_part) in enumerate(((30, 10), (50, 20))):
        out = base / f"dataset-{g}"
        rep = ingest_images(ImagesIngestConfig(source="sklearn_digits", output=str(out), limit=limit,
                                               records_per_part=per_part, rows_per_row_group=8), spark=spark)
        assert rep["rows"] == limit, rep
        tables = [pq.read_table(str(p), columns=["sample_id", "split"]) for p in sorted(out.rglob("*.parquet"))]
        ids = sorted(i for t in tables for i in t.column("sample_id").to_pylist())
        splits = Counter(s for t in tables for s in t.column("split").to_pylist())
        gens.append((_committed(out), {"ids": ids, "splits": dict(splits)}))
    assert gens[0][1] != gens[1][1]
    return {"images": gens}


@pytest.fixture(scope="module")
def train_generations(tmp_path_factory):
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train
    from train_fixtures import write_digit_shards

    base = tmp_path_factory.mktemp("train-generations")
    gens = []
    for g, epochs in enumerate((1, 2)):
        man = write_digit_shards(base / f"shards-{g}", workers=1, n_train=64, n_test=32, n_val=32,
                                 row_group_rows=32, seed=g)
        out = base / f"train-{g}"
        summary = train(TrainConfig(manifest=str(man), output=str(out), launcher="local", epochs=epochs,
                                    batch_size=16, eval_every=2, optimizer="sgd", lr=0.05, progress=False))
        val = [(r["step"], r["accuracy"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("split") == "val" and r.get("accuracy") is not None]
        assert val, "no validation record"
        gens.append((_committed(out), {"steps": summary["steps"], "val": val,
                                       "test_accuracy": summary["test_accuracy"]}))
    assert gens[0][1] != gens[1][1]
    return {"train": gens}


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


def _check_simulate(gens: dict):
    import uproot

    from pipeline.ingest.root.files import resolve_files
    from pipeline.outputs import read_json
    from pipeline.simulate.stage import FORMAT

    def check(out: str) -> str:
        side = read_json(f"{out}/simulation.json")
        assert side["format"] == FORMAT and side["tree"] == "Delphes", side
        named = [f for p in side["processes"].values() for f in p["files"]]
        found = resolve_files(f"{out}/*/*.root")      # what ingest_root reads of the output
        assert found == sorted(os.path.join(out, f["file"]) for f in named), (found, named)
        for f in named:
            with uproot.open(os.path.join(out, f["file"])) as root:
                assert root[side["tree"]].num_entries == f["events"], f
        return _which("simulate", gens, {"seed": side["seed"], "events": [f["events"] for f in named]})
    return check


def _check_images(gens: dict):
    from pipeline.inputs import dataset_files, parquet_schema_of, read_parquet
    from pipeline.shards.scan import check_schema

    def check(out: str) -> str:
        files = dataset_files(out)                     # the shard stage's input reading
        check_schema(parquet_schema_of(files[0]), out)
        tables = [read_parquet(f, ["sample_id", "split"]) for f in files]
        ids = [i for t in tables for i in t.column("sample_id").to_pylist()]
        assert len(ids) == len(set(ids)), ids
        splits = Counter(s for t in tables for s in t.column("split").to_pylist())
        return _which("images", gens, {"ids": sorted(ids), "splits": dict(splits)})
    return check


def _check_train(gens: dict):
    import torch

    from pipeline.report.curves import ReportConfig, load_runs
    from pipeline.studies.results import run_metrics

    def check(out: str) -> str:
        m = run_metrics(Path(out))
        [(_, recs)] = load_runs(ReportConfig(runs=[out], split="val"))
        model = torch.load(os.path.join(out, "model.pt"), map_location="cpu", weights_only=False)
        assert model is not None
        assert m["val_accuracy"] == recs[-1]["accuracy"], (m, recs)
        return _which("train", gens, {"steps": int(m["steps"]), "val": [(r["step"], r["accuracy"]) for r in recs],
                                      "test_accuracy": m["test_accuracy"]})
    return check


def _leftovers(out: str) -> list[str]:
    """The names beside ``out`` in its parent (local directory or S3 prefix)."""
    from pipeline import fs

    parent = fs.location(out).sibling("x")
    return sorted(p.name for p, _ in fs.list_entries(fs.Location(parent.scheme, os.path.dirname(parent.path))))


STAGES = ["ingest", "features", "shard", "simulate", "images", "train"]
ON_S3 = ["features", "shard"]
FIXTURES = {"ingest": "generations", "features": "generations", "shard": "generations",
            "simulate": "simulate_generations", "images": "images_generations", "train": "train_generations"}
NAMES = {"ingest": "events", "features": "features", "shard": "shards", "simulate": "simulated",
         "images": "dataset", "train": "train"}


# slow (several minutes on 2 busy cores): it needs real outputs of six stages (ingest_root, features,
# shard, simulate, ingest_images and train, twice each, all but train on Spark), and every one of the
# drills' stops is a Python process of its own (a stop is the committing driver's os._exit), several
# dozen per stage, each about 1 s longer on S3 (the client's start): S3 only for features and shard
@pytest.mark.slow
@pytest.mark.parametrize("stage,storage", [(s, st) for st, ss in (("local", STAGES), ("s3", ON_S3)) for s in ss])
def test_each_stage_output_stopped_at_any_commit_step_is_read_old_or_new_by_its_readers(stage, storage, request,
                                                                                         tmp_path):
    """Each stage's real output committed over the other generation, the committing process stopped
    right after each commit step in turn: the stage's own readers find the old or the new output,
    whole, after every stop, and the rerun's output after it."""
    gens = request.getfixturevalue(FIXTURES[stage])
    if storage == "s3":
        server = request.getfixturevalue("s3")
        env = server.env("writer")
        out = f"s3://{server.bucket}/stage-drill-{tmp_path.name}/{NAMES[stage]}"
    else:
        env = {}
        out = str(tmp_path / "drill" / NAMES[stage])
    generations = tuple(g[0] for g in gens[stage])
    if stage == "shard":            # the manifest names its worker directories by absolute path: the drill's output's
        generations = tuple({**files, "manifest.json": files["manifest.json"].replace(src.encode(), out.encode())}
                            for files, src in zip(generations, gens["shard_dirs"]))
    checks = {"ingest": lambda: _check_ingest(gens, tmp_path / "probe-features"),
              "features": lambda: _check_features(gens), "shard": lambda: _check_shard(gens),
              "simulate": lambda: _check_simulate(gens), "images": lambda: _check_images(gens),
              "train": lambda: _check_train(gens)}
    check = checks[stage]()
    with environment(**env):
        seen = drill_every_step(out, generations, check, env)
        assert {"0", "1"} <= set(seen), seen           # stops before and after the commit point
        assert check(out) in ("0", "1")
        assert _leftovers(out) == [NAMES[stage]]       # no staging or set-aside output left
