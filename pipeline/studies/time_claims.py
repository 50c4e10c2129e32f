"""The sources' time claims, answered from run records made under the simulated clock of the cluster
cost model (``train.cluster``; :mod:`pipeline.train.comm.costmodel`). The regions of docs/results.md
between ``<!-- results-time: <study> -->`` and ``<!-- /results-time -->`` are generated here from
``results/<study>/time.yaml`` and the study's records (``python -m jobs.results_tables``).

Two kinds of claim:

* ``scaling`` (Migliorini, Figure 4.2): the time per batch (``virtual_s_per_step``) of each series
  (an algorithm: the variants whose name starts with its ``prefix``; M from the record's config)
  against the sequential run (``sequential``: M = 1), and the speed-up
  ``M x t(1) / t(M)`` (his ``t(1) / t(n)`` for the same epochs at a fixed per-worker batch);
* ``time_to_target``: the virtual time to the study's target accuracy
  (``virtual_time_to_target_s``) per table cell (rows x columns of factor values), with comparisons
  of two cells.

**The rule** (the model is trusted to :data:`TOLERANCE`, the fidelity target of
``bench/cluster_model_fidelity.py``):

* a claim that a modelled ratio X is at least c **agrees** when X >= c x (1 + TOLERANCE), **disagrees**
  when X <= c / (1 + TOLERANCE), and is **not resolvable** within the model's error in between (at most
  c: mirrored); "almost constant" (a time per batch t(M) / t(1)) agrees within the tolerance of 1
  (at most 1 + TOLERANCE) and disagrees beyond it twice over ((1 + TOLERANCE)^2);
* a claim that cell A reaches the target sooner (later) than cell B: with every run of both cells at the
  target, it **agrees** when the ratio of mean times is beyond 1 by more than the tolerance in the claimed
  direction and Welch's one-tailed p < 0.05, **disagrees** when the same holds in the opposite direction,
  else **not resolvable**; a cell none of whose runs reached the target within the budget against one
  all of whose runs did is the slower one; other cells with runs short of the target are not resolvable.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInputError, ConfigError
from .grid import factors_match
from .records import study_records
from .verdicts import Where

SPEC = "time.yaml"
REGION = re.compile(r"(<!-- results-time: ([A-Za-z0-9_.-]+) -->\n)(.*?)(<!-- /results-time -->)", re.S)
#: the cluster model's fidelity target (bench/cluster_model_fidelity.py, docs/benchmarks.md): a predicted
#: time per step within 15% of the measured one
TOLERANCE = 0.15
#: the fidelity bench's scope: communication at least this share of the step
VALIDATED_COMM_SHARE = 0.30
ALPHA = 0.05


class Cells(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    where: dict[str, Any] = Field(default_factory=dict, description="factor values of the records it holds")
    target: Optional[float] = Field(None, gt=0, le=1, description="a row's own target accuracy (default: the spec's)")


class Series(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    prefix: str = Field(description="the variants of this series: their names start with it")
    decentralized: bool = False


class ScalingClaims(BaseModel):
    model_config = ConfigDict(extra="forbid")
    speedup_ratio: float = Field(description="the decentralized series' mean speed-up over the baseline series'")
    speedup_quote: str
    time_quote: str


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    cell: Where
    against: Where
    claim: Literal["sooner", "later"]
    source: str
    counted: bool = True


class TimeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["scaling", "time_to_target"]
    source: str
    # scaling
    sequential: Optional[Cells] = None
    series: list[Series] = Field(default_factory=list)
    baseline_series: Optional[str] = None
    claims: Optional[ScalingClaims] = None
    # time_to_target
    target: Optional[float] = Field(None, gt=0, le=1, description="validation accuracy whose first reach is timed "
                                                                  "(virtual seconds of the records' curves)")
    row_header: str = ""
    rows: list[Cells] = Field(default_factory=list)
    columns: list[Cells] = Field(default_factory=list)
    ratio_column: Optional[str] = Field(None, description="show computation : communication of this column's runs")
    comparisons: list[Comparison] = Field(default_factory=list)


def load_spec(study: str, root: Path) -> TimeSpec:
    f = root / study / SPEC
    if not f.is_file():
        raise BadInputError(f"{f}: no time-claim layout for study {study}")
    try:
        spec = TimeSpec.model_validate(yaml.safe_load(f.read_text()))
    except Exception as e:  # noqa: BLE001 - pydantic or YAML: one line
        raise ConfigError(f"{f}: {' '.join(str(e).split())[:300]}") from None
    if spec.kind == "time_to_target" and (spec.target is None or not spec.rows or not spec.columns):
        raise ConfigError(f"{f}: a time_to_target claim needs target, rows and columns")
    if spec.kind == "scaling" and (spec.sequential is None or not spec.series or spec.claims is None
                                   or spec.baseline_series not in [s.label for s in spec.series]):
        raise ConfigError(f"{f}: a scaling claim needs sequential, series, baseline_series (a series) and claims")
    return spec


# ----------------------------------------------------------------------------- helpers
def _vals(records: list[dict], metric: str) -> list[float]:
    out = []
    for r in records:
        v = r["metrics"].get(metric)
        out.append(float(v) if isinstance(v, (int, float)) else math.nan)
    return out


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _mean(xs: list[float]) -> float:
    xs = _finite(xs)
    return statistics.fmean(xs) if xs else math.nan


def _ms(xs: list[float]) -> str:
    xs = _finite(xs)
    if not xs:
        return "-"
    m = 1000 * statistics.fmean(xs)
    return f"{m:.3g} ± {1000 * statistics.stdev(xs):.2g}" if len(xs) > 1 else f"{m:.3g}"


def threshold_verdict(x: float, c: float, at_least: bool) -> str:
    """The rule for a modelled ratio ``x`` against a claimed bound ``c`` (module docstring)."""
    if math.isnan(x):
        return "not resolvable (no value)"
    k = 1 + TOLERANCE
    hi, lo = (x >= c * k, x <= c / k) if at_least else (x <= c / k, x >= c * k)
    if hi:
        return "agrees"
    if lo:
        return "disagrees"
    return f"not resolvable (within the model's {TOLERANCE:.0%} of {c:g})"


def constant_verdict(g: float) -> str:
    """'Almost constant' for a growth ``g`` = t(M) / t(1): agrees when it is within the model's tolerance of
    no growth (g <= 1 + TOLERANCE), disagrees when it grows beyond the tolerance twice over
    (g >= (1 + TOLERANCE)^2), else not resolvable."""
    if math.isnan(g):
        return "not resolvable (no value)"
    k = 1 + TOLERANCE
    if g <= k:
        return f"agrees (constant within the model's {TOLERANCE:.0%})"
    if g >= k * k:
        return "disagrees"
    return f"not resolvable (within twice the model's {TOLERANCE:.0%})"


def _workers(rec: dict) -> int:
    return int(rec["config"]["workers"])


# ----------------------------------------------------------------------------- scaling
def scaling_data(spec: TimeSpec, records: list[dict]) -> dict:
    """{"t1": seconds per batch at M = 1, "series": {label: {M: {"t": [...], "share": [...]}}}}."""
    seq = [r for r in records if factors_match(r, spec.sequential.where)]
    out: dict = {"t1": _mean(_vals(seq, "virtual_s_per_step")), "n1": len(seq), "series": {}}
    for s in spec.series:
        by_m: dict[int, dict] = {}
        for r in records:
            if str(r.get("factors", {}).get("variant", "")).startswith(s.prefix):
                d = by_m.setdefault(_workers(r), {"t": [], "share": []})
                d["t"] += _vals([r], "virtual_s_per_step")
                d["share"] += _vals([r], "comm_share")
        out["series"][s.label] = dict(sorted(by_m.items()))
    return out


def speedup(t1: float, m: int, t: list[float]) -> float:
    return m * t1 / _mean(t) if _finite(t) else math.nan


def render_scaling(study: str, spec: TimeSpec, records: list[dict]) -> str:
    d = scaling_data(spec, records)
    t1, ms = d["t1"], sorted({m for s in d["series"].values() for m in s})
    head = ["M"] + [f"{s.label} {x}" for s in spec.series for x in ("time per batch (ms)", "speed-up")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|",
             "| 1 | " + " | ".join(f"{1000 * t1:.3g} | 1" for _ in spec.series) + " |"]
    for m in ms:
        cells = [str(m)]
        for s in spec.series:
            e = d["series"][s.label].get(m)
            cells += [_ms(e["t"]), f"{speedup(t1, m, e['t']):.2f}"] if e else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    cl, base = spec.claims, d["series"][spec.baseline_series]
    rows = []
    for s in spec.series:
        if not s.decentralized:
            continue
        own = d["series"][s.label]
        both = [m for m in own if m in base]
        r = _mean([speedup(t1, m, own[m]["t"]) / speedup(t1, m, base[m]["t"]) for m in both])
        rows.append((f"{s.label}: scales better than {spec.baseline_series} (mean speed-up ratio over M = "
                     f"{', '.join(map(str, both))})", cl.speedup_quote, "more than 1x", f"{r:.2f}x",
                     threshold_verdict(r, 1.0, True)))
        rows.append((f"{s.label}: speed-up against {spec.baseline_series}'s, mean over M = "
                     f"{', '.join(map(str, both))}", cl.speedup_quote, f"at least {cl.speedup_ratio:g}x",
                     f"{r:.2f}x", threshold_verdict(r, cl.speedup_ratio, True)))
    m_max = max(ms) if ms else None
    for s in spec.series:
        e = d["series"][s.label].get(m_max)
        g = _mean(e["t"]) / t1 if e else math.nan
        if s.decentralized:
            rows.append((f"{s.label}: time per batch at M = {m_max} against M = 1", cl.time_quote,
                         "almost constant", f"{g:.2f}x", constant_verdict(g)))
        else:
            rows.append((f"{s.label}: time per batch at M = {m_max} against M = 1", cl.time_quote,
                         "increases (more than 1x)", f"{g:.2f}x", threshold_verdict(g, 1.0, True)))
    shares = _finite([x for s in d["series"].values() for e in s.values() for x in e["share"]])
    per_batch = []
    for s in spec.series:
        e = d["series"][s.label].get(m_max)
        if e:
            c = _mean([x * t for x, t in zip(e["share"], e["t"])])
            per_batch.append(f"{s.label} {1000 * c:.2g} ms")
    table = "\n".join(lines)
    return (table + "\n\n" + _verdict_block(rows, ("comparison", "source", "claim", "model", "verdict"))
            + "\n\n" + _facts(study, records, shares) + f" At M = {m_max}, communication per batch (the runs' "
            f"communication share x time per batch): {', '.join(per_batch)}; where an algorithm communicates on a "
            "thread of its own (AD-PSGD), that time overlaps its computation.")


# ----------------------------------------------------------------------------- time to target
def _target(spec: TimeSpec, row: str) -> float:
    r = next((x for x in spec.rows if x.label == row), None)
    return r.target if r is not None and r.target is not None else spec.target


def _cell(spec: TimeSpec, records: list[dict], row: str, col: str) -> list[dict]:
    r = next((x for x in spec.rows if x.label == row), None)
    c = next((x for x in spec.columns if x.label == col), None)
    if r is None or c is None:
        raise ConfigError(f"time claim: cell ({row!r}, {col!r}) is not in the table")
    return [x for x in records if factors_match(x, r.where) and factors_match(x, c.where)]


def time_to(rec: dict, target: float) -> float:
    """Virtual seconds of the first validation of ``rec``'s curve at or above ``target``; NaN if none."""
    from .results import time_to_target

    return time_to_target(rec.get("curve", []), target, clock="virtual_s")[0]


