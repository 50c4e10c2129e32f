"""Steps to a result against the batch size (Shallue et al. 2018, as Bonet, Wang & Tang's "Module 1
Discussion" presents it): the analysis of the ``steps_to_result_*`` studies' run records.

A study runs SGD at global batches B = 16 ... 8,192 with a grid of learning rates (and momenta) per
batch, one run per setting, each with a step budget and a validation every ``budget / 100`` steps.
From the records (:mod:`.records`):

* **Steps to a target** (:func:`steps_to_target`): the step of the first validation whose error
  (1 - accuracy) is at or below the target; None when the run never reaches it in its budget.
* **The best setting per batch** (:func:`best_per_batch`): per family (plain SGD: momentum 0;
  momentum: any momentum > 0, the momentum tuned with the rate) and batch, the setting of the grid
  with the fewest steps to the target (the mean over its seeds; a setting counts only where every
  seed that ran reached the target), with its rate and momentum. A batch where no setting reaches
  the target has no point.
* **Normalised** (:func:`normalised`): steps / steps at the smallest batch with a point, as in the
  slides' plots ("Steps / (Steps at B=16)").
* **The regimes, by rule** (:func:`regimes`): each doubling of the batch between two measured
  points has a local slope ``s = log2(steps(2B) / steps(B))`` (-1: steps halve). A doubling is
  *perfect scaling* when ``s <= PERFECT_SLOPE`` (-0.85: the steps fall at least 2^0.85 = 1.80-fold),
  *no benefit* when ``s >= FLAT_SLOPE`` (-0.15: they fall at most 2^0.15 = 1.11-fold, or rise), and
  *diminishing returns* between. The perfect-scaling regime ends at the largest batch that every
  doubling from the smallest batch up to it scales perfectly; the maximal-data-parallelism regime
  starts at the smallest batch from which every further doubling is "no benefit" (a batch after
  which the target is no longer reached counts as no benefit; a span over batches not run yet is not
  classified, and ends the perfect regime and a flat tail there). The **maximum useful batch** is that
  start; when the last doubling still helps, it is at least the largest batch measured (``ge``).
* **The seeds' spread**: a point's steps are a mean over the best setting's
  seeds, each known only to its validation interval ``v``; a run's steps vary by ``sqrt(sd^2 + v^2 /
  12)`` (``sd``: the seeds' sample standard deviation; ``v^2 / 12``: the step's rounding up to a
  validation), which gives each doubling's slope a standard error (:func:`slope_se`); the page shows
  1.96 of them either side. The regimes **go back** when a later doubling is in an earlier class than
  a previous one; that reversal is **resolved** (:func:`back_resolved`) only when it holds at the ends
  of both intervals (the later doubling's flattest slope against the earlier one's steepest), with
  intervals of ``z`` standard errors. The verdict looks for a reversal among every doubling of every
  curve, so its ``z`` covers them together (:func:`family_z`: Bonferroni over the K doublings with a
  known error, two-sided 95 %: z = 3.34 at K = 60). A point of one seed has no spread: no reversal
  through it is resolved.
* **Simple rules for the best rate** (:func:`rate_rules`): whether the best rate follows lr ∝ B
  (Goyal's linear rule), lr ∝ sqrt(B) or a constant, anchored at the smallest batch, to within one
  step of the rate grid at every batch up to the maximum useful batch.

The verdicts on the source's claims follow from these by the rules stated in :func:`verdicts`; the
page's tables, figure and verdict rows are written by :mod:`.steps_page`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional


#: local log-log slope at or below which a doubling of the batch is perfect scaling (steps fall >= 1.80x)
PERFECT_SLOPE = -0.85
#: local slope at or above which a doubling brings no benefit (steps fall <= 1.11x)
FLAT_SLOPE = -0.15
#: standard errors either side of one doubling's slope for its 95 % interval (shown on the page)
Z_ONE = 1.96
PERFECT, DIMINISHING, FLAT = "perfect scaling", "diminishing returns", "maximal data parallelism"
#: the regimes' order along the batch (a curve whose classes' ranks fall goes back)
_RANK = {PERFECT: 0, DIMINISHING: 1, FLAT: 2}
GAP = "batches between not run"   # a span of more than one doubling: its slope is shown, not classified


def steps_to_target(curve: Iterable[dict], target_error: float) -> Optional[int]:
    """The step of the first validation with error <= target_error, or None."""
    vals = sorted((int(c["step"]), float(c["accuracy"])) for c in curve
                  if c.get("split", "val") == "val" and c.get("accuracy") is not None)
    for step, acc in vals:
        if not math.isnan(acc) and 1.0 - acc <= target_error + 1e-12:
            return step
    return None


def family(momentum: float) -> str:
    return "sgd" if float(momentum) == 0.0 else "momentum"


@dataclass
class Point:
    batch: int
    steps: float       # mean over the setting's seeds
    lr: float
    momentum: float
    runs: int          # settings of the grid that ran at this batch and family
    reached: int       # of them, those that reached the target in every seed that ran
    seeds: int = 1     # seeds of the best setting
    sd: Optional[float] = None   # the seeds' sample standard deviation of the steps (None: one seed)
    every: float = 0.0           # the validation interval: a run's steps are known to within it


def _cfg(rec: dict, key: str, default=None):
    """A dotted key of a record's run config (records hold the resolved config)."""
    node = rec.get("config", {})
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def run_settings(rec: dict) -> tuple[int, float, float]:
    """(global batch, rate, momentum) of a run record."""
    train = rec.get("config", {}).get("train", rec.get("config", {}))
    return int(train["batch_size"]), float(train["lr"]), float(train.get("momentum", 0.0))


