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
from .grid import REPO, _same, factors_match
from . import steps_page, time_claims
from .records import study_records
from .verdicts import VerdictSpec, judge, render_verdict

RESULTS = REPO / "results"
PAGE = REPO / "docs" / "results.md"
REGION = re.compile(r"(<!-- results-(table|verdict): ([A-Za-z0-9_.-]+) -->\n)(.*?)(<!-- /results-\2 -->)", re.S)


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
    verdict: Optional[VerdictSpec] = Field(None, description="the comparisons the verdict rests on (.verdicts)")


def load_spec(study: str, root: Path = RESULTS) -> TableSpec:
    f = root / study / "table.yaml"
    if not f.is_file():
        raise BadInputError(f"{f}: no table layout for study {study}")
    try:
        return TableSpec.model_validate(yaml.safe_load(f.read_text()))
    except Exception as e:  # noqa: BLE001 - pydantic or YAML: one line
        raise ConfigError(f"{f}: {' '.join(str(e).split())[:300]}") from None


def _metric(records: list[dict], metric: str) -> list[float]:
    out = []
    for r in records:
        v = r["metrics"].get(metric)
        if isinstance(v, (int, float)) and not math.isnan(v):
            out.append(float(v))
    return out


def _chosen(records: list[dict], spec: "TableSpec", row: Line, col: Line) -> tuple[list[dict], str, bool]:
    """The records a table cell holds; with ``best_by``, those of the study cell chosen, its name, and
    whether it is the first or last of the grid the cell chooses from (its ``any_of`` order)."""
    hits = [r for r in records if factors_match(r, {**row.where, **col.where}, {**row.any_of, **col.any_of})]
    if not spec.best_by or not hits:
        return hits, "", False
    cells: dict[str, list[dict]] = {}
    for r in hits:
        cells.setdefault(r["cell"], []).append(r)
    scored = [(sum(v) / len(v), c) for c, recs in cells.items() if (v := _metric(recs, spec.best_by))]
    if not scored:
        return [], "", False
    best = max(scored)[1]
    grid = {**row.any_of, **col.any_of}

    def position(cell: str) -> int:
        f = cells[cell][0].get("factors", {})
        return min((vs.index(next(v for v in vs if _same(f.get(k), v))) for k, vs in grid.items()
                    if any(_same(f.get(k), v) for v in vs)), default=0)

    order = sorted(cells, key=position)
    return cells[best], best, len(order) > 1 and best in (order[0], order[-1])


def _select(records: list[dict], spec: "TableSpec", row: Line, col: Line) -> tuple[list[float], str]:
    """The metric's values of the records a table cell holds, and (with ``best_by``) which study
    cell was chosen."""
    recs, best, _ = _chosen(records, spec, row, col)
    return _metric(recs, spec.metric), best


def _p(a: list[float], b: list[float], alternative: str) -> float:
    import warnings

    import numpy as np
    from scipy import stats

    if len(a) < 2 or len(b) < 2 or (np.std(a) == 0 and np.std(b) == 0):
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False, alternative=alternative).pvalue)


def _at_chance(spec: "TableSpec", vals: list[float]) -> tuple[list[float], int]:
    """(the values above chance, how many are at chance): runs that collapsed to chance are counted,
    never averaged into a mean that a test compares (``verdict.chance_below``, in the table's unit)."""
    below = spec.verdict.chance_below if spec.verdict else None
    if below is None:
        return vals, 0
    k = 100.0 if spec.percent else 1.0
    kept = [v for v in vals if k * v > below]
    return kept, len(vals) - len(kept)


