"""Ray across several nodes: join a cluster, place workers node by node, and rendezvous the
torch.distributed process group on the address of rank 0's node.

Placement (`place_slots`): a *slot* is one bundle of resources that holds the workers that must
share a device, e.g. ``{"GPU": 1, "CPU": 2}`` for a colocated teacher / student pair (each
actor then asks for ``num_gpus=0.5`` inside it) or ``{"GPU": 1}`` for a worker alone. Nodes are
filled in order (the one this process runs on first, then by node id), as many slots on each
as its resources allow (at most ``slots_per_node``), and each node's slots form one
``STRICT_PACK`` placement group pinned to that node (``bundle_label_selector`` on the node id).
Slots come back in node order, so consecutive ranks share a node: FSDP's collectives stay on
NVLink as far as they can. A colocated pair never straddles two nodes: it is one bundle.

Rendezvous (`form_process_group`): rank 0's actor reports ``ray.util.get_node_ip_address()``
and a port free on its node; every member calls ``init_process_group`` with
``tcp://IP:PORT``. Not 127.0.0.1: members on other nodes must reach it.

NCCL across nodes: the nodes must reach each other on the interface NCCL picks; set
``NCCL_SOCKET_IFNAME`` (e.g. ``eth0``, or ``^lo,docker`` to exclude) in the Ray runtime
environment when it picks the wrong one, ``NCCL_IB_HCA`` to choose InfiniBand adapters (or
``NCCL_IB_DISABLE=1`` without InfiniBand), and ``NCCL_DEBUG=INFO`` to see the transport chosen.
Gloo's counterpart is ``GLOO_SOCKET_IFNAME``. Ports: the rendezvous port and NCCL's own
(ephemeral) ports must be open between the nodes. These are the collective libraries'
variables, passed to the workers with ``runtime_env={"env_vars": {...}}`` (`connect`).
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

NODE_ID_LABEL = "ray.io/node-id"


def _check_address(address: Optional[str]) -> None:
    if address is None or address == "auto":
        return
    if not isinstance(address, str) or not re.fullmatch(r"(ray://)?[\w.\-\[\]:]+:\d+", address):
        raise ValueError(f"address: expected None (start a local Ray), 'auto' (the cluster this machine joined) or "
                         f"HOST:PORT of a running head node, got {address!r}")


def connect(address: Optional[str] = None, *, runtime_env: Optional[dict] = None, **local_options) -> None:
    """Starts a local Ray (``address=None``, with ``local_options`` such as num_cpus / num_gpus)
    or joins a running cluster (``"auto"`` or ``"HOST:PORT"``; its resources are the cluster's,
    so ``local_options`` must be empty). ``runtime_env`` goes to every worker (e.g.
    ``{"env_vars": {"PYTHONPATH": ..., "NCCL_SOCKET_IFNAME": ...}}``)."""
    import ray

    _check_address(address)
    if address is not None and local_options:
        raise ValueError(f"local_options: {sorted(local_options)} apply to a local Ray only; a cluster joined at "
                         f"{address!r} has its own resources")
    ray.init(address=address, runtime_env=runtime_env, include_dashboard=False, log_to_driver=False,
             configure_logging=False, **local_options)


@dataclass(frozen=True)
class Node:
    """An alive Ray node: its id, IP and resources (``{"CPU": 16.0, "GPU": 8.0, ...}``)."""

    node_id: str
    ip: str
    resources: dict


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes: the caller's node first, then by node id."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [Node(entry["NodeID"], entry["NodeManagerAddress"], dict(entry["Resources"]))
             for entry in ray.nodes() if entry["Alive"]]
    return sorted(nodes, key=lambda node: (node.node_id != here, node.node_id))


def slots_on(node: Node, bundle: dict) -> int:
    """How many ``bundle``s fit in ``node``'s total resources."""
    return min(int(node.resources.get(name, 0.0) // amount) for name, amount in bundle.items() if amount > 0)


@dataclass(frozen=True)
class Slot:
    """A bundle on a known node: `actor_options` schedules an actor into it."""

    node_id: str
    placement_group: object
    bundle_index: int

    def actor_options(self, **resources) -> dict:
        """``ActorClass.options(**slot.actor_options(num_cpus=1, num_gpus=0.5))``: the actor
        runs in this bundle and takes ``resources`` out of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=self.bundle_index)
        return dict(scheduling_strategy=strategy, **resources)


def place_slots(count: int, bundle: dict, *, slots_per_node: Optional[int] = None, timeout_s: float = 120.0,
                nodes: Optional[list[Node]] = None) -> list[Slot]:
    """Reserves ``count`` slots of ``bundle`` (see the module docstring), one STRICT_PACK
    placement group per node used; raises RuntimeError when the cluster cannot hold them or
    a group is not scheduled within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if count < 1 or not any(amount > 0 for amount in bundle.values()) or any(amount < 0 for amount in bundle.values()):
        raise ValueError(f"count, bundle: expected count >= 1 and a bundle of amounts >= 0, one at least > 0; got "
                         f"{count}, {bundle}")
    if slots_per_node is not None and slots_per_node < 1:
        raise ValueError(f"slots_per_node: expected None or >= 1, got {slots_per_node}")
    nodes = alive_nodes() if nodes is None else nodes
    plan, left = [], count
    for node in nodes:
        take = min(left, slots_on(node, bundle), slots_per_node or left)
        if take > 0:
            plan.append((node, take))
            left -= take
    if left:
        capacity = {node.node_id[:8]: slots_on(node, bundle) for node in nodes}
        raise RuntimeError(f"place_slots: {count} slots of {bundle} do not fit the cluster (slots per node: "
                           f"{capacity}, slots_per_node={slots_per_node})")
    groups = [placement_group([bundle] * take, strategy="STRICT_PACK",
                              bundle_label_selector=[{NODE_ID_LABEL: node.node_id}] * take)
              for node, take in plan]
    ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        for group in groups:
            remove_placement_group(group)
        raise RuntimeError(f"place_slots: {len(groups) - len(ready)} of {len(groups)} node placement groups were not "
                           f"scheduled within {timeout_s} s (resources taken by other jobs?)")
    return [Slot(node.node_id, group, index) for (node, take), group in zip(plan, groups) for index in range(take)]


def release_slots(slots: list[Slot]) -> None:
    """Removes the placement groups of ``slots`` (their actors should be gone first)."""
    from ray.util.placement_group import remove_placement_group

    for group in {id(slot.placement_group): slot.placement_group for slot in slots}.values():
        remove_placement_group(group)


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def tcp_init_method(host: str, port: int) -> str:
    """``tcp://HOST:PORT`` (IPv6 hosts in brackets) for ``init_process_group``."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ClusterMember:
    """Mixed into worker actors: where the actor runs, and joining the process group."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous_endpoint(self) -> tuple[str, int]:
        """(this node's IP as Ray reports it, a port free on it)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join_process_group(self, init_method: str, rank: int, world_size: int, backend: str,
                           timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def form_process_group(actors: list, backend: str, *, timeout_s: float = 300.0) -> str:
    """Joins ``actors`` (`ClusterMember` actor handles, in rank order) into one process group
    of ``backend`` ("nccl" | "gloo"), rendezvousing on rank 0's node. Returns the init method."""
    import ray

    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected nccl or gloo, got {backend!r}")
    host, port = ray.get(actors[0].rendezvous_endpoint.remote())
    init_method = tcp_init_method(host, port)
    ray.get([actor.join_process_group.remote(init_method, rank, len(actors), backend, timeout_s)
             for rank, actor in enumerate(actors)])
    return init_method
