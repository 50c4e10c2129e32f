"""The verdicts of docs/results.md, generated from the run records by one rule (:func:`judge`); no
verdict word and no number of a verdict is typed by hand.

A study's ``results/<study>/table.yaml`` (:mod:`.tables`) may hold a ``verdict`` block::

    verdict:
      chance_below: 20          # % of the metric: a run at or below it collapsed to chance
      converged: required       # required | report | ignore: runs whose best validation is the last
      comparisons:
        - label: "H = 4 against the baseline"
          cell: {row: "H = 4, L_W = 128", column: "val. accuracy"}      # a table cell ...
          against: {row: "AR-SGD, M = 16 (baseline)", column: "val. accuracy"}   # ... against another
          claim: effect         # effect | direction | none (see below)
          source: "0.75 p.p. below (Section 5.3.2)"   # the source's words, shown
          source_effect: -0.75  # the source's difference (cell - against) in the metric's unit (p.p.)
          alternative: less     # optional; default: the sign of source_effect, two-sided for none
          role: claim           # claim | condition (shown, not counted in the verdict)

The rule (:func:`judge`), on the runs of the two table cells:

1. Runs at or below ``chance_below`` are counted and left out; with fewer than two runs left on a side
   the comparison is **not resolvable** (the runs collapsed).
2. A table cell chosen from a grid (``best_by``) whose best setting is the first or last of its grid
   is **not resolvable**: the optimum is not bracketed.
3. ``converged: required``: a cell in which most runs have their best validation at the last one has
   not converged, and a claim about the converged accuracy is **not resolvable** at this budget.
4. ``effect`` (the source claims a difference of that size) or ``direction`` (its sign only):
   **disagrees** when the source's effect (``direction``: zero) lies outside our one-sided 95% interval
   of the difference, or our difference is opposite to the source's at p < 0.05 (one-tailed);
   **agrees** when our difference has the source's direction at p < 0.05 (one-tailed, H&B's
   convention); otherwise **not resolvable**, with the power of our test for the source's effect.
5. ``none`` (the source finds no significant difference): **disagrees** when ours is significant at
   p < 0.05 (two-sided; with an ``alternative``, one-tailed in either direction); **agrees** when our test had power >= 0.8 for the source's effect;
   otherwise **not resolvable**, with that power.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from .stats import one_sided_bound, welch_parts, welch_power, welch_test

ALPHA = 0.05
POWER = 0.8
AGREES, DISAGREES, UNRESOLVED = "agrees", "disagrees", "not resolvable"


class Where(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: str
    column: str


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    cell: Where
    against: Where
    claim: Literal["effect", "direction", "none"]
    source: str = Field(description="the source's words or numbers for this comparison")
    source_effect: float = Field(description="the source's difference, cell - against, in the table's unit")
    alternative: Optional[Literal["two-sided", "greater", "less"]] = None
    role: Literal["claim", "condition"] = "claim"

    def test_alternative(self) -> str:
        if self.alternative:
            return self.alternative
        if self.claim == "none" or self.source_effect == 0:
            return "two-sided"
        return "greater" if self.source_effect > 0 else "less"


class VerdictSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chance_below: Optional[float] = Field(None, description="a run at or below this (table unit) is at chance")
    converged: Literal["required", "report", "ignore"] = "ignore"
    comparisons: list[Comparison]


def _opposite(alternative: str) -> str:
    return {"greater": "less", "less": "greater"}.get(alternative, "two-sided")


def _outside(effect: float, bound: float, alternative: str) -> bool:
    """Whether ``effect`` lies outside the one-sided interval that ends at ``bound``."""
    return alternative == "greater" and effect > bound or alternative == "less" and effect < bound


def judge(a: list[float], b: list[float], c: Comparison, chance_below: Optional[float] = None,
          unconverged: Optional[str] = None, edge: Optional[str] = None) -> dict:
    """The verdict of one comparison (module docstring), with every number it rests on. ``a``, ``b``:
    the runs' values (table unit) of the cell and of the one it is tested against; ``unconverged`` /
    ``edge``: why the cells cannot answer the claim (rules 3 and 2), or None."""
    alt = c.test_alternative()
    keep_a = [v for v in a if chance_below is None or v > chance_below]
    keep_b = [v for v in b if chance_below is None or v > chance_below]
    out: dict[str, Any] = {"comparison": c, "alternative": alt, "n": (len(a), len(b)),
                           "collapsed": (len(a) - len(keep_a), len(b) - len(keep_b)),
                           "diff": math.nan, "bound": math.nan, "p": math.nan, "p_opposite": math.nan,
                           "power": math.nan, "verdict": UNRESOLVED, "why": ""}
    if len(keep_a) < 2 or len(keep_b) < 2:
        if not a or not b:
            out["why"] = "not run yet"
        elif keep_a == a and keep_b == b:
            out["why"] = f"fewer than 2 runs in a cell: {len(a)} and {len(b)}"
        else:
            out["why"] = "runs at chance"
        return out
    d, _, _ = welch_parts(keep_a, keep_b)
    out.update(diff=d, p=welch_test(keep_a, keep_b, alt), power=welch_power(c.source_effect, keep_a, keep_b, alt))
    if alt != "two-sided":
        out["bound"] = one_sided_bound(keep_a, keep_b, alt)
        out["p_opposite"] = welch_test(keep_a, keep_b, _opposite(alt))
    if edge:
        out["why"] = edge
        return out
    if unconverged:
        out["why"] = unconverged
        return out
    if c.claim == "none":
        if out["p"] < ALPHA or out["p_opposite"] < ALPHA:
            out.update(verdict=DISAGREES, why="a difference the source does not find")
        elif out["power"] >= POWER:
            out["verdict"] = AGREES
        else:
            out["why"] = "low power"
        return out
    claimed = c.source_effect if c.claim == "effect" else 0.0
    bound = out["bound"]
    if _outside(claimed, bound, alt):
        out.update(verdict=DISAGREES, why="the source's effect is outside our interval" if c.claim == "effect"
                   else "the opposite direction")
    elif out["p_opposite"] < ALPHA:
        out.update(verdict=DISAGREES, why="the opposite direction")
    elif out["p"] < ALPHA:
        out["verdict"] = AGREES
    else:
        out["why"] = "low power"
    return out


def _num(x: float, digits: int = 2, sign: bool = False) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _p(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def verdict_word(results: list[dict]) -> str:
    """The study's verdict from its comparisons' (conditions left out): the one word when all agree
    on it, else the count of each."""
    words = [r["verdict"] for r in results if r["comparison"].role == "claim"]
    if not words:
        return "no comparison"
    if len(set(words)) == 1:
        return words[0] + (f" (all {len(words)} comparisons)" if len(words) > 1 else "")
    parts = [f"{w} in {words.count(w)}" for w in (AGREES, DISAGREES, UNRESOLVED) if w in words]
    return ", ".join(parts) + f" of {len(words)} comparisons"


def _test(alternative: str) -> str:
    return "two-sided" if alternative == "two-sided" else f"one-tailed, {alternative}"


def _reason(r: dict) -> str:
    why = r["why"]
    if r["verdict"] == UNRESOLVED and why == "low power":
        if r["power"] < POWER:
            return f"not resolvable (power {_num(r['power'])} < {POWER})"
        eff = r["comparison"].source_effect
        # only a direction claim gets here outside the interval (an effect claim there disagrees)
        if _outside(eff, r["bound"], r["alternative"]):
            return (f"not resolvable (p {_p(r['p'])} >= {ALPHA}: the claim is the direction, and the source's "
                    f"{eff:+.2f} lies outside our interval)")
        return f"not resolvable (p {_p(r['p'])} >= {ALPHA}, the interval holds the source's effect)"
    if why == "runs at chance":
        ca, cb = r["collapsed"]
        na, nb = r["n"]
        return f"not resolvable ({ca} of {na} and {cb} of {nb} runs at chance)"
    if r["verdict"] == UNRESOLVED:
        return f"not resolvable ({why})"
    return r["verdict"] + (f" ({why})" if why else "")


def render_verdict(study: str, results: list[dict], facts: list[str], unit: str) -> str:
    """The markdown of a study's verdict: the verdict line, one table row per comparison, the facts."""
    claims = [r for r in results if r["comparison"].role == "claim"]
    conds = [r for r in results if r["comparison"].role == "condition"]
    lines = [f"**Verdict: {verdict_word(results)}.** Generated from the records by the rule of "
             f"[the statistics](#statistics-and-the-verdict-rule) (`.venv/bin/python -m jobs.results_tables`).", "",
             f"| comparison | source | source's effect ({unit}) | ours ({unit}) | test | one-sided 95% bound | p | "
             f"p (opposite) | power for the source's effect | runs at chance | verdict |",
             "|" + "|".join(" --- " for _ in range(11)) + "|"]
    for r in claims + conds:
        c = r["comparison"]
        bound = r["bound"]
        bnd = "-" if math.isnan(bound) else ("<= " if r["alternative"] == "greater" else ">= ") + _num(bound, sign=True)
        label = c.label + (" (condition)" if c.role == "condition" else "")
        lines.append(f"| {label} | {c.source} | {_num(c.source_effect, sign=True)} | {_num(r['diff'], sign=True)} | "
                     f"{_test(r['alternative'])} | {bnd} | {_p(r['p'])} | {_p(r['p_opposite'])} | {_num(r['power'])} | "
                     f"{r['collapsed'][0]} of {r['n'][0]}, {r['collapsed'][1]} of {r['n'][1]} | {_reason(r)} |")
    return "\n".join(lines) + "\n\n" + "\n\n".join(facts) + "\n"
