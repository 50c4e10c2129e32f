"""Shard a Parquet dataset for data-parallel training: one Parquet directory per worker
(disjoint, full overlap, coarse, medium-coarse, fine-grained, households or neighbourhoods
layout), the eval splits, and manifest.json, written in one Spark pass."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import shard as summary_line
from pipeline.shards.materialize import ShardConfig, plan_shard, shard


def main(argv=None) -> int:
    return run_job(argv, prog="shard", description=__doc__, config_cls=ShardConfig, run=shard,
                   plan=plan_shard, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
