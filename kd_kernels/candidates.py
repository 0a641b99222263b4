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
    logprobs, merged_ids = logprobs_(merged_values, merged_ids, lse)
    return TopK(logprobs, merged_ids.to(torch.int32), lse, temperature)


def logprobs_(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tempered values ``[R, k]`` minus their rows' logsumexp ``lse [R]``, in place, and the ids
    ``[R, k]`` of the -inf (missing) entries set to 0, in place. A row without a finite column
    (lse = -inf) keeps -inf entries, not NaN. Returns (values, ids)."""
    values.sub_(torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return values, ids.masked_fill_(torch.isneginf(values), 0)