def validation_interval(rec: dict) -> float:
    """The steps between a run's validations (its config's eval_every, else its first validation's step)."""
    every = _cfg(rec, "train.eval_every")
    if every:
        return float(every)
    steps = [int(c["step"]) for c in rec.get("curve", []) if c.get("split", "val") == "val"]
    return float(min(steps)) if steps else 0.0


def is_tuned(rec: dict) -> bool:
    """A run of the tuning grid: the linear-scaling runs (a warm-up, or lr_scaling) are not on the curve."""
    return not _cfg(rec, "train.warmup_epochs", 0) and _cfg(rec, "train.lr_scaling", "none") == "none"


def best_per_batch(records: Iterable[dict], target_error: float) -> dict[str, dict[int, Point]]:
    """family -> batch -> the best point: over the grid's settings (rate, momentum) that reached the
    target in every seed that ran, the one with the fewest steps (mean over its seeds)."""
    settings: dict[tuple[int, float, float], list[Optional[int]]] = {}
    every: dict[tuple[int, float, float], float] = {}
    for rec in records:
        if not is_tuned(rec):
            continue
        key = run_settings(rec)
        settings.setdefault(key, []).append(steps_to_target(rec.get("curve", []), target_error))
        every[key] = max(every.get(key, 0.0), validation_interval(rec))
    out: dict[str, dict[int, Point]] = {}
    counts: dict[tuple[str, int], list[int]] = {}
    for (b, lr, mom), steps in sorted(settings.items()):
        fam = family(mom)
        c = counts.setdefault((fam, b), [0, 0])
        c[0] += 1
        if any(x is None for x in steps):
            continue
        c[1] += 1
        mean = sum(steps) / len(steps)
        best = out.setdefault(fam, {}).get(b)
        if best is None or mean < best.steps:
            sd = statistics.stdev(steps) if len(steps) > 1 else None
            out[fam][b] = Point(b, mean, lr, mom, 0, 0, len(steps), sd, every[(b, lr, mom)])
    for fam, pts in out.items():
        for b, p in pts.items():
            p.runs, p.reached = counts[(fam, b)]
    return out


def normalised(points: dict[int, Point]) -> dict[int, float]:
    """batch -> steps / steps at the smallest batch with a point."""
    if not points:
        return {}
    b0 = min(points)
    return {b: points[b].steps / points[b0].steps for b in sorted(points)}


def classify(slope: float) -> str:
    if slope <= PERFECT_SLOPE:
        return PERFECT
    if slope >= FLAT_SLOPE:
        return FLAT
    return DIMINISHING


