"""One row's decision from its logits: the draft nodes the target accepts and the token
after them, by the request's rule (``rejection``), its logits shaped first where the
request asks (``processing``). The engine runs each row's decision on its own, so that a
row whose shaping or sampling fails fails alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifier_service.core.processing import Prefixes, chain_paths, shape_logits, tree_paths
from verifier_service.core.rejection import (
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    greedy_choices,
    warp_probs,
)
from verifier_service.core.step import Row, SequenceState


def pass_choices(rows: Sequence[Row], logits: torch.Tensor) -> list[int]:
    """The argmax of every position of the pass, in one call, when some row decides greedily
    from unshaped logits (else nothing: no row reads it)."""
    plain = any(row.sequence.request.sampling.greedy and not row.sequence.request.sampling.shapes_logits for row in rows)
    return greedy_choices(logits) if plain else []


def decide(row: Row, logits: torch.Tensor, choices: list[int], eos_token_ids: frozenset[int]) -> tuple[list[int], int]:
    """(accepted draft nodes, next token) for one row from its logits [verify + 1, vocab];
    ``choices``: their argmax, when the logits need no shaping (``pass_choices``)."""
    draft, sampling = row.draft[: row.verify], row.sequence.request.sampling
    if sampling.shapes_logits:
        logits = shape(row, logits, eos_token_ids)
        choices = greedy_choices(logits) if sampling.greedy else []
    if not sampling.greedy:
        return sample(row, logits)
    if row.tree:
        return accept_tree_greedy(choices, draft, row.parents[: row.verify])
    accepted, token = accept_greedy(choices, draft)
    return list(range(accepted)), token


def shape(row: Row, logits: torch.Tensor, eos_token_ids: frozenset[int]) -> torch.Tensor:
    """One row's logits [verify + 1, vocab] shaped by its request (``processing``), each
    position from its own prefix."""
    sequence, draft = row.sequence, row.draft[: row.verify]
    paths = tree_paths(draft, row.parents[: row.verify]) if row.tree else chain_paths(draft)
    where = Prefixes(sequence.request.prompt_ids, sequence.generated, paths, sequence.history)
    return shape_logits(logits, sequence.request.sampling, where, eos_token_ids)


def sample(row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
    """Sampled acceptance for one row. logits: [row.verify + 1, vocab]."""
    sequence, draft = row.sequence, row.draft[: row.verify]
    probs = warp_probs(logits, sequence.request.sampling)
    if row.tree:
        return accept_tree_sampled(probs, draft, row.parents[: row.verify], sequence.seed, first_position=len(sequence.generated))
    accepted, token = accept_sampled(probs, draft, sequence.seed, first_position=len(sequence.generated))
    return list(range(accepted)), token


def first_token(sequence: SequenceState, logits: torch.Tensor, eos_token_ids: frozenset[int]) -> int:
    """A prompt's first token from its last position's logits [1, vocab]."""
    sampling = sequence.request.sampling
    logits = shape_logits(logits, sampling, Prefixes(sequence.request.prompt_ids, [], [[]], sequence.history), eos_token_ids)
    if sampling.greedy:
        return greedy_choices(logits)[0]
    return accept_sampled(warp_probs(logits, sampling), [], sequence.seed, first_position=len(sequence.generated))[1]