def _ours(vals: list[float], percent: bool, chance: int = 0) -> str:
    if chance:
        more = f"{chance} more at chance" if vals else f"{chance} of {chance} at chance"
        return f"{_ours(vals, percent)[:-1]}; {more})" if vals else f"- ({more})"
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
    table, chance = {}, {}
    for r in spec.rows:
        for c in spec.columns:
            vals, chosen = _select(records, spec, r, c)
            kept, chance[(r.label, c.label)] = _at_chance(spec, vals)
            table[(r.label, c.label)] = (kept, chosen)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for i, row in enumerate(spec.rows):
        cells = [row.label]
        for c in spec.columns:
            vals, chosen = table[(row.label, c.label)]
            if c.source:
                cells.append(c.source[i] or "-")
            cells.append(_ours(vals, spec.percent, chance[(row.label, c.label)]) + (f" ({chosen})" if chosen else ""))
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


def _line(spec: TableSpec, label: str, rows: bool) -> Line:
    lines = spec.rows if rows else spec.columns
    hit = [x for x in lines if x.label == label]
    if not hit:
        raise ConfigError(f"verdict: {'row' if rows else 'column'} {label!r} is not in the table")
    return hit[0]


def best_is_last(rec: dict) -> bool:
    """Whether a run's best validation accuracy is its last validation (still rising at the end)."""
    vals = [r["accuracy"] for r in rec.get("curve", []) if r.get("split") == "val" and r.get("accuracy") is not None]
    return bool(vals) and vals[-1] >= max(vals)


def _cell_name(spec: TableSpec, row: str, col: str) -> str:
    r = f"{spec.row_header} = {row}" if spec.row_header and re.fullmatch(r"[\d.]+", row) else row
    return r if len(spec.columns) == 1 else f"{r}, {col}"


def verdict_facts(study: str, spec: TableSpec, records: list[dict]) -> list[str]:
    """The facts under a verdict, from the records: runs and seeds, the steps of each table cell,
    the runs at chance, and (``converged`` not ``ignore``) the runs still rising at their end."""
    k = 100.0 if spec.percent else 1.0
    v = spec.verdict
    seeds = sorted({r["seed"] for r in records})
    steps: dict[int, list[str]] = {}
    rising: list[str] = []
    n_rising = 0
    for row in spec.rows:
        for col in spec.columns:
            recs, _, _ = _chosen(records, spec, row, col)
            name = _cell_name(spec, row.label, col.label)
            for n in sorted({int(r["metrics"]["steps"]) for r in recs if isinstance(r["metrics"].get("steps"), (int, float))}):
                steps.setdefault(n, []).append(name)
            up = sum(best_is_last(r) for r in recs)
            if up:
                rising.append(f"{name} {up} of {len(recs)}")
                n_rising += up
    facts = [f"Runs: {len(records)} records in `results/{study}/`, seeds {seeds}. Steps per run: "
             + "; ".join(f"{n:,} in " + ", ".join(f"({c})" for c in cells) for n, cells in sorted(steps.items()))
             + "."]
    if v.chance_below is not None:
        chance: dict[str, list[str]] = {}
        for r in records:  # every run of the study, the cells the table does not show included
            x = r["metrics"].get(spec.metric)
            if isinstance(x, (int, float)) and k * x <= v.chance_below:
                chance.setdefault(r["cell"], []).append(f"seed {r['seed']}: {k * x:.2f}")
        listed = "; ".join(f"{cell} ({', '.join(xs)})" for cell, xs in chance.items())
        facts.append(f"Runs at chance (`{spec.metric}` at or below {v.chance_below:g}{'%' if spec.percent else ''}; "
                     f"left out of every mean and test above): {sum(map(len, chance.values()))} of {len(records)}"
                     + (f": {listed}." if listed else "."))
    if v.converged != "ignore":
        held = sum(len(_chosen(records, spec, r, c)[0]) for r in spec.rows for c in spec.columns)
        facts.append(f"Runs whose best validation accuracy is their last validation (still rising at the end of "
                     f"the budget): {n_rising} of {held}"
                     + (f" ({'; '.join(rising)})." if rising else "."))
    return facts


