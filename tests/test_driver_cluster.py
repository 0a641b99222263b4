"""The driver on a Ray cluster of two nodes on one machine (``ray.cluster_utils.Cluster``):
it joins at the cluster's address, places its workers with one placement group per node and
rendezvouses the students' gloo process group across the nodes."""
import json
import math
import os

import pytest

from test_orchestration import _tiny as tiny_config

ray = pytest.importorskip("ray")


@pytest.fixture
def two_nodes():
    """A head node of 1 CPU and a second node of 2: three one-CPU worker slots, node by node."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.mark.slow  # two Ray nodes start, then three workers import torch and train
def test_the_driver_trains_with_workers_on_two_nodes(two_nodes, tmp_path):
    from orchestration import checkpoint
    from orchestration.driver import run

    config = tiny_config(tmp_path, "cluster", ray_address=two_nodes.address, student_workers=2, steps=3,
                         checkpoint_every=2, max_corpus_bytes=30_000)
    summary = run(config, progress=False)
    assert not ray.is_initialized()  # the driver joined the cluster, and left it
    head, other = (node["NodeID"] for node in sorted(
        (node for node in ray_nodes(two_nodes) if node["Alive"]), key=lambda node: node["Resources"]["CPU"]))
    # the driver fills its own node (the head, one slot) first: student-0 there, student-1 and the teacher on the other
    assert summary["nodes"] == {"student-0": head, "student-1": other, "teacher-0": other}
    with open(os.path.join(config.output_dir, "workers.json")) as handle:
        assert {name: entry["node"] for name, entry in json.load(handle).items()} == summary["nodes"]
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["teacher-0_peak_rss_mib"] > 0 and
               row["student-1_peak_rss_mib"] > 0 for row in rows)
    assert math.isfinite(summary["student_held_out_ce"]) and math.isfinite(summary["teacher_held_out_ce"])
    assert summary["checkpoint"] == checkpoint.path_of(config.output_dir, 2)
    assert checkpoint.candidates(config.output_dir) == [checkpoint.path_of(config.output_dir, step) for step in (2, 1)]


def ray_nodes(cluster) -> list:
    """The cluster's nodes, read by a short-lived connection of this process."""
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return ray.nodes()
    finally:
        ray.shutdown()


@pytest.mark.slow  # two Ray nodes start, then two fused actors import torch and train
def test_fused_pairs_take_one_slot_each_across_two_nodes(two_nodes, tmp_path):
    from orchestration.driver import run

    config = tiny_config(tmp_path, "fused", ray_address=two_nodes.address, placement="fused", teacher_workers=2,
                         student_workers=2, steps=2, checkpoint_every=0, max_corpus_bytes=30_000)
    summary = run(config, progress=False)
    head, other = (node["NodeID"] for node in sorted(
        (node for node in ray_nodes(two_nodes) if node["Alive"]), key=lambda node: node["Resources"]["CPU"]))
    # pair 0 in the head's one slot, pair 1 on the other node: each pair's two workers in one process
    assert summary["nodes"] == {"teacher-0": head, "student-0": head, "teacher-1": other, "student-1": other}
    with open(os.path.join(config.output_dir, "workers.json")) as handle:
        workers = json.load(handle)
    assert workers["teacher-0"]["pid"] == workers["student-0"]["pid"] != workers["teacher-1"]["pid"]
    assert workers["teacher-1"]["pid"] == workers["student-1"]["pid"]
    assert summary["placement"] == "fused" and summary["transfer"] == "in_process"
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert [row["step"] for row in rows] == [0, 1] and all(math.isfinite(row["loss"]) for row in rows)
