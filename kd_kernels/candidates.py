"""The exact top-k of several candidate sets: the teacher's per-slice (tiled schedule) and
per-rank (vocab parallel) top-k merged into a row's top-k and its log-probs."""
from __future__ import annotations

import torch

from .topk import TopK


def top_of_candidates(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values, ids ``[N, C]``: candidate sets concatenated in ascending id order, each ordered
    by value with the lower id first among equal values -> their k largest (values ``[N, k]``,
    ids ``[N, k]``), the lower id first among equal values (a stable descending sort keeps the
    sets' order)."""
    ranked, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ranked[:, :k], ids.gather(-1, order[:, :k])


def merge_candidates(values: torch.Tensor, ids: torch.Tensor, local_lses: torch.Tensor, k: int,
                     temperature: float) -> TopK:
    """The exact top-k of a row from its parts' top-k: values ``[N, W·k]`` tempered logits
    (-inf where a part has fewer than k columns) and their ids, the parts concatenated in
    ascending id order, and each part's logsumexp ``[N, W]``. Log-probs against the whole row's
    logsumexp; id 0 where a log-prob is -inf."""
    lse = torch.logsumexp(local_lses, dim=-1)
    merged_values, merged_ids = top_of_candidates(values, ids, k)
    logprobs = merged_values - lse.unsqueeze(-1)
    merged_ids = torch.where(torch.isfinite(logprobs), merged_ids, 0)
    return TopK(logprobs, merged_ids.to(torch.int32), lse, temperature)
