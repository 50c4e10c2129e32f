"""End-to-end runs composed from the stages (the top layer; used by ``make run``).

A workflow only wires stage configs together: it derives every stage's input/output path
from one ``output_root`` and calls the stage functions in order on one Spark session. Each
stage keeps its own config section (same keys as its job), so
``--set train.epochs=2`` or ``--set shard.scheme=full_overlap`` work as with the single jobs.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import Field

from .config import StageConfig
from .ingest.images import ImagesIngestConfig, ingest_images
from .outputs import local_path, write_json
from .shards.materialize import ShardConfig, shard
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


def plan_run_images(cfg: ImagesRunConfig) -> dict:
    p = _paths(local_path(cfg.output_root))
    return {"stages": ["ingest_images", "shard", "train"], "source": cfg.ingest.source,
            "workers": cfg.workers, "outputs": {k: str(v) for k, v in p.items()}}


def run_images(cfg: ImagesRunConfig, spark=None) -> dict:
    from .spark import get_spark
    from .train.launch import train

    t0 = time.time()
    root = local_path(cfg.output_root)
    p = _paths(root)
    spark = spark or get_spark(cfg.spark)

    ingest_cfg = cfg.ingest.model_copy(update={"output": str(p["dataset"])})
    ing = ingest_images(ingest_cfg, spark)

    shard_cfg = cfg.shard.model_copy(update={"input": str(p["dataset"]), "output": str(p["shards"]),
                                             "workers": cfg.workers})
    sh = shard(shard_cfg, spark)

    train_cfg = cfg.train.model_copy(update={"manifest": str(p["shards"] / "manifest.json"),
                                             "output": str(p["train"]), "workers": cfg.workers})
    tr = train(train_cfg, spark)

    summary = {
        "workflow": "images", "source": cfg.ingest.source, "rows": ing["rows"], "counts": ing["counts"],
        "workers": cfg.workers, "scheme": shard_cfg.scheme, "algorithm": train_cfg.algorithm.name,
        "model": train_cfg.model, "launcher": train_cfg.launcher,
        "test_accuracy": tr.get("test_accuracy"), "seconds": round(time.time() - t0, 1),
        "outputs": {k: str(v) for k, v in p.items()}, "shard_summary": sh, "train_summary": tr,
    }
    write_json(root / "summary.json", summary)
    print(f"SUMMARY images: {ing['rows']} {cfg.ingest.source} images -> {cfg.workers} {shard_cfg.scheme} shards -> "
          f"{train_cfg.model} / {train_cfg.algorithm.name} on {train_cfg.launcher} ({train_cfg.epochs} epochs): "
          f"test accuracy {tr.get('test_accuracy', float('nan')):.4f} in {summary['seconds']:.0f} s "
          f"[{root / 'summary.json'}]", flush=True)
    return summary
