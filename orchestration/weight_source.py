"""The trainer's side of the weight sync, as methods of student rank 0's Ray actor: a
`weight_sync.WeightSender` over the student's parameters broadcasting over the weight group
(gloo / NCCL) to rollout workers elsewhere; `weight_sync.WeightPusher`s writing into the shared
buffers of rollout workers on the same GPU or node (`map_rollout_weights` once a worker, then
`push_weights`)."""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

from .flat_parameters import flatten_parameters
from .shared_weights import SharedWeights
from .weight_sync import UpdateMetrics, WeightPusher, WeightSender


class WeightSource:
    """Mixed into `student.StudentWorker` (``self.model``). Broadcast: the bucket plan is made
    once, by `open_weight_sender`, which the group's methods need. Push: `map_rollout_weights`
    once a rollout worker, then `push_weights` an update."""

    _weight_sender: Optional[WeightSender] = None
    _weight_pushers: tuple = ()

    def open_weight_sender(self, bucket_bytes: int) -> list[tuple]:
        """Plans the buckets over the model's parameters; their metadata, ``[(names, dtypes as
        names, shapes)]`` in send order (the arguments of the receivers' per-bucket calls)."""
        self._weight_sender = WeightSender(self.model, bucket_bytes=bucket_bytes)
        return [(bucket.names, tuple(str(dtype).removeprefix("torch.") for dtype in bucket.dtypes), bucket.shapes)
                for bucket in self._weight_sender.buckets]

    def _sender(self) -> WeightSender:
        if self._weight_sender is None:
            raise RuntimeError("weight sync: call open_weight_sender first")
        return self._weight_sender

    def init_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        """Joins the weight group as its rank 0 (the rollout workers join at the same time)."""
        self._sender().init_group(master_address, master_port, world_size, group_name, backend,
                                  timeout=timedelta(minutes=10))

    def send_weights(self, weight_version: int) -> dict:
        """Broadcasts every bucket (`WeightSender.send`); the update's metrics."""
        return self._sender().send(weight_version).as_dict()

    def flatten_weights(self) -> None:
        """Moves the model's parameters into one flat buffer (`flat_parameters`) before
        `map_rollout_weights`: a push into a rollout worker (flattened too) is then one copy."""
        flatten_parameters(self.model)

    def map_rollout_weights(self, shared: SharedWeights) -> None:
        """Maps a rollout worker's shared buffer (`rollout.RolloutWorker.share_weight_buffer`), once
        a worker; raises if its layout is not the model's (the on-policy modes train replicas: the
        model is whole here)."""
        self._weight_pushers += (WeightPusher(self.model, shared),)

    def push_weights(self, weight_version: int) -> dict:
        """Writes the weights into every mapped rollout worker's buffer (`WeightPusher.push`, one
        after the other): bytes, buckets (one a worker), seconds and GB/s summed over them, and
        ``lock_wait_seconds``, the time spent waiting for their running generations."""
        if not self._weight_pushers:
            raise RuntimeError("push_weights: call map_rollout_weights first")
        updates = [pusher.push(weight_version) for pusher in self._weight_pushers]
        metrics = UpdateMetrics(weight_version, sum(update.bytes for update, _ in updates), len(updates),
                                sum(update.seconds for update, _ in updates))
        return dict(metrics.as_dict(), lock_wait_seconds=sum(waited for _, waited in updates))
