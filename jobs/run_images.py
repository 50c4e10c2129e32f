"""The image slice end to end: ingest images -> shard for N workers -> train (Horovod-on-Spark by
default) -> one-line summary with the test accuracy. `make run-images` runs it."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import run_images as summary_line
from pipeline.workflows import ImagesRunConfig, plan_run_images, run_images


def main(argv=None) -> int:
    return run_job(argv, prog="run_images", description=__doc__, config_cls=ImagesRunConfig,
                   run=run_images, plan=plan_run_images, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