def render_verdict_region(study: str, root: Path = RESULTS) -> str:
    """The generated verdict of one study (:mod:`.verdicts`): the verdict line, the comparisons and
    the facts, from the records."""
    spec = load_spec(study, root)
    if spec.verdict is None:
        raise ConfigError(f"{root / study / 'table.yaml'}: no verdict block for the verdict region of {study}")
    records = study_records(root / study)
    k = 100.0 if spec.percent else 1.0
    v = spec.verdict
    results = []
    for c in v.comparisons:
        picked = []
        for w in (c.cell, c.against):
            recs, best, edge = _chosen(records, spec, _line(spec, w.row, True), _line(spec, w.column, False))
            picked.append((recs, best, edge))
        (ra, ba, ea), (rb, bb, eb) = picked
        edge = "; ".join(f"the best of {w.column}'s grid, {b.split(',')[0]}, is its edge" for w, b, e in
                         ((c.cell, ba, ea), (c.against, bb, eb)) if e)
        unconverged = None
        if v.converged == "required":
            ka, kb = sum(map(best_is_last, ra)), sum(map(best_is_last, rb))
            if ka * 2 > len(ra) or kb * 2 > len(rb):
                unconverged = (f"not converged: the best validation is the last in {ka} of {len(ra)} and "
                               f"{kb} of {len(rb)} runs")
        a = [k * x for x in _metric(ra, spec.metric)]
        b = [k * x for x in _metric(rb, spec.metric)]
        results.append(judge(a, b, c, v.chance_below, unconverged, edge or None))
    return render_verdict(study, results, verdict_facts(study, spec, records), "p.p." if spec.percent else "")


SOURCE_VALUE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:±|%)")


def _val_curve(rec: dict, k: float) -> dict[int, float]:
    return {int(r["step"]): k * float(r["accuracy"]) for r in rec.get("curve", [])
            if r.get("split") == "val" and r.get("accuracy") is not None}


