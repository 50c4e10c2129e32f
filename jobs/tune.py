"""Hyperparameter search: Optuna (grid, random or TPE) proposes single-worker trainings, Spark runs
them in parallel as tasks, every trial is logged to MLflow, and the best training config is
written as a YAML for `jobs/train.py --config`. Search spaces live in configs/tune/*.yaml."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import tune as summary_line
from pipeline.studies.tune import TuneConfig, plan_tune, tune


def main(argv=None) -> int:
    return run_job(argv, prog="tune", description=__doc__, config_cls=TuneConfig, run=tune, plan=plan_tune,
                   default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
