"""End-to-end runs composed from the stages (the top layer; used by ``make run``).

A workflow only wires stage configs together: it derives every stage's input/output path
from one ``output_root`` and calls the stage functions in order on one Spark session. Each
stage keeps its own config section (same keys as its job), so
``--set train.epochs=2`` or ``--set shard.scheme=full_overlap`` work as with the single jobs.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pydantic import Field

from .config import StageConfig, build_config
from .fs import Location, location
from .features.layout import CLASS_NAMES
from .ingest.images import ImagesIngestConfig, ingest_images
from .outputs import local_path, write_json
from .shards.materialize import ShardConfig, shard
from .simulate import SimulateConfig
from .train.config import TrainConfig

log = logging.getLogger(__name__)


class ImagesRunConfig(StageConfig):
    """ingest images -> shard -> train (-> summary)."""

    output_root: str = Field("runs/images", description="every stage writes under this directory")
    workers: int = Field(2, gt=0, description="number of training workers (shards)")
    ingest: ImagesIngestConfig = Field(default_factory=ImagesIngestConfig)
    shard: ShardConfig = Field(default_factory=ShardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


def _paths(root: Path) -> dict:
    return {"dataset": root / "dataset", "shards": root / "shards", "train": root / "train"}


def images_stage_configs(cfg: ImagesRunConfig, p: dict) -> dict:
    """Every stage's config for one images run, with paths from ``p`` (dataset, shards, train)."""
    return {
        "ingest": cfg.ingest.model_copy(update={"output": str(p["dataset"])}),
        "shard": cfg.shard.model_copy(update={"input": str(p["dataset"]), "output": str(p["shards"]),
                                              "workers": cfg.workers}),
        "train": cfg.train.model_copy(update={"manifest": str(p["shards"] / "manifest.json"),
                                              "output": str(p["train"]), "workers": cfg.workers}),
    }


def plan_run_images(cfg: ImagesRunConfig) -> dict:
    p = _paths(local_path(cfg.output_root))
    return {"stages": ["ingest_images", "shard", "train"], "source": cfg.ingest.source,
            "workers": cfg.workers, "outputs": {k: str(v) for k, v in p.items()}}


def run_images(cfg: ImagesRunConfig, spark=None) -> dict:
    from .spark import get_spark
    from .train.launch import check_launch_slots, train

    t0 = time.time()
    root = local_path(cfg.output_root)
    p = _paths(root)
    spark = spark or get_spark(cfg.spark)
    stages = images_stage_configs(cfg, p)
    check_launch_slots(stages["train"], spark)
    ing = ingest_images(stages["ingest"], spark)
    shard_cfg = stages["shard"]
    sh = shard(shard_cfg, spark)
    train_cfg = stages["train"]
    tr = train(train_cfg, spark)

    summary = {
        "workflow": "images", "source": cfg.ingest.source, "rows": ing["rows"], "counts": ing["counts"],
        "workers": cfg.workers, "scheme": shard_cfg.scheme, "algorithm": train_cfg.algorithm.name,
        "model": train_cfg.model, "launcher": train_cfg.launcher,
        "test_accuracy": tr.get("test_accuracy"), "seconds": round(time.time() - t0, 1),
        "outputs": {k: str(v) for k, v in p.items()}, "shard_summary": sh, "train_summary": tr,
    }
    write_json(root / "summary.json", summary)
    return summary


# --------------------------------------------------------------------------------------
# The HEP pipeline: simulate -> ingest ROOT -> features -> shard -> train HLF classifier
# --------------------------------------------------------------------------------------

def _default_hep_train() -> TrainConfig:
    return TrainConfig(model="hlf", optimizer="adam", lr=0.001, epochs=5, batch_size=64, warmup_epochs=0.0)


class HepRunConfig(StageConfig):
    """The main job: generated ttbar / W+jets / QCD events through every HEP stage.

    The real sample files of the coffea sdist go through the same generic ingestion (Delphes and
    CMS NanoAOD) and the real ``delphes.root`` through the same feature code, as a check that the
    stages run unchanged on real detector-simulation files; they are not used for training."""

    output_root: str = Field("runs/hep", description="every stage writes under this directory")
    workers: int = Field(2, gt=0, description="number of training workers (shards)")
    events_per_class: int = Field(2000, gt=0, description="generated events per class (after the lepton filter)")
    seed: int = Field(12345, ge=0, description="generation seed")
    real_samples: bool = Field(True, description="also ingest the real coffea sample files (Delphes + NanoAOD) "
                                                 "and run the features on the real delphes.root")
    simulate: SimulateConfig = Field(default_factory=SimulateConfig,
                                     description="generator settings (events/seed/output are set from above)")
    ingest: dict = Field(default_factory=lambda: {"step_size": "50 MB"},
                         description="extra IngestRootConfig values for the ingestion of the generated files")
    features: dict = Field(default_factory=dict, description="extra FeaturesConfig values")
    shard: ShardConfig = Field(default_factory=ShardConfig)
    train: TrainConfig = Field(default_factory=_default_hep_train)


