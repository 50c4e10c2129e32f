"""Numerical self-checks of the communicators and algorithms, runnable under any launcher.

``run_checks(backend, checks)`` runs in every worker process (Horovod-on-Spark task,
TorchDistributor process, ...) on tiny seeded synthetic problems with the REAL communicator,
and returns numbers the caller asserts on (the tests do; so can an operator validating a
new cluster or GPU node: ``python -m pipeline.train.selfcheck --launcher torch``).

Checks (each a function ``check_<name>(comm, device) -> dict``):

* ``comm``: fused allreduce over the world and over groups (multi-bucket, mixed dtypes),
  broadcast, allgather_object, pairwise ``exchange`` (Horovod: collective alltoall; torch:
  only the two partners call it), barrier.
* ``arsgd``: M workers with local batch b vs single-process SGD with batch M*b (max |diff|).
* ``local_sgd``: H = 1 vs a simulation of M workers averaging parameters after every step;
  with H = 3, whether the ranks' parameters are identical after each step.
* ``slowmo``: beta = 0, alpha = 1 vs the base algorithm; with lr = 1 the outer step vs
  ``torch.optim.SGD(momentum=beta)`` on the pseudo-gradient.
* ``hierarchical``: (4 workers) which groups each averaging used, per step.
* ``seeded_run``: parameters after a short seeded run (AR-SGD then local SGD), to compare
  backends.
* ``one_step``: two training steps of every synchronous algorithm on this device, from the
  same start on every rank with different data per rank: whether the parameters moved, and
  their digest (ranks of an algorithm that is in sync after the step must agree).

The torch backend follows the resolved device (``comm.device``): NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .algorithms import BuildContext, build_algorithm
from .algorithms.arsgd import ARSGD
from .algorithms.averaging import ModelAverager
from .algorithms.base import Algorithm
from .algorithms.hierarchical import HierarchicalSGD, groups_from_sizes
from .algorithms.local_sgd import LocalSGD
from .algorithms.slowmo import SlowMo
from .comm import make_communicator
from .comm.base import Communicator, Group
from .comm.device import current_device, device_kind
from .comm.fusion import flatten
from .digest import param_digest

D_IN, D_HID, D_OUT = 5, 8, 3


def mlp(device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(),
                               torch.nn.Linear(D_HID, D_OUT)).to(device)


def data(n: int, device, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g).to(device), torch.randint(0, D_OUT, (n,), generator=g).to(device)


def flat(model) -> torch.Tensor:
    return flatten(list(model.parameters()), dtype=torch.float64, device="cpu")


def digest(model) -> str:
    return param_digest(model.parameters())


def sgd(model, lr=0.1, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def train_steps(algo: Algorithm, model, X, Y, steps: int, b: int, rank: int, world: int,
                after: Optional[Callable[[int], None]] = None) -> None:
    for k in range(steps):
        sl = slice(k * world * b + rank * b, k * world * b + (rank + 1) * b)
        algo.zero_grad()
        F.cross_entropy(model(X[sl]), Y[sl]).backward()
        algo.step()
        if after:
            after(k + 1)


class SpyComm(Communicator):
    """Delegates to a real communicator and records the group of every allreduce."""

    def __init__(self, inner: Communicator):
        super().__init__()
        self.inner, self.calls = inner, []
        self.collective_exchange = inner.collective_exchange
        self.device = inner.device

    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)

    def new_group(self, ranks) -> Group:
        return self.inner.new_group(ranks)

    def allreduce_mean_(self, tensors, group=None) -> None:
        self.calls.append(tuple(range(self.world_size)) if group is None else tuple(group.ranks))
        self.inner.allreduce_mean_(tensors, group)

    def broadcast_(self, tensors, root=0) -> None:
        self.inner.broadcast_(tensors, root)

    def exchange(self, tensors, partner):
        return self.inner.exchange(tensors, partner)

    def barrier(self) -> None:
        self.inner.barrier()

    def allgather_(self, tensor):
        return self.inner.allgather_(tensor)


# ---------------------------------------------------------------------------- checks
def check_comm(comm: Communicator, device) -> dict:
    r, M = comm.rank, comm.world_size
    out: dict = {}
    # world allreduce: several buckets (bucket_bytes is tiny in run_checks) and two dtypes
    ts = [torch.full((7,), float(r + 1), device=device), torch.arange(50, dtype=torch.float64, device=device) * (r + 1),
          torch.full((2, 3), float(10 * r), device=device)]
    comm.allreduce_mean_(ts)
    mean_k = sum(k + 1 for k in range(M)) / M
    out["allreduce_err"] = max(float((ts[0] - mean_k).abs().max()),
                               float((ts[1] - torch.arange(50, dtype=torch.float64, device=device) * mean_k).abs().max()),
                               float((ts[2] - 10 * (M - 1) / 2).abs().max()))
    # groups: pairs (0,1), (2,3), ... (every rank creates every group, same order)
    pairs = [comm.new_group([2 * i, 2 * i + 1]) for i in range(M // 2)]
    singles = [comm.new_group([i]) for i in range(M)]
    t = torch.full((5,), float(r), device=device)
    if M >= 2 and r < 2 * (M // 2):
        comm.allreduce_mean_([t], pairs[r // 2])
        out["pair_allreduce_err"] = float((t - (2 * (r // 2) + 0.5)).abs().max())
    t = torch.full((3,), float(r), device=device)
    comm.allreduce_mean_([t], singles[r])
    out["single_allreduce_err"] = float((t - r).abs().max())
    # broadcast
    b = torch.full((4,), float(r + 100), device=device)
    comm.broadcast_([b], root=M - 1)
    out["broadcast_err"] = float((b - (M - 1 + 100)).abs().max())
    out["allgather"] = comm.allgather_object({"rank": r})
    # pairwise exchange with r ^ 1
    partner = r ^ 1 if (r ^ 1) < M else None
    mine = [torch.full((3,), float(r), device=device), torch.arange(4, dtype=torch.float64, device=device) * r]
    got = comm.exchange(mine, partner)
    if partner is not None:
        out["exchange_err"] = max(float((got[0] - partner).abs().max()),
                                  float((got[1] - torch.arange(4, dtype=torch.float64, device=device) * partner).abs().max()))
    # a round where only ranks 0 and 1 exchange (others sit out: torch does not call at all)
    if M >= 2:
        if comm.collective_exchange or r < 2:
            got = comm.exchange([torch.full((2,), float(r + 7), device=device)], r ^ 1 if r < 2 else None)
            if r < 2:
                out["partial_exchange_err"] = float((got[0] - ((r ^ 1) + 7)).abs().max())
            else:
                out["partial_exchange_none"] = got is None
    comm.barrier()
    out["stats"] = comm.stats.snapshot()
    return out


def check_arsgd(comm: Communicator, device) -> dict:
    r, M, b, K = comm.rank, comm.world_size, 4, 5
    X, Y = data(M * b * K, device)
    model = mlp(device)
    algo = ARSGD(model.parameters(), sgd(model), comm)
    train_steps(algo, model, X, Y, K, b, r, M)
    ref = mlp(device)
    ropt = sgd(ref)
    for k in range(K):
        sl = slice(k * M * b, (k + 1) * M * b)
        ropt.zero_grad()
        F.cross_entropy(ref(X[sl]), Y[sl]).backward()
        ropt.step()
    return {"max_diff": float((flat(model) - flat(ref)).abs().max()), "moved": float((flat(ref) - flat(mlp(device))).abs().max())}


def check_local_sgd(comm: Communicator, device) -> dict:
    r, M, b, K = comm.rank, comm.world_size, 4, 6
    X, Y = data(M * b * K, device)
    model = mlp(device)
    opt = sgd(model)
    algo = LocalSGD(model.parameters(), opt, comm, ModelAverager(model, opt, comm, "average", "local"), period=1)
    train_steps(algo, model, X, Y, K, b, r, M)
    # simulation: M virtual workers in this process, parameters averaged after every step
    sims = [mlp(device) for _ in range(M)]
    opts = [sgd(m) for m in sims]
    for k in range(K):
        for w in range(M):
            sl = slice(k * M * b + w * b, k * M * b + (w + 1) * b)
            opts[w].zero_grad()
            F.cross_entropy(sims[w](X[sl]), Y[sl]).backward()
            opts[w].step()
        with torch.no_grad():
            for ps in zip(*[m.parameters() for m in sims]):
                avg = torch.stack([p.data for p in ps]).mean(0)
                for p in ps:
                    p.data.copy_(avg)
    out = {"h1_max_diff": float((flat(model) - flat(sims[0])).abs().max())}
    # H = 3: identical after averaging steps, apart in between
    model = mlp(device)
    opt = sgd(model)
    algo = LocalSGD(model.parameters(), opt, comm, ModelAverager(model, opt, comm), period=3)
    equal = {}

    def after(n: int) -> None:
        ds = comm.allgather_object(digest(model))
        equal[n] = len(set(ds)) == 1

    train_steps(algo, model, X, Y, K, b, r, M, after)
    out["h3_equal_after_step"] = equal
    out["h3_averaged_at"] = list(algo.averaged_at)
    return out


def check_slowmo(comm: Communicator, device) -> dict:
    r, M, b, K = comm.rank, comm.world_size, 4, 6
    X, Y = data(M * b * K, device)
    # beta = 0, alpha = 1: equals the base algorithm (local SGD, H = 2), tau = 2
    m1 = mlp(device)
    o1 = sgd(m1)
    base = LocalSGD(m1.parameters(), o1, comm, ModelAverager(m1, o1, comm), period=2)
    slow = SlowMo(base, ModelAverager(m1, o1, comm), tau=2, beta=0.0, alpha=1.0)
    train_steps(slow, m1, X, Y, K, b, r, M)
    m2 = mlp(device)
    o2 = sgd(m2)
    plain = LocalSGD(m2.parameters(), o2, comm, ModelAverager(m2, o2, comm), period=2)
    train_steps(plain, m2, X, Y, K, b, r, M)
    out = {"beta0_max_diff": float((flat(m1) - flat(m2)).abs().max())}
    # lr = 1: the outer step is SGD(momentum=beta, lr=alpha) on the pseudo-gradient x0 - mean(x)
    beta, alpha = 0.7, 0.5
    m = mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    s = SlowMo(ARSGD(m.parameters(), opt, comm), ModelAverager(m, opt, comm), tau=1, beta=beta, alpha=alpha)
    s.on_start()
    ref = [p.detach().clone() for p in m.parameters()]
    ref_opt = torch.optim.SGD(ref, lr=alpha, momentum=beta)
    errs = []
    for k in range(3):
        g = torch.Generator().manual_seed(100 + k)
        deltas = [[torch.randn(p.shape, generator=g) * 0.1 for p in ref] for _ in range(M)]
        with torch.no_grad():  # every rank moves its parameters differently (as local steps would)
            for p, d in zip(m.parameters(), deltas[r]):
                p.data.add_(d.to(device))
        s.outer_step()
        for i, p in enumerate(ref):  # pseudo-gradient x0 - mean(x) = -mean(delta)
            p.grad = -torch.stack([deltas[w][i] for w in range(M)]).mean(0).to(device)
        ref_opt.step()
        errs.append(max(float((p.detach() - q).abs().max()) for p, q in zip(m.parameters(), ref)))
    out["lr1_max_diff"] = max(errs)
    # no-average variant: the ranks are NOT forced together
    m = mlp(device)
    opt = sgd(m)
    s = SlowMo(LocalSGD(m.parameters(), opt, comm, ModelAverager(m, opt, comm), period=1000),
               ModelAverager(m, opt, comm), tau=2, beta=0.5, alpha=1.0, average=False)
    train_steps(s, m, X, Y, 4, b, r, M)
    out["no_average_distinct"] = len(set(comm.allgather_object(digest(m)))) == M
    return out


def check_hierarchical(comm: Communicator, device) -> dict:
    r, M, b, K = comm.rank, comm.world_size, 2, 12
    periods = (2, 3, 6)
    X, Y = data(M * b * K, device)
    out = {"periods": periods}
    for name, (hs, ns) in {"singles_pairs": (1, 2), "pairs_world": (2, M)}.items():
        spy = SpyComm(comm)
        m = mlp(device)
        opt = sgd(m)
        algo = HierarchicalSGD(m.parameters(), opt, spy, ModelAverager(m, opt, spy), periods,
                               groups_from_sizes(M, hs, ns))
        steps = []

        def after(n: int) -> None:
            calls = list(spy.calls)
            spy.calls.clear()
            ds = comm.allgather_object(digest(m))
            steps.append({"step": n, "groups": calls, "equal_to": [k for k, d in enumerate(ds) if d == ds[r]]})

        train_steps(algo, m, X, Y, K, b, r, M, after)
        out[name] = {"sizes": (hs, ns), "steps": steps, "history": algo.history}
    return out


def check_seeded_run(comm: Communicator, device) -> dict:
    r, M, b = comm.rank, comm.world_size, 4
    X, Y = data(M * b * 8, device)
    m = mlp(device)
    opt = sgd(m)
    train_steps(ARSGD(m.parameters(), opt, comm), m, X, Y, 4, b, r, M)
    algo = LocalSGD(m.parameters(), opt, comm, ModelAverager(m, opt, comm), period=2)
    train_steps(algo, m, X[M * b * 4:], Y[M * b * 4:], 4, b, r, M)
    return {"params": flat(m).tolist(), "digests": comm.allgather_object(digest(m))}


ONE_STEP_PARAMS = {"arsgd": {}, "dpsgd": {}, "local_sgd": {"period": 2}, "post_local_sgd": {"period": 1, "switch_step": 1},
                   "hierarchical": {"household_period": 1, "neighbourhood_period": 2, "world_period": 3,
                                    "household_size": 1},
                   "slowmo": {"base": "local_sgd", "base_params": {"period": 2}, "tau": 2},
                   "swarm": {"local_steps": 2}, "easgd": {"tau": 2}, "timed_local_sgd": {"round_seconds": 60}}


def check_one_step(comm: Communicator, device) -> dict:
    """Two steps of every synchronous algorithm (``ONE_STEP_PARAMS``; asynchronous ones run their
    own threads and have their own checks) on ``device``: did the parameters move, are the ranks
    in sync (``in_sync``), and the digest of the parameters (to compare across ranks)."""
    r, M, b = comm.rank, comm.world_size, 4
    X, Y = data(M * b * 2, device)
    res = {}
    for name in sorted(ONE_STEP_PARAMS):
        m = mlp(device)
        start = flat(m)
        opt = sgd(m)
        try:
            algo = build_algorithm(name, ONE_STEP_PARAMS.get(name, {}),
                                   BuildContext(m, opt, comm, ModelAverager(m, opt, comm), groups=[{} for _ in range(M)]))
            algo.on_start()
            train_steps(algo, m, X, Y, 2, b, r, M)
            res[name] = {"moved": float((flat(m) - start).abs().max()), "in_sync": bool(algo.in_sync()),
                         "digest": digest(m), "device": str(next(m.parameters()).device)}
        except Exception as e:  # noqa: BLE001 - reported, the caller decides
            res[name] = {"error": f"{type(e).__name__}: {e}"}
    return res


CHECKS = {"comm": check_comm, "arsgd": check_arsgd, "local_sgd": check_local_sgd, "slowmo": check_slowmo,
          "hierarchical": check_hierarchical, "seeded_run": check_seeded_run, "one_step": check_one_step}


def run_checks(backend: str, checks: list[str], bucket_bytes: int = 256) -> dict:
    """Worker function: run ``checks`` with a real ``backend`` communicator; per-rank results
    are gathered, so rank 0's return value holds every rank's (TorchDistributor returns only it)."""
    torch.set_num_threads(1)
    requested = "auto" if backend == "torch" else "cpu"
    comm = make_communicator(backend, bucket_bytes=bucket_bytes,
                             device_kind=device_kind(requested, torch.cuda.is_available()))
    try:
        device = current_device(requested, comm.local_rank)
        comm.bind_device(device)
        mine = {"rank": comm.rank, "world": comm.world_size, "device": str(device)}
        for name in checks:
            mine[name] = CHECKS[name](comm, device)
        return {"rank": comm.rank, "ranks": comm.allgather_object(mine)}
    finally:
        comm.shutdown()


def launch_checks(launcher: str, workers: int, checks: list[str], spark=None, torch_local_mode: bool = False,
                  use_gpu: bool = False) -> list[dict]:
    """Run ``run_checks`` on ``workers`` processes with a Spark launcher; every rank's results.
    ``use_gpu`` asks TorchDistributor for GPUs (from the caller's choice, not the driver's CUDA)."""
    if launcher == "horovod":
        import horovod.spark

        res = horovod.spark.run(run_checks, args=("horovod", checks), num_proc=workers, use_gloo=True,
                                start_timeout=180, verbose=0)
        return res[0]["ranks"]
    from pyspark.ml.torch.distributor import TorchDistributor

    res = TorchDistributor(num_processes=workers, local_mode=torch_local_mode,
                           use_gpu=use_gpu).run(run_checks, "torch", checks)
    return res["ranks"]


def main(argv=None) -> int:
    import argparse
    import json

    from ..spark import get_spark

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=["horovod", "torch"], default="torch")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--local-mode", action="store_true", help="TorchDistributor local_mode")
    p.add_argument("--gpu", action="store_true", help="TorchDistributor use_gpu (one GPU per process)")
    p.add_argument("--checks", default="comm,arsgd,local_sgd,slowmo,seeded_run,one_step")
    a = p.parse_args(argv)
    get_spark()
    ranks = launch_checks(a.launcher, a.workers, a.checks.split(","), torch_local_mode=a.local_mode,
                          use_gpu=a.gpu)
    print(json.dumps(ranks[0], indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
