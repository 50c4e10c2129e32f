"""The tables of docs/results.md, generated from the run records (:mod:`.records`); no number in
them is typed by hand.

Each study with records has ``results/<study>/table.yaml``, the layout of its table beside the
source's::

    metric: val_accuracy          # the records' metric shown (mean ± sample std over the seeds, n)
    percent: true                 # shown x 100 with two decimals
    source: H&B                   # the source's name in the column headers
    row_header: L_W
    rows:                         # one row per line of the source's table: which cells it holds
      - {label: "32", where: {variant: LW32}}
    columns:                      # one column pair (source, ours) per column of the source's table
      - {label: "S_H = 8", where: {shard.household_shards: 8}, source: ["88.29 ± 0.51"]}
    test: {against: "S_H = 8", alternative: greater}   # optional: Welch's p of each other column
                                                        # against that one, per row (one-tailed when
                                                        # alternative is greater or less)

A region of docs/results.md between ``<!-- results-table: <study> -->`` and
``<!-- /results-table -->`` is replaced by the study's table. ``python -m jobs.results_tables``
rewrites the page; ``--check`` only says whether it is up to date (exit 1 if not).
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInputError, ConfigError, PipelineError
from .grid import REPO, _same
from .records import study_records

RESULTS = REPO / "results"
PAGE = REPO / "docs" / "results.md"
REGION = re.compile(r"(<!-- results-table: ([A-Za-z0-9_.-]+) -->\n)(.*?)(<!-- /results-table -->)", re.S)


class Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    where: dict[str, Any] = Field(default_factory=dict, description="factor values of the records it holds")
    source: list[Optional[str]] = Field(default_factory=list, description="the source's numbers, one per row")


class Test(BaseModel):
    model_config = ConfigDict(extra="forbid")
    against: str = Field(..., description="the column label every other column is tested against")
    alternative: Literal["two-sided", "greater", "less"] = "two-sided"


class TableSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str
    percent: bool = True
    source: str = "source"
    row_header: str = ""
    rows: list[Line]
    columns: list[Line]
    test: Optional[Test] = None


def load_spec(study: str, root: Path = RESULTS) -> TableSpec:
    f = root / study / "table.yaml"
    if not f.is_file():
        raise BadInputError(f"{f}: no table layout for study {study}")
    try:
        return TableSpec.model_validate(yaml.safe_load(f.read_text()))
    except Exception as e:  # noqa: BLE001 - pydantic or YAML: one line
        raise ConfigError(f"{f}: {' '.join(str(e).split())[:300]}") from None


def _matches(rec: dict, where: dict) -> bool:
    f = rec.get("factors", {})
    return all(k in f and _same(f[k], v) for k, v in where.items())


def _values(records: list[dict], metric: str, where: dict) -> list[float]:
    out = []
    for r in records:
        if _matches(r, where):
            v = r["metrics"].get(metric)
            if isinstance(v, (int, float)) and not math.isnan(v):
                out.append(float(v))
    return out


def _p(a: list[float], b: list[float], alternative: str) -> float:
    import warnings

    import numpy as np
    from scipy import stats

    if len(a) < 2 or len(b) < 2 or (np.std(a) == 0 and np.std(b) == 0):
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False, alternative=alternative).pvalue)


def _ours(vals: list[float], percent: bool) -> str:
    if not vals:
        return "not run yet"
    k = 100.0 if percent else 1.0
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return f"{k * m:.2f} (n = 1)"
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    return f"{k * m:.2f} ± {k * sd:.2f} (n = {len(vals)})"


def render(study: str, root: Path = RESULTS) -> str:
    """The markdown table of one study: the source's columns beside ours, from the records."""
    spec = load_spec(study, root)
    records = study_records(root / study)
    for c in spec.columns:
        if c.source and len(c.source) != len(spec.rows):
            raise ConfigError(f"{root / study / 'table.yaml'}: column {c.label!r} has {len(c.source)} source "
                              f"numbers for {len(spec.rows)} rows")
    header = [spec.row_header or ""]
    for c in spec.columns:
        if c.source:
            header.append(f"{spec.source} {c.label}")
        header.append(f"ours {c.label}")
    tested = [c for c in spec.columns if spec.test and c.label != spec.test.against]
    if spec.test:
        if spec.test.against not in [c.label for c in spec.columns]:
            raise ConfigError(f"{root / study / 'table.yaml'}: test.against {spec.test.against!r} is not a column")
        side = "" if spec.test.alternative == "two-sided" else ", one-tailed"
        header += [f"p ({c.label} vs {spec.test.against}{side})" for c in tested]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for i, row in enumerate(spec.rows):
        cells = [row.label]
        vals = {}
        for c in spec.columns:
            vals[c.label] = _values(records, spec.metric, {**row.where, **c.where})
            if c.source:
                cells.append(c.source[i] or "-")
            cells.append(_ours(vals[c.label], spec.percent))
        for c in tested:
            p = _p(vals[c.label], vals[spec.test.against], spec.test.alternative)
            cells.append("-" if math.isnan(p) else f"{p:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in records})
    note = (f"Generated from {len(records)} run record(s) in `results/{study}/` (metric `{spec.metric}`"
            f"{', in %' if spec.percent else ''}; seeds {seeds}) by `python -m jobs.results_tables`.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def regenerate(page: Path = PAGE, root: Path = RESULTS) -> tuple[str, list[str]]:
    """(the page with every results-table region regenerated, the studies found)."""
    text = page.read_text()
    studies: list[str] = []

    def sub(m: re.Match) -> str:
        studies.append(m.group(2))
        return m.group(1) + render(m.group(2), root) + m.group(4)

    return REGION.sub(sub, text), studies


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="results_tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check that the page is up to date (exit 1 if not)")
    ap.add_argument("--page", default=str(PAGE), help="the page (default docs/results.md)")
    ap.add_argument("--results", default=str(RESULTS), help="the records folder (default results/)")
    a = ap.parse_args(argv)
    page = Path(a.page)
    try:
        new, studies = regenerate(page, Path(a.results))
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if a.check:
        if new != page.read_text():
            print(f"results_tables: {page} is out of date with {a.results}: run python -m jobs.results_tables")
            return 1
        print(f"results_tables: {page} is up to date ({len(studies)} tables)")
        return 0
    if new != page.read_text():
        page.write_text(new)
    print(f"results_tables: {len(studies)} tables in {page} ({', '.join(studies)})")
    return 0
