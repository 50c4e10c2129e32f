"""The machine's single-thread reference: one LeNet-5 training step (SGD with momentum) at batch 128 on
one thread, in ms, measured in several fresh processes one after another; the median over them is the
reference. Quote it, with the load average, beside a suite's or a benchmark's time. On this 2-core
machine it is itself noisy: one process's figure differs from the next's by up to a third, and two
medians a minute apart by a fifth (docs/benchmarks.md, "The suite"), which is why a time target needs a
margin and a comparison needs runs alternated in one sitting.

    .venv/bin/python bench/reference.py [--processes 8] [--steps 150]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_process(steps: int) -> float:
    """ms a step in this process (after 20 warm-up steps)."""
    sys.path.insert(0, str(REPO))
    import torch

    from pipeline.train.models import LeNet5

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LeNet5()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(20):     # warm-up: allocator, first-call dispatch
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8, help="fresh processes, one after another (default 8)")
    ap.add_argument("--steps", type=int, default=150, help="timed steps in each (default 150)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child: print its ms
    a = ap.parse_args(argv)
    if a.one:
        print(f"{one_process(a.steps):.3f}")
        return 0
    ms = [float(subprocess.run([sys.executable, __file__, "--one", "--steps", str(a.steps)], check=True,
                               stdout=subprocess.PIPE, text=True).stdout.split()[-1])
          for _ in range(a.processes)]
    print(f"LeNet-5, batch 128, one thread: median {statistics.median(ms):.1f} ms a step over {a.processes} "
          f"processes ({min(ms):.1f}-{max(ms):.1f}); load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
