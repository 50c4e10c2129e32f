"""The HEP pipeline end to end (the main job of `make run`): generate ttbar / W+jets / QCD events with
Pythia 8 -> ingest ROOT -> HLF/LLF features -> shard -> train the HLF classifier on Horovod-on-Spark ->
one-line summary with the test accuracy and the per-class one-vs-rest ROC AUC."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import run_hep as summary_line
from pipeline.workflows import HepRunConfig, plan_run_hep, run_hep


def main(argv=None) -> int:
    return run_job(argv, prog="run_hep", description=__doc__, config_cls=HepRunConfig,
                   run=run_hep, plan=plan_run_hep, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