def _times(recs: list[dict], target: float) -> list[float]:
    return [time_to(r, target) for r in recs]


def _ttt(recs: list[dict], target: float) -> str:
    t = _times(recs, target)
    reached = _finite(t)
    if not recs:
        return "-"
    step = _mean(_vals(recs, "virtual_s_per_step"))
    per_step = "" if math.isnan(step) else f"; {1000 * step:.3g} ms/step"
    if not reached:
        return f"not reached (0 of {len(recs)}{per_step})"
    s = f"{statistics.fmean(reached):.3g}" + (f" ± {statistics.stdev(reached):.2g}" if len(reached) > 1 else "")
    return s + (f" ({per_step[2:]})" if len(reached) == len(recs) else
                f" ({len(reached)} of {len(recs)} reached{per_step})")


def judge_times(a: list[float], b: list[float], claim: str) -> tuple[str, float, float]:
    """(verdict, ratio of mean times a / b, one-tailed p in the claimed direction) by the module's rule;
    NaN in ``a`` or ``b``: a run that did not reach the target."""
    from .stats import welch_test

    ra, rb = _finite(a), _finite(b)
    if not a or not b:
        return "not resolvable (no runs)", math.nan, math.nan
    sooner = claim == "sooner"
    if not ra and len(rb) == len(b):
        return ("disagrees (never reached, the other always)" if sooner else "agrees (never reached, the other "
                "always)"), math.inf, math.nan
    if not rb and len(ra) == len(a):
        return ("agrees (the other never reached)" if sooner else "disagrees (the other never reached)"), 0.0, math.nan
    if len(ra) < len(a) or len(rb) < len(b):
        return (f"not resolvable ({len(ra)} of {len(a)} and {len(rb)} of {len(b)} runs reached the target)",
                math.nan, math.nan)
    ratio = statistics.fmean(ra) / statistics.fmean(rb)
    p = welch_test(ra, rb, "less" if sooner else "greater")
    p_opp = welch_test(ra, rb, "greater" if sooner else "less")
    k = 1 + TOLERANCE
    claimed = ratio <= 1 / k if sooner else ratio >= k
    opposite = ratio >= k if sooner else ratio <= 1 / k
    if claimed and p < ALPHA:
        return "agrees", ratio, p
    if opposite and p_opp < ALPHA:
        return f"disagrees (the opposite direction, p = {_p(p_opp)})", ratio, p
    why = (f"p = {_p(p)}" if claimed else f"the opposite direction at p = {_p(p_opp)}" if opposite
           else f"ratio within the model's {TOLERANCE:.0%}")
    return f"not resolvable ({why})", ratio, p


