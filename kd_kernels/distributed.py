"""Vocab parallel: this rank's slice of the vocab, and the few collectives that combine
per-rank row statistics. Everything exchanged is O(N·k) values or O(N·world) scalars.

Convention (Megatron's ColumnParallelLinear / VocabParallelEmbedding): rank r of a group of
W holds global vocab rows ``[r·V_local, (r+1)·V_local)`` of the lm_head; ``vocab_size`` is
the global V*, so the last ranks may hold padding rows that do not exist.

Autograd: the loss is computed identically on every rank from the combined statistics,
so the gradient that flows back to each rank's local statistic is already the whole
gradient: the sum's backward is the identity and the gather's backward keeps this rank's
slice. The replicated hidden states receive ``Σ_r dlogits_r @ W_r``, the all-reduce that
Megatron's column-parallel output layer does in its backward; do not all-reduce it again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .candidates import merge_candidates
from .topk import TopK


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's lm_head rows sit in the global vocab."""

    group: object
    rank: int
    world_size: int
    local_columns: int  # V_local: rows of this rank's lm_head (or columns of its logits)
    vocab_size: int  # the global V*

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_columns

    @property
    def existing(self) -> int:
        """Columns of this shard below V* (padding rows past it do not exist)."""
        return max(0, min(self.local_columns, self.vocab_size - self.vocab_start))


def vocab_shard(group, local_columns: int, vocab_size: Optional[int]) -> Optional[VocabShard]:
    """The shard of a group of more than one rank, else None (unsharded)."""
    if group is None:
        return None
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None
    total = local_columns * world_size
    return VocabShard(group, dist.get_rank(group), world_size, local_columns, total if vocab_size is None else vocab_size)


def all_gather(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``[W, ...]``: every rank's tensor, in rank order (no autograd)."""
    return _all_gather(tensor, shard)


def _all_gather(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(shard.world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=shard.group)
    return torch.stack(parts)


def _all_reduce_sum(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    import torch.distributed as dist

    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, group=shard.group)
    return tensor


class _SumOverRanks(torch.autograd.Function):
    """Sum over the group; backward is the identity (the loss is replicated on every rank)."""

    @staticmethod
    def forward(ctx, tensor, shard):
        return _all_reduce_sum(tensor, shard)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherOverRanks(torch.autograd.Function):
    """``[W, ...]`` of every rank's tensor; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor, shard):
        ctx.rank = shard.rank
        return _all_gather(tensor, shard)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


class _ReplicatedInput(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients over the group."""

    @staticmethod
    def forward(ctx, tensor, shard):
        ctx.shard = shard
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.shard), None


def sum_over_ranks(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    return _SumOverRanks.apply(tensor, shard)


def gather_over_ranks(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    return _GatherOverRanks.apply(tensor, shard)


def replicated_input(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    return _ReplicatedInput.apply(tensor, shard)


def all_reduce_sum_(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """In-place sum over the group (no autograd)."""
    import torch.distributed as dist

    dist.all_reduce(tensor, group=shard.group)
    return tensor


def combine_logsumexp(local_lse: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``[N]`` logsumexp over the whole vocab from each rank's ``[N]`` (differentiable)."""
    return torch.logsumexp(gather_over_ranks(local_lse, shard), dim=0)


def combine_topk(values: torch.Tensor, ids: torch.Tensor, local_lse: torch.Tensor, k: int, temperature: float,
                 shard: VocabShard) -> TopK:
    """The exact global `TopK` from each rank's top-k candidates: values ``[N, k]`` tempered
    logits (-inf where missing), ids ``[N, k]`` global, local_lse ``[N]`` (no autograd).
    Gathers N·k values, N·k int32 ids and N scalars from each rank: N·(8k + 4)·W bytes with
    float32 values."""
    all_values = all_gather(values, shard)  # [W, N, k], ranks in ascending order
    all_ids = all_gather(ids.to(torch.int32), shard).long()  # 4 + 4 bytes a candidate
    num_rows = values.shape[0]
    return merge_candidates(all_values.permute(1, 0, 2).reshape(num_rows, -1),
                            all_ids.permute(1, 0, 2).reshape(num_rows, -1), all_gather(local_lse, shard).T, k,
                            temperature)


def combine_argmax(local_max: torch.Tensor, local_argmax: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``[N]`` global argmax: the first rank (lowest ids) holding the maximum wins."""
    maxima = _all_gather(local_max.detach().float(), shard)
    argmaxes = _all_gather(local_argmax.to(torch.int32), shard).long()  # vocab ids fit in int32
    return argmaxes.gather(0, maxima.argmax(dim=0, keepdim=True)).squeeze(0)


class CollectiveBytes:
    """Context manager counting the bytes the collectives deliver to this rank while it is
    open: an all_gather delivers W inputs, an all_reduce one tensor (ring traffic is about
    twice that). For checking communication budgets in tests and benchmarks."""

    def __enter__(self) -> "CollectiveBytes":
        import torch.distributed as dist

        self.total = 0
        self._all_gather, self._all_reduce = dist.all_gather, dist.all_reduce

        def all_gather(outputs, tensor, *args, **kwargs):
            self.total += sum(t.numel() * t.element_size() for t in outputs)
            return self._all_gather(outputs, tensor, *args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size()
            return self._all_reduce(tensor, *args, **kwargs)
        dist.all_gather, dist.all_reduce = all_gather, all_reduce
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_gather, dist.all_reduce = self._all_gather, self._all_reduce
