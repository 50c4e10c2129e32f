"""Ingest ROOT files (any TTree) into Parquet or a Delta table on Spark: chunks planned on the driver, read with
uproot in the tasks; bad files are reported in <output>/_report.json (exit 2 unless --allow_bad_files)."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import ingest_root as summary_line
from pipeline.ingest.root import IngestRootConfig, ingest_root, plan_ingest_root


def main(argv=None) -> int:
    return run_job(argv, prog="ingest_root", description=__doc__, config_cls=IngestRootConfig,
                   run=ingest_root, plan=plan_ingest_root, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