def _p(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def render_ttt(study: str, spec: TimeSpec, records: list[dict]) -> str:
    head = [spec.row_header] + [c.label for c in spec.columns]
    if spec.ratio_column:
        head.append(f"computation : communication ({spec.ratio_column})")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in spec.rows:
        cells = [r.label] + [_ttt(_cell(spec, records, r.label, c.label), _target(spec, r.label))
                             for c in spec.columns]
        if spec.ratio_column:
            share = _mean(_vals(_cell(spec, records, r.label, spec.ratio_column), "comm_share"))
            cells.append("-" if math.isnan(share) or share <= 0 else f"{(1 - share) / share:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    rows = []
    for c in spec.comparisons:
        a = _times(_cell(spec, records, c.cell.row, c.cell.column), _target(spec, c.cell.row))
        b = _times(_cell(spec, records, c.against.row, c.against.column), _target(spec, c.against.row))
        v, ratio, p = judge_times(a, b, c.claim)
        rows.append((c.label + ("" if c.counted else " (condition)"), c.source, c.claim,
                     f"{ratio:.2f}x" if math.isfinite(ratio) and ratio > 0 else "-", _p(p), v))
    shares = _finite(_vals(records, "comm_share"))
    return ("\n".join(lines) + "\n\nVirtual seconds to " + ("each row's target" if any(r.target for r in spec.rows) else
                                            f"{spec.target:.2%}") + " validation accuracy (mean ± sample standard "
            "deviation over the seeds; the first validation at or above it), and the virtual time per step."
            "\n\n" + _verdict_block(rows, ("comparison", "source", "claim", "time ratio (mean)", "p (claimed direction)",
                                           "verdict"), [c.counted for c in spec.comparisons])
            + "\n\n" + _facts(study, records, shares))


# ----------------------------------------------------------------------------- shared
def _verdict_block(rows: list[tuple], head: tuple, counted: Optional[list[bool]] = None) -> str:
    counted = counted or [True] * len(rows)
    words = [r[-1].split(" (")[0] for r, c in zip(rows, counted) if c]
    tally = {w: words.count(w) for w in ("agrees", "disagrees", "not resolvable") if words.count(w)}
    if len(tally) == 1:
        (w, n), = tally.items()
        line = f"**Verdict: {w} (all {n} comparisons).**"
    else:
        line = "**Verdict: " + ", ".join(f"{w} in {n}" for w, n in tally.items()) + f" of {len(words)} comparisons.**"
    out = [line + " Generated from the records by the rule of [the time claims](#time-claims-on-a-modelled-cluster)"
                  " (`.venv/bin/python -m jobs.results_tables`).", "",
           "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def _facts(study: str, records: list[dict], shares: list[float]) -> str:
    seeds = sorted({r["seed"] for r in records})
    steps = sorted({int(r["metrics"]["steps"]) for r in records if isinstance(r["metrics"].get("steps"), (int, float))
                    and not math.isnan(r["metrics"]["steps"])})
    profiles = sorted({str((r["config"].get("train", {}).get("cluster") or {}).get("compute_profile")) for r in records})
    inside = sum(1 for s in shares if s >= VALIDATED_COMM_SHARE)
    share = (f"communication is {min(shares):.0%} to {max(shares):.0%} of the ranks' virtual time; {inside} of "
             f"{len(shares)} runs at or above the fidelity bench's {VALIDATED_COMM_SHARE:.0%}") if shares else \
        "no communication share recorded"
    return (f"Runs: {len(records)} records in `results/{study}/`, seeds {seeds}, {', '.join(map(str, steps))} steps "
            f"per run; compute profile {', '.join(f'`{p}`' for p in profiles)}; {share}.")


def section(study: str, root: Path) -> str:
    spec = load_spec(study, root)
    records = study_records(root / study)
    if not records:
        raise BadInputError(f"{root / study}: no run records for the time claim")
    return (render_scaling if spec.kind == "scaling" else render_ttt)(study, spec, records) + "\n"


def regenerate(text: str, root: Path) -> str:
    """``text`` with every results-time region rewritten from the records."""
    return REGION.sub(lambda m: m.group(1) + section(m.group(2), root) + m.group(4), text)
