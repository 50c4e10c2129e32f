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
                                                        # alternative is greater or less); or
                                                        # against_row: a row, per column
    best_by: val_accuracy        # optional: a table cell holding several study cells (a rate grid)
                                 # shows the one with the best mean of this metric, named

A row or column may also select with ``any_of: {factor: [values]}``.

A region of docs/results.md between ``<!-- results-table: <study> -->`` and
``<!-- /results-table -->`` is replaced by the study's table. ``python -m jobs.results_tables``
rewrites the page; ``--set check=true`` only checks that it is up to date (one line and exit 2 if not).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ..config import StageConfig
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
    any_of: dict[str, list[Any]] = Field(default_factory=dict, description="factor -> the values it may take")
    source: list[Optional[str]] = Field(default_factory=list, description="the source's numbers, one per row")


class Test(BaseModel):
    model_config = ConfigDict(extra="forbid")
    against: Optional[str] = Field(None, description="the column every other column is tested against, per row")
    against_row: Optional[str] = Field(None, description="the row every other row is tested against, per column")
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
    best_by: Optional[str] = Field(None, description="where a table cell holds several study cells (e.g. a rate "
                                                     "grid), show the one with the highest mean of this metric")


def load_spec(study: str, root: Path = RESULTS) -> TableSpec:
    f = root / study / "table.yaml"
    if not f.is_file():
        raise BadInputError(f"{f}: no table layout for study {study}")
    try:
        return TableSpec.model_validate(yaml.safe_load(f.read_text()))
    except Exception as e:  # noqa: BLE001 - pydantic or YAML: one line
        raise ConfigError(f"{f}: {' '.join(str(e).split())[:300]}") from None


def _matches(rec: dict, where: dict, any_of: dict) -> bool:
    f = rec.get("factors", {})
    return all(k in f and _same(f[k], v) for k, v in where.items()) and \
        all(k in f and any(_same(f[k], v) for v in vs) for k, vs in any_of.items())


def _metric(records: list[dict], metric: str) -> list[float]:
    out = []
    for r in records:
        v = r["metrics"].get(metric)
        if isinstance(v, (int, float)) and not math.isnan(v):
            out.append(float(v))
    return out


def _select(records: list[dict], spec: "TableSpec", row: Line, col: Line) -> tuple[list[float], str]:
    """The metric's values of the records a table cell holds, and (with ``best_by``) which study
    cell was chosen."""
    hits = [r for r in records if _matches(r, {**row.where, **col.where}, {**row.any_of, **col.any_of})]
    if not spec.best_by or not hits:
        return _metric(hits, spec.metric), ""
    cells: dict[str, list[dict]] = {}
    for r in hits:
        cells.setdefault(r["cell"], []).append(r)
    scored = [(sum(v) / len(v), c) for c, recs in cells.items() if (v := _metric(recs, spec.best_by))]
    if not scored:
        return [], ""
    best = max(scored)[1]
    return _metric(cells[best], spec.metric), best


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
    test = spec.test
    side = "" if test is None or test.alternative == "two-sided" else ", one-tailed"
    tested = [c for c in spec.columns if test and test.against and c.label != test.against]
    if test and test.against and test.against not in [c.label for c in spec.columns]:
        raise ConfigError(f"{root / study / 'table.yaml'}: test.against {test.against!r} is not a column")
    if test and test.against_row and test.against_row not in [r.label for r in spec.rows]:
        raise ConfigError(f"{root / study / 'table.yaml'}: test.against_row {test.against_row!r} is not a row")
    header += [f"p ({c.label} vs {test.against}{side})" for c in tested]
    if test and test.against_row:
        header += [f"p (vs {test.against_row}{side})" + (f", {c.label}" if len(spec.columns) > 1 else "")
                   for c in spec.columns]
    table = {(r.label, c.label): _select(records, spec, r, c) for r in spec.rows for c in spec.columns}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for i, row in enumerate(spec.rows):
        cells = [row.label]
        for c in spec.columns:
            vals, chosen = table[(row.label, c.label)]
            if c.source:
                cells.append(c.source[i] or "-")
            cells.append(_ours(vals, spec.percent) + (f" ({chosen})" if chosen else ""))
        for c in tested:
            p = _p(table[(row.label, c.label)][0], table[(row.label, test.against)][0], test.alternative)
            cells.append("-" if math.isnan(p) else f"{p:.3g}")
        if test and test.against_row:
            for c in spec.columns:
                p = math.nan if row.label == test.against_row else \
                    _p(table[(row.label, c.label)][0], table[(test.against_row, c.label)][0], test.alternative)
                cells.append("-" if math.isnan(p) else f"{p:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in records})
    note = (f"Generated from {len(records)} run record(s) in `results/{study}/` (metric `{spec.metric}`"
            f"{', in %' if spec.percent else ''}; seeds {seeds}) by `.venv/bin/python -m jobs.results_tables`.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def regenerate(page: Path = PAGE, root: Path = RESULTS) -> tuple[str, list[str]]:
    """(the page with every results-table region regenerated, the studies found)."""
    text = page.read_text()
    studies: list[str] = []

    def sub(m: re.Match) -> str:
        studies.append(m.group(2))
        return m.group(1) + render(m.group(2), root) + m.group(4)

    return REGION.sub(sub, text), studies


class ResultsTablesConfig(StageConfig):
    """Config of ``jobs/results_tables.py``: regenerate the tables of the results page."""

    page: str = Field(str(PAGE), description="the page whose results-table regions are generated")
    results: str = Field(str(RESULTS), description="the records folder: <results>/<study>/table.yaml and the records")
    check: bool = Field(False, description="only check that the page is up to date (an error if not)")


def plan_tables(cfg: ResultsTablesConfig) -> dict:
    """``--dry-run``: the studies whose tables the page holds, and whether it is up to date."""
    page = Path(cfg.page)
    new, studies = regenerate(page, Path(cfg.results))
    return {"page": str(page), "results": cfg.results, "studies": studies, "up_to_date": new == page.read_text()}


def results_tables(cfg: ResultsTablesConfig) -> dict:
    """Rewrite the page's tables from the records (or, with ``check``, fail in one line when the
    page is out of date)."""
    page = Path(cfg.page)
    if not page.is_file():
        raise BadInputError(f"results page not found: {page}")
    new, studies = regenerate(page, Path(cfg.results))
    current = new == page.read_text()
    if cfg.check and not current:
        raise PipelineError(f"{page} is out of date with the records in {cfg.results}: run python -m jobs.results_tables")
    if not current:
        page.write_text(new)
    return {"page": str(page), "studies": studies, "rewritten": not current}
