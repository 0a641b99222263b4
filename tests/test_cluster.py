"""A Ray cluster of two nodes on one machine (``ray.cluster_utils.Cluster``): slots placed node
by node, and a gloo process group across the nodes that rendezvouses on rank 0's node."""
import os

import pytest

from helpers import python_path
from orchestration.cluster import (ClusterMember, Node, connect, form_process_group, place_slots, release_slots,
                                   tcp_init_method)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, resources={"node_a": 1},
                                                                include_dashboard=False))
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    cluster.wait_for_nodes()
    connect(cluster.address, runtime_env={"env_vars": {"PYTHONPATH": python_path(root, os.path.join(root, "tests"))}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


class _Member(ClusterMember):
    def custom_resources(self) -> list:
        """The node's custom resources ("node_a" / "node_b"): which node this actor runs on."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        node = next(entry for entry in ray.nodes() if entry["NodeID"] == here)
        return sorted(name for name in node["Resources"] if name.startswith("node_") and not name.startswith("node:"))

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        return tensor.item()

    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def test_slots_fill_each_node_in_turn_and_a_process_group_spans_them(two_nodes):
    slots = place_slots(2, {"CPU": 1}, slots_per_node=1)
    assert len({slot.node_id for slot in slots}) == 2  # one slot a node
    member = ray.remote(_Member)
    actors = [member.options(**slot.actor_options(num_cpus=1)).remote() for slot in slots]
    assert ray.get([actor.node_id.remote() for actor in actors]) == [slot.node_id for slot in slots]
    assert sorted(name for actor in actors for name in ray.get(actor.custom_resources.remote())) == ["node_a",
                                                                                                      "node_b"]
    init_method = form_process_group(actors, "gloo", timeout_s=60)
    host = ray.get(actors[0].rendezvous_endpoint.remote())[0]
    assert init_method.startswith(f"tcp://{host}:") and host == ray.util.get_node_ip_address()
    assert ray.get([actor.rank.remote() for actor in actors]) == [0, 1]
    assert ray.get([actor.all_reduce.remote(float(rank + 1)) for rank, actor in enumerate(actors)]) == [3.0, 3.0]
    for actor in actors:
        ray.kill(actor)
    release_slots(slots)


def test_colocated_pairs_share_their_slot_and_a_node_is_filled_first(two_nodes):
    slots = place_slots(2, {"CPU": 2})  # each node holds one bundle of 2 CPUs
    assert slots[0].node_id != slots[1].node_id
    member = ray.remote(_Member)
    pair = [member.options(**slots[1].actor_options(num_cpus=1)).remote() for _ in range(2)]  # on the second node
    assert ray.get([actor.node_id.remote() for actor in pair]) == [slots[1].node_id] * 2
    for actor in pair:
        ray.kill(actor)
    release_slots(slots)
    packed = place_slots(2, {"CPU": 1})  # both fit the first node: packed there
    assert packed[0].node_id == packed[1].node_id == slots[0].node_id
    release_slots(packed)


def test_what_cannot_be_placed_is_refused(two_nodes):
    with pytest.raises(RuntimeError, match=r"3 slots of \{'CPU': 2\} do not fit the cluster"):
        place_slots(3, {"CPU": 2})
    with pytest.raises(ValueError, match="slots_per_node"):
        place_slots(1, {"CPU": 1}, slots_per_node=0)


def test_addresses_and_init_methods():
    from orchestration.cluster import _check_address, slots_on

    for good in (None, "auto", "10.0.0.1:6379", "head.example:6379", "ray://10.0.0.1:10001"):
        _check_address(good)
    with pytest.raises(ValueError, match="address: expected None"):
        _check_address("10.0.0.1")
    with pytest.raises(ValueError, match="local_options"):
        connect("auto", num_cpus=4)
    assert tcp_init_method("10.0.0.1", 29500) == "tcp://10.0.0.1:29500"
    assert tcp_init_method("fe80::1", 29500) == "tcp://[fe80::1]:29500"
    node = Node("id", "10.0.0.1", {"CPU": 16.0, "GPU": 8.0})
    assert [slots_on(node, bundle) for bundle in ({"GPU": 1, "CPU": 2}, {"GPU": 1, "CPU": 4}, {"TPU": 1})] == [8, 4, 0]


def test_every_member_of_the_process_group_rendezvouses_on_the_node_ip():
    from orchestration.process_group import worlds

    for transfer, members in (("nccl", 3), ("object_store", 2)):  # nccl: the teacher joins the students' group
        teachers, students = worlds(transfer, 1, 2, "cuda", host="10.0.0.7", port=29500)
        joined = [world for world in teachers + students if world is not None]
        assert len(joined) == members and {(world.host, world.port) for world in joined} == {("10.0.0.7", 29500)}
