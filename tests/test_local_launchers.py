"""The local launcher's fork server: what a worker imports after the fork is paid once per worker
(16 times a run at M = 16 on 2 cores), what the server preloads once per launching process."""
from __future__ import annotations

import subprocess
import sys
import textwrap

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
