"""Generate the tables of docs/results.md from the run records under results/ (no number typed by
hand); --check only says whether the page is up to date."""
import sys

from pipeline.studies.tables import main

if __name__ == "__main__":
    sys.exit(main())
