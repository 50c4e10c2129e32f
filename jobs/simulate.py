"""Generate ttbar / W+jets / QCD events with Pythia 8, run the particle-level detector model and
write Delphes-layout ROOT files (tree `Delphes`) plus a sidecar simulation.json (settings, seeds,
filter efficiencies), as Spark tasks. See docs/simulate.md."""
import sys

from pipeline.cli import run_job
from pipeline.simulate.config import SimulateConfig


def _generate(cfg):
    from pipeline.simulate.stage import generate

    return generate(cfg)


def _plan(cfg):
    from pipeline.simulate.stage import plan_generate

    return plan_generate(cfg)


def main(argv=None) -> int:
    return run_job(argv, prog="simulate", description=__doc__, config_cls=SimulateConfig,
                   run=_generate, plan=_plan, default_config=None)


if __name__ == "__main__":
    sys.exit(main())
