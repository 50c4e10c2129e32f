"""Which algorithm, how many workers, on this cluster: a training config's model and data run under
the simulated clock of a modelled cluster (a preset, or a YAML file of cluster fields) for each
algorithm and worker count, until the target validation accuracy or the step budget; prints the
virtual time to the target, samples/s, the communication share, the bytes between nodes and the cost
per cell, and writes table.csv, table.json and whatif.png to --output (docs/training.md)."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import whatif as summary_line
from pipeline.studies.whatif import WhatIfConfig, plan_whatif, whatif


def main(argv=None) -> int:
    return run_job(argv, prog="whatif", description=__doc__, config_cls=WhatIfConfig, run=whatif,
                   plan=plan_whatif, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