def _log2_var(p: Point) -> Optional[float]:
    """The variance of log2 of a point's mean steps over its seeds (None: one seed, no spread known)."""
    if p.sd is None or p.seeds < 2 or p.steps <= 0:
        return None
    run_sd = math.sqrt(p.sd ** 2 + p.every ** 2 / 12.0)
    return (run_sd / p.steps) ** 2 / p.seeds / math.log(2) ** 2


def slope_se(lo: Point, hi: Point) -> Optional[float]:
    """The standard error of the slope between two points (module docstring); None where a point has
    one seed."""
    a, b = _log2_var(lo), _log2_var(hi)
    if a is None or b is None:
        return None
    return math.sqrt(a + b) / math.log2(hi.batch / lo.batch)


def family_z(k: int) -> float:
    """z of a two-sided 95 % interval for each of k slopes at once (Bonferroni): 1.96 at k = 1."""
    return statistics.NormalDist().inv_cdf(1 - 0.025 / max(1, k))


@dataclass
class Regimes:
    doublings: list[tuple[int, int, Optional[float], str]] = field(default_factory=list)  # (B, 2B, slope, class)
    ses: list[Optional[float]] = field(default_factory=list)  # the slope's standard error (None: unknown)
    perfect_until: Optional[int] = None     # largest batch of perfect scaling (the smallest: no perfect doubling)
    max_useful: Optional[int] = None        # start of the maximal data parallelism regime
    max_useful_ge: bool = False             # True: no flat tail within the range; max_useful is a lower bound
    ordered: bool = True                    # the classes run perfect -> diminishing -> maximal, never back
    back_resolved: bool = False             # they go back beyond Z_ONE of the seeds' spread (back_resolved)


def regimes(points: dict[int, Point], batches: Iterable[int]) -> Regimes:
    """The regimes of one curve by the module's rule. ``batches``: every batch the study ran (so a
    batch that never reached the target is known)."""
    bs = sorted(set(batches))
    r = Regimes()
    if not points:
        return r
    start = min(points)
    bs = [b for b in bs if b >= start]
    for lo, hi in zip(bs, bs[1:]):
        if lo not in points or hi not in points:   # a batch that never reached the target: no benefit
            r.doublings.append((lo, hi, None, FLAT))
            r.ses.append(0.0 if lo in points else None)   # certain where the lower batch reached it
            continue
        s = math.log2(points[hi].steps / points[lo].steps) / math.log2(hi / lo)
        r.doublings.append((lo, hi, s, classify(s) if hi == 2 * lo else GAP))
        r.ses.append(slope_se(points[lo], points[hi]))
    r.perfect_until = start         # the smallest batch alone when the first doubling is not perfect
    for lo, hi, _, cls in r.doublings:
        if cls != PERFECT:
            break
        r.perfect_until = hi
    tail = len(r.doublings)
    while tail > 0 and r.doublings[tail - 1][3] == FLAT:
        tail -= 1
    if tail == len(r.doublings):
        r.max_useful, r.max_useful_ge = max(points), True
    else:
        r.max_useful = r.doublings[tail][0]
    ranks = [_RANK[d[3]] for d in r.doublings if d[3] != GAP]
    r.ordered = all(a <= b for a, b in zip(ranks, ranks[1:]))
    r.back_resolved = back_resolved(r, Z_ONE)
    return r


def back_resolved(r: Regimes, z: float) -> bool:
    """Whether a later doubling lies in an earlier class than a previous one at the ends of both
    intervals of ``z`` standard errors (the later one's flattest slope against the earlier one's
    steepest); a doubling to a batch that missed the target is no benefit for certain."""
    ends = []
    for (lo, hi, s, cls), se in zip(r.doublings, r.ses):
        if cls == GAP or se is None:
            continue
        if s is None:
            ends.append((_RANK[FLAT], _RANK[FLAT]))
        else:
            ends.append((_RANK[classify(s - z * se)], _RANK[classify(s + z * se)]))   # (steepest, flattest)
    return any(later[1] < earlier[0] for i, earlier in enumerate(ends) for later in ends[i + 1:])


