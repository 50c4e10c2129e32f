"""The training plan: what every worker of a run follows, computed once on the driver.

``launch.make_plan`` checks the inputs and fills it; the launcher passes it to every worker
(as a dict, so it travels through any launcher), and the worker validates it with
:class:`TrainingPlan` before building anything. Every integer a worker needs is here, so all
ranks take the same decisions without talking.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainingPlan(BaseModel):
    """The plan of one training run (the JSON Schema is published under ``schemas/contracts/``)."""

    model_config = ConfigDict(extra="forbid")
    workers: int = Field(ge=1, description="number of workers M (= the manifest's worker shards)")
    features: str = Field(description="input the model reads: image | hlf | llf | inclusive")
    num_classes: int = Field(ge=2, description="classes of the classifier")
    shape: Optional[dict[str, Any]] = Field(None, description="input shape probed from the first shard (images)")
    copies: int = Field(ge=1, description="copies C of each training sample in the layout")
    steps_per_epoch: int = Field(ge=1, description="steps of one pass over a shard: min over workers of rows // b")
    overlap_epochs: int = Field(ge=1, description="passes over each shard: ceil(E_target / C)")
    total_steps: int = Field(ge=1, description="steps of the run (every worker, step-driven schedule)")
    eval_every: int = Field(ge=1, description="validation every this many steps")
    epoch_steps: int = Field(ge=1, description="steps of one global epoch: ceil(N / B_global)")
    warmup_steps: int = Field(ge=0, description="gradual learning-rate warmup, in steps")
    global_batch: int = Field(ge=1, description="B_global = M * b")
    batch_size: int = Field(ge=1, description="a worker's batch b (the config's batch_rule applied)")
    lr_factor: float = Field(gt=0, description="the base rate's scale after the warmup (lr_scaling)")
    decay_steps: list[int] = Field(default_factory=list, description="steps at which step decay applies")
    n_train_samples: int = Field(ge=1, description="training samples N")
    scaling: Optional[str] = Field(None, description="scaling.json of the HEP features (None for images)")
    eval: dict[str, str] = Field(description="split name -> Parquet directory (test is required)")
    manifest: str = Field(description="the shard manifest.json")
    resume_from: Optional[str] = Field(None, description="checkpoint directory every rank restores (None: fresh)")

    @model_validator(mode="after")
    def _consistent(self) -> "TrainingPlan":
        if "test" not in self.eval:
            raise ValueError("eval has no test split")
        if self.global_batch != self.batch_size * self.workers:
            raise ValueError(f"global_batch={self.global_batch} is not batch_size * workers "
                             f"({self.batch_size} * {self.workers})")
        return self
