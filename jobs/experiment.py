"""Run a study: a grid of pipeline runs (cells x seeds) through the real stages and launchers,
resumable, with results.parquet, report.md (mean +- std, 95% CI, Welch's t-test against the
baseline cell), plots and MLflow tracking. Studies live in configs/experiments/*.yaml."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import experiment as summary_line
from pipeline.studies.runner import dry_run, run_study
from pipeline.studies.spec import StudyConfig


def main(argv=None) -> int:
    return run_job(argv, prog="experiment", description=__doc__, config_cls=StudyConfig, run=run_study,
                   plan=dry_run, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
