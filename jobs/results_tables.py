"""Generate the tables of docs/results.md from the run records under results/ (no number typed by
hand); --set check=true only checks that the page is up to date."""
import sys

from pipeline.cli import run_job
from pipeline.summaries import results_tables as summary_line
from pipeline.studies.tables import ResultsTablesConfig, plan_tables, results_tables


def main(argv=None) -> int:
    return run_job(argv, prog="results_tables", description=__doc__, config_cls=ResultsTablesConfig,
                   run=results_tables, plan=plan_tables, default_config=None, summary=summary_line)


if __name__ == "__main__":
    sys.exit(main())