def _hep_paths(root: Location | str | os.PathLike) -> dict:
    """Every stage's output under ``output_root`` (a local path or an ``s3://`` prefix)."""
    root = location(root, output=True)
    return {k: root.child(*rel.split("/")) for k, rel in {
        "simulated": "simulated", "events": "events", "features": "features", "real_delphes": "real/delphes",
        "real_nanoaod": "real/nanoaod", "real_features": "real/features", "shards": "shards",
        "train": "train"}.items()}


def _feature_dataset(model: str) -> str:
    """The feature stage's dataset a model's shards are cut from: hlf/, or llf/ (whose rows also hold the HLF)."""
    from .train.config import features_for

    return "hlf" if features_for(model) == "hlf" else "llf"


def hep_stage_configs(cfg: HepRunConfig, p: dict) -> dict:
    """Every stage's config for one HEP run, with the stage paths ``p`` (local paths or locations,
    as :func:`_hep_paths` derives them from ``output_root`` or a study places its data)."""
    from .features.delphes import REQUIRED_BRANCHES
    from .features.stage import FeaturesConfig
    from .ingest.root import IngestRootConfig
    from .samples import coffea_samples

    p = {k: location(v, output=True) for k, v in p.items()}

    sim = cfg.simulate.model_copy(update={"events": cfg.events_per_class, "seed": cfg.seed,
                                          "output": str(p["simulated"])})
    samples = [{"name": name, "label": label, "files": [f"{p['simulated']}/{name}/*.root"]}
               for label, name in enumerate(CLASS_NAMES) if name in sim.processes]
    out = {
        "simulate": sim,
        "ingest": build_config(IngestRootConfig, {**cfg.ingest, "input": f"{p['simulated']}/*/*.root",
                                                  "tree": "Delphes", "output": str(p["events"])}),
        "features": build_config(FeaturesConfig, {**cfg.features, "input": str(p["events"]), "samples": samples,
                                                  "output": str(p["features"])}),
        "shard": cfg.shard.model_copy(update={"input": str(p["features"].child(_feature_dataset(cfg.train.model))),
                                              "output": str(p["shards"]),
                                              "workers": cfg.workers}),
        "train": cfg.train.model_copy(update={"manifest": str(p["shards"].child("manifest.json")),
                                              "output": str(p["train"]), "workers": cfg.workers,
                                              "scaling": str(p["features"].child("scaling.json"))}),
    }
    if cfg.real_samples:
        s = coffea_samples()
        out["real_delphes"] = build_config(IngestRootConfig, {
            "input": str(s / "delphes.root"), "tree": "Delphes", "output": str(p["real_delphes"]),
            "filter_name": list(REQUIRED_BRANCHES)})  # the branches the feature stage reads
        # two NanoAOD files with different branch sets: one ingestion each (a run needs one schema)
        for name in ("nano_dy", "nano_tt_v12"):
            out[f"real_{name}"] = build_config(IngestRootConfig, {
                "input": str(s / f"{name}.root"), "tree": "Events", "output": str(p["real_nanoaod"].child(name)),
                "schema_name": f"root/nanoaod_{name}"})
        out["real_features"] = build_config(FeaturesConfig, {
            "input": str(s / "delphes.root"), "output": str(p["real_features"]),
            "samples": [{"name": "ttbar", "label": 1, "files": [str(s / "delphes.root")]}]})
    return out


def plan_run_hep(cfg: HepRunConfig) -> dict:
    p = _hep_paths(location(cfg.output_root, output=True))
    return {"stages": ["simulate", "ingest_root", "features", "shard", "train"],
            "events_per_class": cfg.events_per_class, "workers": cfg.workers,
            "outputs": {k: str(v) for k, v in p.items()}}


def run_hep(cfg: HepRunConfig, spark=None) -> dict:
    from .features.stage import build_features
    from .ingest.root import ingest_root
    from .simulate import generate
    from .spark import get_spark
    from .train.launch import check_launch_slots, train

    t0 = time.time()
    root = location(cfg.output_root, output=True)
    p = _hep_paths(root)
    spark = spark or get_spark(cfg.spark)
    stages = hep_stage_configs(cfg, p)
    check_launch_slots(stages["train"], spark)

    sim = generate(stages["simulate"], spark)
    ingest_root(stages["ingest"], spark)
    real = {}
    if cfg.real_samples:
        real["delphes"] = ingest_root(stages["real_delphes"], spark)
        real["nano_dy"] = ingest_root(stages["real_nano_dy"], spark)
        real["nano_tt_v12"] = ingest_root(stages["real_nano_tt_v12"], spark)
        real["features"] = build_features(stages["real_features"], spark)
    feats = build_features(stages["features"], spark)
    sh = shard(stages["shard"], spark)
    tr = train(stages["train"], spark)

    summary = {"workflow": "hep", "events": sim["events"], "filter_efficiency": sim["filter_efficiency"],
               "features": feats, "real": real, "shard_summary": sh, "train_summary": tr,
               "test_accuracy": tr.get("test_accuracy"), "auc": tr.get("auc"),
               "seconds": round(time.time() - t0, 1), "outputs": {k: str(v) for k, v in p.items()}}
    write_json(root.child("summary.json"), summary)
    return summary
