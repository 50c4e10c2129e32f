"""The steps-to-result section of docs/results.md (:mod:`.steps_to_result` is the analysis): per
workload the steps table, each curve's regimes and doublings, the verdict rows, the warm-up row and the
log-log figure, written into the page's ``<!-- results-steps: <study> ... -->`` regions by
``jobs.results_tables``, from each study's records and its ``steps.yaml``."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import yaml

from ..errors import BadInputError
from .records import study_records
from .steps_to_result import (DIMINISHING, FLAT, GAP, PERFECT, Z_ONE, curves, family, is_tuned, normalised,
                              run_settings, verdicts)

_SHORT = {PERFECT: "perfect", DIMINISHING: "diminishing", FLAT: "no benefit",
          GAP: "not classified: batches between not run"}


def _pm(se: Optional[float]) -> str:
    return " ± ?" if se is None else f" ± {Z_ONE * se:.2f}"


def _fmt_lr(v: float) -> str:
    return f"{v:g}"


def render(workload: str, records: list[dict], targets: list[float], grid_step: float) -> str:
    """The markdown of one workload: per target, the steps table and the regimes, then the verdicts."""
    cs = curves(workload, records, targets)
    lines = []
    batches = sorted({run_settings(r)[0] for r in records})
    for t in targets:
        sub = {c.family: c for c in cs if c.target == t}
        lines += [f"Steps to validation error {t:g} ({workload}; {len(records)} runs; the best setting per batch; "
                  "/ B_min: steps over the steps at the smallest batch with a point):", "",
                  "| B | SGD steps | SGD / B_min | SGD lr | momentum steps | momentum / B_min | lr, momentum |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        norm = {f: normalised(c.points) for f, c in sub.items()}
        for b in batches:
            row = [str(b)]
            for f in ("sgd", "momentum"):
                p = sub[f].points.get(b)
                if p is None:
                    ran = len({run_settings(r) for r in records if is_tuned(r) and run_settings(r)[0] == b
                               and family(run_settings(r)[2]) == f})
                    row += [f"not reached ({ran} setting{'s' if ran > 1 else ''} run)" if ran else "not run", "", ""]
                else:
                    of = f" (best of {p.runs})" if p.runs > 1 else " (1 setting run)"
                    row += [f"{p.steps:.4g}" + (f" (n = {p.seeds})" if p.seeds > 1 else ""), f"{norm[f][b]:.3g}",
                            (_fmt_lr(p.lr) if f == "sgd" else f"{_fmt_lr(p.lr)}, {p.momentum:g}") + of]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        if not records:
            lines.append("No run recorded yet.")
        for f in ("sgd", "momentum"):
            r = sub[f].regimes
            if not sub[f].points:
                continue
            if len(sub[f].points) < 2:
                lines.append(f"- {f}: one batch with a point; no doubling to classify yet")
                continue
            ge = ">= " if r.max_useful_ge else ""
            perfect = (f"perfect scaling up to B = {r.perfect_until}" if r.perfect_until > min(sub[f].points)
                       else f"no doubling of perfect scaling from B = {r.perfect_until}")
            lines.append(f"- {f}: {perfect}; "
                         f"maximum useful batch {ge}{r.max_useful}; "
                         "doublings (local slope of log2 steps against log2 B, ± its 95 % half-width over the "
                         "seeds): " + ", ".join(
                             f"{lo}->{hi} {'not reached' if s is None else f'{s:+.2f}' + _pm(se)} ({_SHORT[c]})"
                             for (lo, hi, s, c), se in zip(r.doublings, r.ses))
                         + ("" if r.ordered else "; the classes go back"
                            + (" beyond these intervals" if r.back_resolved else " within these intervals")))
        lines.append("")
    return "\n".join(lines)


# --- the page: docs/results.md regions <!-- results-steps: <study> <study> ... --> ------------------

#: a region of the results page that holds the steps-to-result section of the studies it names
REGION = re.compile(r"(<!-- results-steps: ([A-Za-z0-9_.\- ]+) -->\n)(.*?)(<!-- /results-steps -->)", re.S)
#: per study, next to its records: {workload: <label>, targets: [errors], grid_step: <rate grid factor>}
SPEC = "steps.yaml"
#: the suffix of a workload's study of Goyal's linear scaling with and without gradual warm-up (its own
#: table and verdict: ``results/<study>_warmup/table.yaml``)
WARMUP = "_warmup"


def load(study: str, root: Path) -> tuple[str, list[float], float, list[dict]]:
    """(workload label, target errors, rate grid step, records) of one study's records folder."""
    path = root / study / SPEC
    if not path.is_file():
        raise BadInputError(f"{path}: not found (the steps-to-result study's workload and targets)")
    spec = yaml.safe_load(path.read_text()) or {}
    try:
        label, targets, step = str(spec["workload"]), [float(t) for t in spec["targets"]], float(spec["grid_step"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"{path}: needs workload, targets (a list of errors) and grid_step ({e})") from None
    return label, targets, step, study_records(root / study)


def figure_data(studies: list[str], root: Path) -> dict:
    lines = []
    for study in studies:
        label, targets, _, records = load(study, root)
        for c in curves(label, records, targets):
            n = normalised(c.points)
            lines.append({"label": f"{label}, {c.family}, error {c.target:g}",
                          "batches": sorted(n), "normalised": [n[b] for b in sorted(n)]})
    return {"title": "steps to a target validation error against the batch (best setting per batch)",
            "lines": lines}


def figure_path(page: Path, studies: list[str]) -> Path:
    return page.parent / "figures" / f"results_{studies[0]}.png"


def section(studies: list[str], root: Path, page: Path) -> str:
    parts, cs, step, labels = [], [], None, {}
    for study in studies:
        label, targets, step, records = load(study, root)
        labels[study] = label
        cs += curves(label, records, targets)
        parts.append(f"**{label}** (`{study}`)\n\n" + render(label, records, targets, step))
    rows = ["| claim (Bonet, Wang & Tang) | verdict | by the rule in `pipeline/studies/steps_to_result.py` |",
            "| --- | --- | --- |"]
    rows += [f"| {c} | {v} | {why} |" for c, v, why in verdicts(cs, step or 3.16)]
    warm = [(labels[s], f"{s}{WARMUP}") for s in studies]
    ran = {w: any((root / w).glob("*/seed_*.json")) for _, w in warm}      # a record, without reading them all
    rows.append("| linear scaling with gradual warm-up (Goyal: 8k 23.74 ± 0.09 against 24.84 ± 0.37 without) | "
                "below | " + "; ".join(f"{label}: " + (f"`{w}`, its verdict below" if ran[w] else "not run")
                                       for label, w in warm) + " |")
    fig = figure_path(page, studies).relative_to(page.parent).as_posix()
    return ("\n".join(parts) + "\n" + "\n".join(rows) + "\n\n"
            f"![steps to the target against the batch, log-log, normalised by the smallest batch]({fig})\n")


def regenerate(text: str, root: Path, page: Path) -> str:
    """``text`` with every results-steps region rewritten from the records."""
    return REGION.sub(lambda m: m.group(1) + section(m.group(2).split(), root, page) + m.group(4), text)


def stale_figures(text: str, root: Path, page: Path) -> list[tuple[Path, dict]]:
    """The figures of the page's results-steps regions whose PNG does not show the records' data."""
    from ..report.results_figures import digest, stored_digest

    out = []
    for m in REGION.finditer(text):
        studies = m.group(2).split()
        data = figure_data(studies, root)
        path = figure_path(page, studies)
        if stored_digest(path) != digest(data):
            out.append((path, data))
    return out


def write_figures(stale: list[tuple[Path, dict]]) -> list[str]:
    from ..report.steps_figure import draw

    return [str(draw(data, path)) for path, data in stale]