def _line_data(label: str, recs: list[dict], k: float, source: Optional[str]) -> dict:
    """One line of a figure: the mean and standard deviation over the runs at each validation step
    (the steps every run has), and the source's number where it states one (``88.29 ± 0.51``, ``91.68%``)."""
    curves = [_val_curve(r, k) for r in recs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    mean, std = [], []
    for st in steps:
        xs = [c[st] for c in curves]
        m = sum(xs) / len(xs)
        mean.append(m)
        std.append(math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)
    hit = SOURCE_VALUE.match(source or "")
    return {"label": label, "n": len(recs), "steps": steps, "mean": mean, "std": std,
            "source": float(hit.group(1)) if hit else None}


def figure_data(study: str, root: Path = RESULTS) -> dict:
    """What a study's figure shows, from its records: one panel per table row (one panel for a table of
    one column, its rows the lines), one line per table cell; validation accuracy against steps. Runs
    at chance (``verdict.chance_below``) are left out of a line and counted in its label."""
    spec = load_spec(study, root)
    records = study_records(root / study)
    k = 100.0 if spec.percent else 1.0

    below = spec.verdict.chance_below if spec.verdict else None

    def line(row: Line, col: Line, label: str, source: Optional[str]) -> dict:
        recs, best, _ = _chosen(records, spec, row, col)
        kept = [r for r in recs if below is None or not isinstance(r["metrics"].get(spec.metric), (int, float))
                or k * r["metrics"][spec.metric] > below]   # runs at chance: counted, not averaged
        gone = len(recs) - len(kept)
        return _line_data(label + (f", {best.split(',')[0]}" if best else "") + (f"; {gone} at chance" if gone else ""),
                          kept, k, source)

    if len(spec.columns) == 1:
        col = spec.columns[0]
        panels = [{"title": f"{spec.row_header}: {col.label}".strip(": "),
                   "lines": [line(r, col, r.label, col.source[i] if col.source else None)
                             for i, r in enumerate(spec.rows)]}]
    else:
        panels = [{"title": r.label if "=" in r.label or not spec.row_header else f"{spec.row_header} = {r.label}",
                   "lines": [line(r, c, c.label, c.source[i] if c.source else None) for c in spec.columns]}
                  for i, r in enumerate(spec.rows)]
    return {"title": study, "ylabel": "validation accuracy" + (" (%)" if spec.percent else ""), "panels": panels}


def figure_path(page: Path, study: str) -> Path:
    return page.parent / "figures" / f"results_{study}.png"


def regenerate(page: Path = PAGE, root: Path = RESULTS) -> tuple[str, list[str]]:
    """(the page with every results-table and results-verdict region regenerated, the studies found).
    A table region ends with its study's figure (:func:`figure_data`, written by :func:`write_figures`)."""
    text = page.read_text()
    studies: list[str] = []

    def sub(m: re.Match) -> str:
        kind, study = m.group(2), m.group(3)
        if kind == "table":
            studies.append(study)
            fig = figure_path(page, study).relative_to(page.parent).as_posix()
            return (m.group(1) + render(study, root) + f"\n![{study}: validation accuracy against steps, mean and "
                    f"± one standard deviation over the seeds; stars: the source's values]({fig})\n" + m.group(5))
        return m.group(1) + render_verdict_region(study, root) + m.group(5)

    # + the results-steps and results-time regions
    return time_claims.regenerate(steps_page.regenerate(REGION.sub(sub, text), root, page), root), studies


def stale_figures(page: Path, root: Path, studies: list[str]) -> list[tuple[Path, dict]]:
    """The figures of ``studies`` whose committed PNG does not show what the records hold now."""
    from ..report.results_figures import digest, stored_digest

    out = []
    for study in studies:
        data = figure_data(study, root)
        path = figure_path(page, study)
        if stored_digest(path) != digest(data):
            out.append((path, data))
    return out + steps_page.stale_figures(page.read_text(), root, page)


def write_figures(stale: list[tuple[Path, dict]]) -> list[str]:
    from ..report.results_figures import draw

    return [str(draw(data, path)) if "panels" in data else steps_page.write_figures([(path, data)])[0]
            for path, data in stale]


class ResultsTablesConfig(StageConfig):
    """Config of ``jobs/results_tables.py``: regenerate the tables of the results page."""

    page: str = Field(str(PAGE), description="the page whose results-table regions are generated")
    results: str = Field(str(RESULTS), description="the records folder: <results>/<study>/table.yaml and the records")
    check: bool = Field(False, description="only check that the page is up to date (an error if not)")


def plan_tables(cfg: ResultsTablesConfig) -> dict:
    """``--dry-run``: the studies whose tables the page holds, and whether it is up to date."""
    page = Path(cfg.page)
    new, studies = regenerate(page, Path(cfg.results))
    stale = stale_figures(page, Path(cfg.results), studies)
    return {"page": str(page), "results": cfg.results, "studies": studies,
            "up_to_date": new == page.read_text() and not stale, "stale_figures": [str(p) for p, _ in stale]}


def results_tables(cfg: ResultsTablesConfig) -> dict:
    """Rewrite the page's tables from the records (or, with ``check``, fail in one line when the
    page is out of date)."""
    page = Path(cfg.page)
    if not page.is_file():
        raise BadInputError(f"results page not found: {page}")
    new, studies = regenerate(page, Path(cfg.results))
    current = new == page.read_text()
    stale = stale_figures(page, Path(cfg.results), studies)
    if cfg.check and not current:
        raise PipelineError(f"{page} is out of date with the records in {cfg.results}: run python -m jobs.results_tables")
    if cfg.check and stale:
        raise PipelineError(f"{stale[0][0]} is out of date with the records in {cfg.results}: run python -m "
                            f"jobs.results_tables")
    figures = write_figures(stale)
    if not current:
        page.write_text(new)
    return {"page": str(page), "studies": studies, "rewritten": not current or bool(figures), "figures": figures}
