"""The study YAML (``configs/experiments/*.yaml``): one pydantic model, ``StudyConfig``.

```yaml
name: overlap_full_vs_disjoint
workflow: images                 # images (ingest -> shard -> train) | hep (simulate -> ... -> train)
base: configs/run_images.yaml    # the run config every cell starts from (optional)
fixed:                           # dotted overrides applied to every cell
  train.epochs: 3
factors:
  grid:                          # every combination of these values is a cell ...
    shard.scheme: [disjoint, full_overlap]
  variants:                      # ... crossed with these named variants (either part may be absent)
    - {name: arsgd, set: {train.algorithm: {name: arsgd}}}
seeds: 3                         # seeds 0, 1, 2 (or a list); each seed goes into every key of seed_keys
baseline: {shard.scheme: disjoint}   # the cell the others are tested against (default: the first cell)
metrics: [test_accuracy, time_to_target_s]
target_accuracy: 0.9             # for time_to_target_s / epochs_to_target (on the val split)
```

Factor keys are keys of the workflow's run config (``ImagesRunConfig`` / ``HepRunConfig``),
e.g. ``workers``, ``shard.scheme``, ``train.lr``, ``train.algorithm.params.period``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import StageConfig
from ..train.config import TrackingConfig

# Columns of results.parquet that a study may report (see pipeline.studies.results)
METRICS: dict[str, str] = {
    "test_accuracy": "accuracy on the test split at the end",
    "test_loss": "cross-entropy on the test split at the end",
    "test_auc": "mean one-vs-rest ROC AUC over the classes on the test split",
    "val_accuracy": "accuracy of the last validation",
    "best_val_accuracy": "best validation accuracy during the run",
    "time_to_target_s": "training wall time until the validation accuracy first reached target_accuracy",
    "epochs_to_target": "epochs until the validation accuracy first reached target_accuracy",
    "train_seconds": "training time (rank 0, excluding evaluation)",
    "seconds": "wall time of the training stage (launch included)",
    "samples_per_s": "global training samples per second over the run",
    "bytes_sent": "payload bytes handed to the communicator (collectives and the asynchronous algorithms' "
                  "point-to-point exchanges), summed over the workers",
    "bytes_sent_per_step": "payload bytes per step, rank 0",
    "wire_bytes": "bytes rank 0 wrote through system calls during training (/proc/self/io)",
    "comm_fraction": "fraction of rank 0's training time spent communicating",
    "steps": "optimizer steps per worker",
    # under the simulated clock of the cluster cost model (train.cluster; NaN without it)
    "virtual_s": "virtual seconds of the run on the modelled cluster (rank 0's clock at the end)",
    "virtual_s_per_step": "virtual seconds per optimizer step (the time per batch)",
    "virtual_samples_per_s": "global training samples per virtual second",
    "virtual_time_to_target_s": "virtual seconds until the validation accuracy first reached target_accuracy",
    "comm_share": "share of the ranks' virtual time spent communicating",
    "inter_node_bytes": "bytes that crossed the links between nodes",
}
TARGET_METRICS = ("time_to_target_s", "epochs_to_target", "virtual_time_to_target_s")
WORKFLOWS = ("images", "hep")


class Variant(BaseModel):
    """A named set of overrides (one cell, or one axis value crossed with the grid)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, description="label of the variant")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted config key -> value")


class Factors(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="dotted config key -> values")
    variants: list[Variant] = Field(default_factory=list, description="named variants")


class StudyConfig(StageConfig):
    """Config of ``jobs/experiment.py``: a grid of pipeline runs over seeds."""

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="study name (experiment name)")
    description: str = Field("", description="what the study compares (goes into report.md)")
    question: str = Field("", description="the question the study answers (report.md)")
    workflow: Literal["images", "hep"] = Field("images", description="which pipeline a run is: images | hep")
    base: Optional[str] = Field(None, description="YAML of the workflow's run config every cell starts from")
    fixed: dict[str, Any] = Field(default_factory=dict, description="dotted overrides applied to every cell")
    factors: Factors = Field(default_factory=Factors, description="grid and/or named variants")
    seeds: Union[int, list[int]] = Field(3, description="number of seeds (0..n-1) or the list of seeds")
    seed_keys: list[str] = Field(default_factory=lambda: ["train.seed"],
                                 description="config keys that take the run's seed")
    baseline: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="baseline cell: its name, or factor values identifying it (default: first cell)")
    metrics: list[str] = Field(default_factory=lambda: ["test_accuracy"],
                               description="results.parquet columns to report: " + ", ".join(METRICS))
    target_accuracy: Optional[float] = Field(None, gt=0, le=1,
                                             description="validation accuracy for time_to_target_s")
    output: Optional[str] = Field(None, description="study directory, a local path or s3://bucket/prefix "
                                                    "(default runs/studies/<name>)")
    work_dir: Optional[str] = Field(None, description="local working directory of a study whose output is on "
                                                      "an object store: runs are staged there, and the data "
                                                      "cache and MLflow file store live there unless data_dir / "
                                                      "tracking.uri say otherwise (default runs/studies/<name>)")
    data_dir: Optional[str] = Field(None, description="cache of datasets and shards, keyed by their config, on "
                                                      "local disk (default <output>/data, or <work_dir>/data for an "
                                                      "object-store output; studies may share one)")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(enabled=True),
                                     description="MLflow (default: file store <output>/mlruns)")
    plots: bool = Field(True, description="write PNG plots next to report.md")
    records: Optional[str] = Field(None, description="folder of the run records kept in the repository (a relative "
                                                     "path is the repository's, e.g. results/<name>): each finished "
                                                     "run's config hash, seed, metrics, wall time and load average; "
                                                     "a rerun skips the recorded runs (pipeline/studies/records.py)")
    parallel_runs: int = Field(1, ge=1, le=16, description="runs trained at the same time, each in a process of its "
                               "own (launcher inprocess only, local output; 2 on a 2-core machine: "
                               "pipeline/studies/parallel.py)")
    tiny: bool = Field(False, description="run the study at a tiny size: one seed, two values per factor, a "
                                          "few steps on little data (pipeline/studies/tiny.py)")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v):
        if isinstance(v, int):
            if v < 1:
                raise ValueError("need at least one seed")
            return v
        if not v:
            raise ValueError("empty list of seeds")
        if len(set(v)) != len(v):
            raise ValueError("seeds repeat")
        return v

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v):
        unknown = [m for m in v if m not in METRICS]
        if unknown:
            raise ValueError(f"unknown metric {unknown[0]!r} (known: {', '.join(METRICS)})")
        if not v:
            raise ValueError("no metrics to report")
        return v

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)
