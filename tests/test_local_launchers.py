"""The local launcher's fork server: what a worker imports after the fork is paid once per worker
(16 times a run at M = 16 on 2 cores), what the server preloads once per launching process. Which
inprocess runs run under the simulated clock: what each algorithm declares, never a list of names."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pipeline.errors import ConfigError
from pipeline.train import algorithms
from pipeline.train.config import TrainConfig
from pipeline.train.local_launchers import clock_settings, simulated

# A worker's first steps as a fresh process after the server's preloads: the model, a step of each
# optimizer, the evaluation's summary (loss, accuracy, per-class AUC); the modules it imports then
# (the pipeline's own aside: cheap, and loaded lazily by design).
_WORKER_FIRST_STEPS = textwrap.dedent("""
    import importlib, sys
    from pipeline.train.local_launchers import PRELOAD
    for m in PRELOAD:
        importlib.import_module(m)
    before = set(sys.modules)
    import numpy as np, torch
    from pipeline.train.metrics import summarize
    from pipeline.train.models import build_model
    model = build_model("lenet5", 10, {"channels": 1, "height": 28, "width": 28})
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(model.parameters())):
        model(torch.zeros(4, 1, 28, 28)).sum().backward()
        opt.step()
    probs = np.random.default_rng(0).dirichlet(np.ones(10), 50).astype(np.float32)
    summarize(probs, np.arange(50) % 10, 1.0)
    print("\\n".join(sorted(m for m in set(sys.modules) - before if not m.startswith("pipeline"))))
""")


def test_a_local_worker_imports_nothing_heavy_after_the_fork():
    """torch imports its compiler stack (torch._dynamo, sympy: about 800 modules) at a process's
    first optimizer and sklearn's metrics come with the first AUC: about 0.9 s of one core each,
    once per worker unless the fork server preloads them (without them in ``PRELOAD``: 1,807 modules
    imported here, and a 10-step M = 16 run took 23 s instead of 8)."""
    r = subprocess.run([sys.executable, "-c", _WORKER_FIRST_STEPS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    late = r.stdout.split()
    assert len(late) <= 20, f"{len(late)} modules imported after the fork, e.g. {late[:10]}"


def _inprocess(tmp_path, name: str, params: dict | None = None, **kw) -> TrainConfig:
    return TrainConfig(manifest="m.json", output=str(tmp_path / "o"), launcher="inprocess",
                       algorithm={"name": name, "params": params or {}}, **kw)


def test_the_algorithms_that_depend_on_time_run_under_the_simulated_clock(tmp_path):
    """Each algorithm's Params declare whether its steps depend on time (``time_round_steps``)."""
    needs = {"timed_local_sgd": {"round_seconds": 0.5}}
    on_clock = sorted(n for n in algorithms.names() if simulated(_inprocess(tmp_path, n, needs.get(n))))
    assert on_clock == ["adpsgd", "async_ps", "eawild", "timed_local_sgd"]
    assert simulated(_inprocess(tmp_path, "swarm", {"schedule": "time", "round_seconds": 0.2}))
    assert simulated(_inprocess(tmp_path, "slowmo", {"base": "eawild", "base_params": {"round_steps": 2}}))
    assert simulated(_inprocess(tmp_path, "arsgd", stragglers={"slowdown": {1: 2.0}}))
    # a round of round_seconds meant to hold the declared steps: its step time
    assert clock_settings(_inprocess(tmp_path, "swarm", {"schedule": "time", "round_seconds": 0.2,
                                                         "local_steps": 4})).step_s == pytest.approx(0.05)
    assert clock_settings(_inprocess(tmp_path, "timed_local_sgd", {"round_seconds": 0.5,
                                                                   "nominal_steps": 5})).step_s == pytest.approx(0.1)


def test_an_algorithm_that_does_not_declare_whether_it_depends_on_time_is_refused(tmp_path, monkeypatch):
    """A new algorithm that omits the declaration cannot run off the simulated clock by omission."""
    (tmp_path / "undeclared_algorithm.py").write_text(textwrap.dedent("""
        from pydantic import BaseModel, ConfigDict
        from pipeline.train.algorithms import Spec

        class Params(BaseModel):
            model_config = ConfigDict(extra="forbid")

        SPECS = {"undeclared": Spec(Params, lambda params, ctx: None)}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(algorithms.REGISTRY, "undeclared", "undeclared_algorithm")
    with pytest.raises(ConfigError, match=r"^algorithm 'undeclared': its Params \(Params\) do not declare "
                                          r"time_round_steps\(\)"):
        simulated(_inprocess(tmp_path, "undeclared"))
