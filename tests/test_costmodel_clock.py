"""The cluster cost model charged by the simulated clock (launcher inprocess): every synchronous
algorithm runs under it unchanged and gives the free in-process run's parameters bit for bit; the
same seed gives the same run to the bit, its virtual time, communication share and bytes per link
included; a slower link costs more virtual time and moves the same bytes. The formulas themselves:
tests/test_costmodel.py."""
from __future__ import annotations

import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from test_inprocess_launcher import write_household_shards
from train_fixtures import write_digit_shards

#: every registered synchronous algorithm (hierarchical on a households layout: its own test below)
SYNCHRONOUS = [{"name": "arsgd"}, {"name": "local_sgd", "params": {"period": 3}},
               {"name": "post_local_sgd", "params": {"period": 2, "switch_step": 3}}, {"name": "dpsgd"},
               {"name": "swarm", "params": {"local_steps": 2, "topology": "ring"}}, {"name": "easgd"},
               {"name": "slowmo", "params": {"base": "local_sgd", "base_params": {"period": 2}}}]
#: no network cost: no latency, a bandwidth no payload notices
FREE = {"inter_latency_s": 0.0, "inter_bytes_per_s": 1e300, "intra_latency_s": 0.0, "intra_bytes_per_s": 1e300,
        "nodes": 2}


@pytest.fixture(scope="module")
def digits4(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits4"), workers=4, n_train=256, n_test=64, n_val=32)


def _cfg(manifest, out, algorithm: dict, **kw) -> TrainConfig:
    base = dict(manifest=str(manifest), output=str(out), launcher="inprocess", model="lenet5", epochs=1,
                batch_size=16, optimizer="sgd", lr=0.05, momentum=0.9, eval_every=4, max_steps=6, progress=False,
                algorithm=algorithm, debug={"record_param_digests": True},
                simulated_clock={"step_s": 0.01, "step_jitter": 0.0})
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("algorithm", SYNCHRONOUS, ids=[a["name"] for a in SYNCHRONOUS])
def test_a_synchronous_algorithm_under_the_cluster_clock_gives_the_free_runs_parameters(digits4, tmp_path, algorithm):
    free = train(_cfg(digits4, tmp_path / "free", algorithm))
    clocked = train(_cfg(digits4, tmp_path / "clocked", algorithm, cluster=FREE))
    assert "simulated_clock" not in free["ranks"][0]
    clock = clocked["ranks"][0]["simulated_clock"]
    assert clock["switches"] > 0 and clock["comm_share"] < 0.5
    assert [r["digests"] for r in clocked["ranks"]] == [r["digests"] for r in free["ranks"]]
    assert clocked["final_digests"] == free["final_digests"]
    # a real link changes the time, never a synchronous algorithm's parameters
    slow = train(_cfg(digits4, tmp_path / "slow", algorithm, cluster={"preset": "gbe1", "nodes": 2}))
    assert slow["final_digests"] == free["final_digests"]
    assert slow["ranks"][0]["simulated_clock"]["virtual_s"] > clock["virtual_s"]


def test_hierarchical_sgd_under_the_cluster_clock_gives_the_free_runs_parameters(tmp_path):
    manifest = write_household_shards(tmp_path / "h", workers=4, households=2, household_shards=1, n_train=256)
    algorithm = {"name": "hierarchical", "params": {"household_period": 1, "neighbourhood_period": 2,
                                                    "world_period": 4}}
    kw = {"batch_rule": "household", "lr_scaling": "household", "batch_size": 32}
    free = train(_cfg(manifest, tmp_path / "free", algorithm, **kw))
    clocked = train(_cfg(manifest, tmp_path / "clocked", algorithm, cluster={"preset": "gbe10", "nodes": 2}, **kw))
    assert clocked["ranks"][0]["simulated_clock"]["virtual_s"] > 0
    assert [r["digests"] for r in clocked["ranks"]] == [r["digests"] for r in free["ranks"]]
    assert clocked["final_digests"] == free["final_digests"]


def test_the_same_seed_gives_the_same_costed_run_to_the_bit(digits4, tmp_path):
    cfg = _cfg(digits4, tmp_path, {"name": "adpsgd", "params": {"round_steps": 2}},
               cluster={"preset": "gbe10", "nodes": 2}, simulated_clock={"step_s": 0.001, "step_jitter": 0.1})
    a = train(cfg.model_copy(update={"output": str(tmp_path / "a")}))
    b = train(cfg.model_copy(update={"output": str(tmp_path / "b")}))
    assert a["ranks"][0]["simulated_clock"] == b["ranks"][0]["simulated_clock"]
    assert [r["digests"] for r in a["ranks"]] == [r["digests"] for r in b["ranks"]]
    assert a["final_digests"] == b["final_digests"]


def test_a_slower_link_costs_time_and_moves_the_same_bytes(digits4, tmp_path):
    runs = {p: train(_cfg(digits4, tmp_path / p, {"name": "arsgd"}, cluster={"preset": p, "nodes": 2}))
            for p in ("gbe1", "ib100")}
    slow, fast = (runs[p]["ranks"][0]["simulated_clock"] for p in ("gbe1", "ib100"))
    assert slow["virtual_s"] > fast["virtual_s"] and slow["comm_share"] > fast["comm_share"]
    assert slow["bytes_per_link"] == fast["bytes_per_link"]
    # 2 nodes x 2 ranks: the ring crosses between the nodes both ways and stays inside each node
    assert set(slow["bytes_per_link"]) >= {"node0->node1", "node1->node0", "node0", "node1"}


def test_the_compute_profile_sets_the_step_time_at_the_runs_local_batch(digits4, tmp_path):
    # profile 8 -> 0.02 s, 32 -> 0.05 s; the run's local batch 16: 0.02 + (0.05 - 0.02) * 8 / 24 = 0.03 s.
    # No jitter and a free network: the 4 steps of the epoch (64 digits a worker, batch 16) take
    # 4 * 0.03 = 0.12 virtual seconds
    cluster = {**FREE, "compute_step_s": {8: 0.02, 32: 0.05}, "compute_source": "given for the test"}
    run = train(_cfg(digits4, tmp_path / "p", {"name": "arsgd"}, cluster=cluster,
                     simulated_clock={"step_jitter": 0.0}))
    assert run["steps"] == 4
    assert run["ranks"][0]["simulated_clock"]["virtual_s"] == pytest.approx(0.12, abs=1e-6)
    # a batch the profile does not cover: one line, before any rank starts
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        train(_cfg(digits4, tmp_path / "q", {"name": "arsgd"}, cluster={**cluster, "compute_step_s": {32: 0.05, 64: 0.1}},
                   simulated_clock={"step_jitter": 0.0}))
    assert "batch size 16 outside the profile's measured 32..64" in str(e.value) and "\n" not in str(e.value)
