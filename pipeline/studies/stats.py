"""Statistics over seeds: per cell and metric, mean, sample standard deviation, the 95% confidence
interval of the mean (Student's t with n - 1 degrees of freedom) and Welch's t-test p-value
(unequal variances, two-sided, ``scipy.stats.ttest_ind(equal_var=False)``) against the baseline
cell (one baseline for the study, or one per group of cells). Runs with a missing value (NaN, e.g. a target never reached) are left out of that metric's
statistics and counted in ``n``.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

NAN = float("nan")
CONFIDENCE = 0.95
STAT_COLUMNS = ["cell", "metric", "n", "n_runs", "mean", "std", "ci_low", "ci_high", "p_value", "baseline",
                "baseline_cell"]


def mean_ci(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float, float]:
    """(mean, std with ddof=1, CI low, CI high); std and CI are NaN below two values."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return NAN, NAN, NAN, NAN
    m = float(x.mean())
    if n < 2:
        return m, NAN, NAN, NAN
    s = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * s / math.sqrt(n)
    return m, s, m - half, m + half


def welch_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Welch's t-test p-value; NaN when a side has fewer than two values or no variance at all."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2 or (a.std() == 0 and b.std() == 0):
        return NAN
    with warnings.catch_warnings():  # "precision loss" when one side is (nearly) constant
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def cell_stats(results, metrics: list[str], baseline):
    """A DataFrame with one row per (cell, metric): ``STAT_COLUMNS``. ``results`` has columns
    ``cell`` and the metrics; ``baseline`` is the baseline cell's name, or a dict cell name ->
    the name of the cell it is tested against."""
    import pandas as pd

    rows = []
    cells = list(dict.fromkeys(results["cell"]))
    base_of = baseline if isinstance(baseline, dict) else {c: baseline for c in cells}
    for metric in metrics:
        for cell in cells:
            col = results.loc[results["cell"] == cell, metric]
            x = col.dropna().to_numpy(dtype=float)
            m, s, lo, hi = mean_ci(x)
            b = base_of.get(cell)
            base = results.loc[results["cell"] == b, metric].dropna().to_numpy(dtype=float)
            p = NAN if cell == b else welch_p(x, base)
            rows.append({"cell": cell, "metric": metric, "n": len(x), "n_runs": len(col), "mean": m, "std": s,
                         "ci_low": lo, "ci_high": hi, "p_value": p, "baseline": cell == b, "baseline_cell": b})
    return pd.DataFrame(rows, columns=STAT_COLUMNS)


def welch_parts(a, b) -> tuple[float, float, float]:
    """(mean(a) - mean(b), its standard error, Welch's degrees of freedom); NaN below two values a side."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return NAN, NAN, NAN
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), 0.0, NAN
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return float(a.mean() - b.mean()), se, float(df)


def welch_test(a, b, alternative: str = "two-sided") -> float:
    """Welch's t-test p-value of mean(a) - mean(b): ``two-sided``, ``greater`` (a above b) or ``less``."""
    from scipy import stats

    d, se, df = welch_parts(a, b)
    if math.isnan(d) or se == 0:
        return NAN
    t = d / se
    if alternative == "greater":
        return float(stats.t.sf(t, df))
    if alternative == "less":
        return float(stats.t.cdf(t, df))
    return float(2 * stats.t.sf(abs(t), df))


def one_sided_bound(a, b, alternative: str, confidence: float = CONFIDENCE) -> float:
    """The one-sided ``confidence`` bound of mean(a) - mean(b) that a test of ``alternative`` uses: the
    upper bound for ``greater`` (an effect above it is ruled out), the lower bound for ``less``."""
    from scipy import stats

    d, se, df = welch_parts(a, b)
    if math.isnan(d) or math.isnan(df):
        return NAN
    t = float(stats.t.ppf(confidence, df)) * se
    return d + t if alternative == "greater" else d - t


def welch_power(effect: float, a, b, alternative: str, alpha: float = 1 - CONFIDENCE) -> float:
    """The power of Welch's test at level ``alpha`` to find a true difference ``effect`` (mean(a) -
    mean(b)) at the spreads and sizes of ``a`` and ``b`` (the noncentral t distribution)."""
    from scipy import stats

    d, se, df = welch_parts(a, b)
    if math.isnan(d) or math.isnan(df) or se == 0:
        return NAN
    nc = effect / se
    if alternative == "greater":
        return float(stats.nct.sf(stats.t.ppf(1 - alpha, df), df, nc))
    if alternative == "less":
        return float(stats.nct.cdf(-stats.t.ppf(1 - alpha, df), df, nc))
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