def rate_rules(points: dict[int, Point], grid_step: float, until: Optional[int] = None) -> dict[str, bool]:
    """rule -> whether the best rate follows it within one grid step (factor ``grid_step``) at every
    batch up to ``until``, anchored at the smallest batch: linear (lr ∝ B), sqrt (lr ∝ sqrt B), constant."""
    bs = sorted(b for b in points if until is None or b <= until)
    if len(bs) < 2:
        return {}
    b0, lr0 = bs[0], points[bs[0]].lr
    tol = math.log(grid_step) * 1.01
    out = {}
    for name, power in (("linear", 1.0), ("sqrt", 0.5), ("constant", 0.0)):
        out[name] = all(abs(math.log(points[b].lr / (lr0 * (b / b0) ** power))) <= tol for b in bs)
    return out


def effective_rate(p: Point) -> float:
    """lr / (1 - momentum): the rate a momentum run takes in the long run (Shallue et al. Section 4.6)."""
    return p.lr / (1.0 - p.momentum)


@dataclass
class Curve:
    workload: str
    target: float
    family: str
    points: dict[int, Point]
    regimes: Regimes


def curves(workload: str, records: list[dict], targets: Iterable[float]) -> list[Curve]:
    """Every (target, family) curve of one workload's records."""
    tuned = [r for r in records if is_tuned(r)]
    out = []
    for t in targets:
        best = best_per_batch(tuned, t)
        for fam in ("sgd", "momentum"):
            pts = best.get(fam, {})
            ran = {run_settings(r)[0] for r in tuned if family(run_settings(r)[2]) == fam}  # this family's batches
            out.append(Curve(workload, t, fam, pts, regimes(pts, ran)))
    return out


def _workload_curves(cs: list[Curve]) -> dict[str, list[Curve]]:
    out: dict[str, list[Curve]] = {}
    for c in cs:
        out.setdefault(c.workload, []).append(c)
    return out


