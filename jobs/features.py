"""Delphes event selection and HLF/LLF features on Spark: writes <output>/hlf, <output>/llf,
<output>/scaling.json (fitted on train) and <output>/report.json (per file: read, selected, written)."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import features as summary_line
from pipeline.features.stage import FeaturesConfig, build_features, plan_features


def main(argv=None) -> int:
    return run_job(argv, prog="features", description=__doc__, config_cls=FeaturesConfig,
                   run=build_features, plan=plan_features, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
