"""Generate ttbar / W+jets / QCD events with Pythia 8, run the particle-level detector model and
write Delphes-layout ROOT files (tree `Delphes`) plus a sidecar simulation.json (settings, seeds,
filter efficiencies), as Spark tasks. See docs/simulation.md."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import simulate as summary_line
from pipeline.simulate.config import SimulateConfig
from pipeline.simulate.stage import generate, plan_generate


def main(argv=None) -> int:
    return run_job(argv, prog="simulate", description=__doc__, config_cls=SimulateConfig,
                   run=generate, plan=plan_generate, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