def verdicts(cs: list[Curve], grid_step: float) -> list[tuple[str, str, str]]:
    """(claim, verdict, why) for each of the source's claims, by these rules:

    * three regimes "in a similar way across problems": agrees when every curve of at least two
      workloads has its classes in order (perfect -> diminishing -> maximal) with a perfect doubling
      first and a flat tail; disagrees when a curve's classes go back (e.g. perfect after no
      benefit) beyond the seeds' spread at :func:`family_z` over every curve's slopes
      (:func:`back_resolved`); otherwise not resolvable (a reversal within the spread, a regime
      outside 16 ... 8,192, or one workload only).
    * the maximum useful batch varies between workloads: with two or more workloads, agrees when the
      momentum curves' maximum useful batches at the harder target differ by 4x or more (two
      doublings), disagrees when they are within 2x and none is a lower bound; else not resolvable.
    * momentum extends perfect scaling: per workload and target where both curves start at the same
      batch, the momentum curve's perfect-scaling end against plain SGD's; agrees when it is larger in
      every pair, disagrees when it is smaller in any pair and larger in none; not resolvable otherwise
      (equal on a factor-2 grid).
    * the best rate follows no simple rule: per curve, :func:`rate_rules` on the rate (plain SGD) or
      the effective rate lr / (1 - momentum) up to the maximum useful batch; agrees when no rule holds
      on any curve, disagrees when one rule holds on every curve, partly otherwise.
    """
    out = []
    measured = [c for c in cs if len(c.points) >= 2]
    by_w = _workload_curves(measured)
    back = [c for c in measured if not c.regimes.ordered]
    k = sum(1 for c in measured for (_, _, sl, cls), se in zip(c.regimes.doublings, c.regimes.ses)
            if cls != GAP and se is not None and sl is not None)
    z = family_z(k)
    resolved = [c for c in back if back_resolved(c.regimes, z)]
    complete = [c for c in measured if c.regimes.ordered and c.regimes.perfect_until != min(c.points)
                and not c.regimes.max_useful_ge]
    if resolved:
        c = resolved[0]
        out.append(("three regimes", "disagrees",
                    f"{c.workload} {c.family} at error {c.target}: the regimes go back along the batch, beyond "
                    f"the seeds' spread ({len(resolved)} of {len(measured)} curves; z = {z:.2f} over {k} slopes)"))
    elif back:
        one = sum(1 for c in back if any(se is None for se in c.regimes.ses))
        spread = f"z = {z:.2f} over {k} slopes" if k else "no slope's spread known"
        out.append(("three regimes", "not resolvable",
                    f"{len(back)} of {len(measured)} curves go back along the batch, none beyond the seeds' spread "
                    f"({spread}{f'; {one} through a point of one seed' if one else ''})"))
    elif len(by_w) >= 2 and len(complete) == len(measured):
        out.append(("three regimes", "agrees", f"every curve of {len(by_w)} workloads shows them in order"))
    else:
        missing = [c for c in measured if c not in complete]
        why = (f"{len(missing)} of {len(measured)} curves lack a regime within the batches run"
               if missing else "in order on every curve")
        out.append(("three regimes", "not resolvable",
                    why + ("" if len(by_w) >= 2
                           else f"; {len(by_w)} workload(s) measured, the claim is across problems")))

    mu = {}
    for w, wc in by_w.items():
        hard = [c for c in wc if c.family == "momentum"]
        if hard:
            c = min(hard, key=lambda c: c.target)
            mu[w] = (c.regimes.max_useful, c.regimes.max_useful_ge)
    if len(mu) < 2:
        out.append(("maximum useful batch varies", "not resolvable", f"{len(mu)} workload(s) measured"))
    else:
        vals = [v for v, _ in mu.values()]
        ratio = max(vals) / min(vals)
        lower = any(ge for _, ge in mu.values())
        shown = ", ".join(f"{w} {'>=' if ge else ''}{v}" for w, (v, ge) in mu.items())
        if ratio >= 4 and not (lower and max(vals) == max(v for v, ge in mu.values() if ge)):
            out.append(("maximum useful batch varies", "agrees", shown))
        elif ratio <= 2 and not lower:
            out.append(("maximum useful batch varies", "disagrees", shown))
        else:
            out.append(("maximum useful batch varies", "not resolvable", shown))

    pairs = []
    for w, wc in by_w.items():
        for t in sorted({c.target for c in wc}):
            f = {c.family: c for c in wc if c.target == t}
            if "sgd" in f and "momentum" in f and f["sgd"].points and f["momentum"].points:
                pairs.append((w, t, f["sgd"].regimes.perfect_until, f["momentum"].regimes.perfect_until,
                              min(f["sgd"].points) == min(f["momentum"].points)))
    shown = "; ".join(f"{w} error {t}: SGD to {s}, momentum to {m}"
                      + ("" if same else " (from different batches)") for w, t, s, m, same in pairs)
    pairs = [(w, t, s, m) for w, t, s, m, same in pairs if same]   # both curves from the same smallest batch
    if not pairs:
        out.append(("momentum extends perfect scaling", "not resolvable", shown or "no pair of curves measured"))
    elif all(m > s for _, _, s, m in pairs):
        out.append(("momentum extends perfect scaling", "agrees", shown))
    elif any(m < s for _, _, s, m in pairs) and not any(m > s for _, _, s, m in pairs):
        out.append(("momentum extends perfect scaling", "disagrees", shown))
    else:
        out.append(("momentum extends perfect scaling", "not resolvable", shown))

    held = []
    for c in measured:
        pts = {b: Point(b, p.steps, effective_rate(p), 0.0, p.runs, p.reached) for b, p in c.points.items()}
        rules = rate_rules(pts, grid_step, c.regimes.max_useful)
        held.append((c, [k for k, v in rules.items() if v]))
    shown = "; ".join(f"{c.workload} {c.family} error {c.target}: {', '.join(r) or 'none'}" for c, r in held)
    if not held:
        out.append(("no simple rule for the best rate", "not resolvable", "no curve measured"))
    elif not any(r for _, r in held):
        out.append(("no simple rule for the best rate", "agrees", shown))
    elif all(r for _, r in held) and set.intersection(*(set(r) for _, r in held)):
        out.append(("no simple rule for the best rate", "disagrees", shown))
    else:
        out.append(("no simple rule for the best rate", "partly", shown))
    return out
