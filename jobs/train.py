"""Train a model on the per-worker shards of a manifest: Horovod-on-Spark (default), Spark's
TorchDistributor, or local processes; any registered algorithm (--algorithm.name, parameters in
--algorithm.params; see docs/training.md and docs/decentralized.md). Writes metrics.jsonl,
summary.json and model.pt to the output directory and checkpoints next to it; prints the final
test accuracy. With --tracking.enabled true the run is also logged to MLflow (docs/studies.md)."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import train as summary_line
from pipeline.train.config import TrainConfig
from pipeline.studies.tracking import train_and_track
from pipeline.train.launch import plan_train


def main(argv=None) -> int:
    return run_job(argv, prog="train", description=__doc__, config_cls=TrainConfig, run=train_and_track,
                   plan=plan_train, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
