"""The one line every job ends with: ``SUMMARY <job>: <result>`` (printed by ``pipeline.cli.run_job``).

One function per job, ``(cfg, result, seconds) -> str``: the job's config, what its stage function
returned, and the job's wall time. The line gives the result a user asked for (counts, accuracy,
per-class AUC, throughput) and the path of the file that holds the details.
"""
from __future__ import annotations

import json
import math
from typing import Optional

from .features.layout import CLASS_NAMES
from .fs import location

#: models whose classes are the HEP processes (one-vs-rest AUC per named class)
_HEP_MODELS = ("hlf", "gru", "inclusive")


def _out(path: str, *child: str) -> str:
    return str(location(path, output=True).child(*child)) if child else str(location(path, output=True))


def _num(v: Optional[float], fmt: str = ".4f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def auc_text(auc: Optional[dict], named: bool) -> str:
    """``one-vs-rest ROC AUC qcd 0.984, ttbar 0.969, wjets 0.968`` for the HEP classes, else the
    mean over the classes; a class without both outcomes in the test split has no AUC (n/a)."""
    if not auc:
        return "ROC AUC n/a"
    items = sorted(auc.items(), key=lambda kv: int(kv[0]))
    if named:
        names = dict(enumerate(CLASS_NAMES))
        return "one-vs-rest ROC AUC " + ", ".join(f"{names.get(int(k), k)} {_num(v, '.3f')}" for k, v in items)
    vals = [v for _, v in items if v is not None and not math.isnan(v)]
    return f"mean one-vs-rest ROC AUC {_num(sum(vals) / len(vals), '.3f') if vals else 'n/a'} ({len(items)} classes)"


def simulate(cfg, r: dict, seconds: float) -> str:
    events = r["events"]
    eff = ", ".join(f"{p} {e:.3f}" for p, e in r["filter_efficiency"].items() if e is not None)
    files = sum(len(v) for v in r["files"].values())
    return (f"{sum(events.values())} events ({', '.join(f'{p} {n}' for p, n in events.items())}) in {files} "
            f"ROOT file(s)" + (f", lepton-filter efficiency {eff}" if eff else "")
            + f" in {seconds:.0f} s -> {r['output']} [{r['sidecar']}]")


def ingest_root(cfg, r: dict, seconds: float) -> str:
    n, bad = len(r["files"]), len(r["bad_files"])
    if r.get("output_format") == "delta":
        if r.get("nothing_new"):
            return f"nothing new ({r['held_files']} input file(s) already in the table) -> {r['output']} version {r['version']}"
        return (f"{r['rows']} rows from {n - bad} of {n} new file(s) (tree {r['tree']}, {len(r['branches'])} branches; "
                f"{r['held_files']} input file(s) already in the table) in {seconds:.0f} s -> {r['output']} "
                f"version {r['version']}")
    return (f"{r['rows']} rows from {n - bad} of {n} file(s) (tree {r['tree']}, {len(r['branches'])} branches, "
            f"schema {r['schema']['name']} v{r['schema']['version']}) in {seconds:.0f} s -> {r['output']} "
            f"[{_out(cfg.output, '_report.json')}]")


def ingest_images(cfg, r: dict, seconds: float) -> str:
    c, (h, w, ch) = r["counts"], r["shape"]
    return (f"{r['rows']} {r['source']} images {h}x{w}x{ch}, {len(r['label_counts'])} classes (train {c['train']}, "
            f"val {c['val']}, test {c['test']}) in {seconds:.0f} s -> {r['output']} "
            f"[{_out(cfg.output, '_ingest.json')}]")


def features(cfg, r: dict, seconds: float) -> str:
    read = sum(f["events_read"] for f in r["files"])
    s = r["splits"]
    return (f"{sum(s.values())} of {read} events selected and written (train {s['train']}, val {s['val']}, "
            f"test {s['test']}) from {len(r['files'])} file(s), {len(r['bad_files'])} bad, HLF and LLF in "
            f"{seconds:.0f} s -> {_out(cfg.output)} [{r['report']}]")


def shard(cfg, r: dict, seconds: float) -> str:
    lay = r["layout"]
    rows = ", ".join(str(w["rows"]) for w in r["workers"])
    return (f"{r['n_train_samples']} train samples -> {len(r['workers'])} {lay['scheme']} shards ({rows} rows, "
            f"C={lay['copies']}), eval {', '.join(r['eval'])} in {seconds:.0f} s "
            f"[{_out(cfg.output, 'manifest.json')}]")


def train(cfg, r: dict, seconds: float) -> str:
    rate = r["samples_processed"] / r["train_seconds"] if r.get("train_seconds") else None
    tracked = f", MLflow run {r['mlflow_run_id']}" if r.get("mlflow_run_id") else ""
    return (f"{r['model']} / {r['algorithm']} on {r['workers']} workers ({r['launcher']}): test accuracy "
            f"{_num(r['test_accuracy'])}, {auc_text(r.get('auc'), r['model'] in _HEP_MODELS)}, "
            f"{_num(rate, '.0f')} samples/s, {r['steps']} steps in {seconds:.0f} s{tracked} "
            f"[{_out(cfg.output, 'summary.json')}]")


def whatif(cfg, r: dict, seconds: float) -> str:
    reached = [x for x in r["rows"] if x["reached"]]
    best = min(reached, key=lambda x: (x["time_to_target_s"], x["workers"])) if reached else None
    return (f"{len(r['rows'])} runs on {r['cluster']}; "
            + (f"fastest to {r['target']:g}: {best['algorithm']} on {best['workers']} workers "
               f"({best['time_to_target_s']:.4g} virtual s)" if best else f"none reached {r['target']:g}")
            + f" in {seconds:.0f} s [{_out(r['output'], 'table.csv')}]")


def report(cfg, r: dict, seconds: float) -> str:
    return f"learning curves of {r['runs']} run(s) in {seconds:.0f} s -> {r['output']}"


def experiment(cfg, r: dict, seconds: float) -> str:
    return (f"study {r['study']}: {r['runs']} runs ({len(r['trained'])} trained, {len(r['skipped'])} finished "
            f"earlier, {len(r['failed'])} failed) in {seconds:.0f} s -> {r['report']}")


def tune(cfg, r: dict, seconds: float) -> str:
    best = r["best"]
    return (f"tune {r['tune']}: {r['trials']} trials ({cfg.sampler}), best {best['objective']} "
            f"{_num(best['value'])} with {json.dumps(best['params'])} in {seconds:.0f} s -> {r['best_config']}")


def run_hep(cfg, r: dict, seconds: float) -> str:
    tr = r["train_summary"]
    ev = r["events"]
    return (f"{sum(ev.values())} generated events ({', '.join(f'{k} {v}' for k, v in ev.items())}) -> HLF "
            f"classifier on {cfg.workers} workers ({tr['launcher']}, {tr['algorithm']}): test accuracy "
            f"{_num(tr['test_accuracy'])}, {auc_text(tr.get('auc'), True)} in {r['seconds']:.0f} s "
            f"[{_out(cfg.output_root, 'summary.json')}]")


def run_images(cfg, r: dict, seconds: float) -> str:
    t = cfg.train
    return (f"{r['rows']} {r['source']} images -> {cfg.workers} {r['scheme']} shards -> {r['model']} / "
            f"{r['algorithm']} on {r['launcher']} ({t.epochs} epochs): test accuracy {_num(r['test_accuracy'])} "
            f"in {r['seconds']:.0f} s [{_out(cfg.output_root, 'summary.json')}]")


def results_tables(cfg, r: dict, seconds: float) -> str:
    state = "rewritten" if r["rewritten"] else "up to date"
    return f"{len(r['studies'])} tables generated from the run records, {state} -> {r['page']}"
