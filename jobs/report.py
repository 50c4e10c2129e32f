"""Plot learning curves (accuracy against epochs and against wall time, one line per run)
from training output directories to a PNG."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import report as summary_line
from pipeline.report.curves import ReportConfig, plan_report, report


def main(argv=None) -> int:
    return run_job(argv, prog="report", description=__doc__, config_cls=ReportConfig, run=report,
                   plan=plan_report, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
