"""What a request asks of the target's logits before a token is chosen, applied per verified position.

``SamplingParams`` may ask for a ``logit_bias``, ``min_tokens`` and the
repetition, frequency and presence penalties. Each of those depends on the
output *before* the position it shapes (a frequency penalty counts the
tokens emitted so far), so a pass that verifies drafts must shape each of
its positions from that position's own prefix: the output so far plus the
draft tokens on the way to it (a chain's first i drafts; a tree node's
ancestors). Then the token chosen at every position, greedy or sampled, is
the one plain decoding with the same rules would choose there, and the
acceptance rules in ``rejection`` keep their guarantees unchanged: they see
the distribution plain decoding samples from.

The rules and their order are vLLM's (``vllm/v1/sample``), which are
OpenAI's and transformers' definitions:

1. ``logit_bias``: ``logits[token] += bias``.
2. ``min_tokens``: while fewer than ``min_tokens`` tokens precede the
   position, every end-of-sequence token is impossible (``-inf``).
3. ``repetition_penalty`` r (CTRL, Keskar et al. 2019; transformers'
   ``RepetitionPenaltyLogitsProcessor``): for each token in the prompt or
   the output so far, a positive logit is divided by r and a negative one
   multiplied by r.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI):
   ``logits[token] -= f * count + p * (count > 0)``, counting the output only.

Temperature, top-k and top-p come after (``rejection.warp_probs``).
Log-probabilities returned to clients are the target's own, before any of
this (vLLM's default, ``raw_logprobs``).

Cost: a sequence's ``TokenHistory`` keeps its prompt as a mask [vocab] and
its output's counts [vocab], each token read once (the prompt when the
first position is shaped, an output token on the step after it is
emitted). So shaping a row costs a few passes over its [positions, vocab]
logits, as sampling from them does, whatever the length of its context:
rebuilt from the token lists at every step, a 100k-token prompt alone
cost milliseconds per row per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier_service.core.rejection import SamplingParams


class TokenHistory:
    """One sequence's prompt and output as the penalties read them, kept between steps:
    which tokens the prompt holds ([vocab] bool) and how often each occurs in the output
    ([vocab] float32, exact integers), extended by the tokens emitted since the last call.

    A sequence's own: its prompt never changes and its output only grows, so the
    tokens past ``counted`` are the new ones. Prompt [4, 4], output [7] then [7, 4]:
    mask True at 4; counts 1 at 7, then 1 at 7 and 1 at 4 (only the 4 read again)."""

    def __init__(self) -> None:
        self._prompt_mask: torch.Tensor | None = None  # [vocab] bool
        self._counts: torch.Tensor | None = None  # [vocab] float32
        self.counted = 0  # output tokens in _counts
        self.tokens_read = 0  # prompt and output tokens read so far, each once

    def prompt_mask(self, prompt: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        if self._prompt_mask is None:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if prompt:
                mask[torch.tensor(prompt, dtype=torch.long, device=device)] = True
            self._prompt_mask, self.tokens_read = mask, self.tokens_read + len(prompt)
        return self._prompt_mask

    def output_counts(self, generated: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        new = generated[self.counted :]
        if new:
            # Whole numbers in float32, exact up to 2**24: the same counts one bincount of the whole output gives.
            self._counts += torch.bincount(torch.tensor(new, dtype=torch.long), minlength=vocab).to(device=device, dtype=torch.float32)
            self.counted, self.tokens_read = len(generated), self.tokens_read + len(new)
        return self._counts


@dataclass(frozen=True)
class Prefixes:
    """Where each row of a pass stands: the prompt, the output so far, and per scored
    position the draft tokens between that output and the position."""

    prompt: list[int]
    generated: list[int]
    paths: list[list[int]]  # per position: the drafts on the way to it (the root: [])
    # The sequence's, kept between its steps; None: read the lists afresh (the reference).
    history: TokenHistory | None = None


def chain_paths(draft: list[int]) -> list[list[int]]:
    """A chain's positions: the root, then after each draft token. [7, 8] -> [[], [7], [7, 8]]."""
    return [draft[:index] for index in range(len(draft) + 1)]


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """A tree's positions: the root, then each node's path of tokens from the root, itself included.

    tokens [7, 4, 8], parents [-1, -1, 0] -> [[], [7], [4], [7, 8]].
    """
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents):
        paths.append([*paths[parent + 1], token])
    return paths


def shape_logits(logits: torch.Tensor, params: SamplingParams, where: Prefixes, eos_token_ids: frozenset[int]) -> torch.Tensor:
    """The logits [positions, vocab] after ``params``' bias, ``min_tokens`` and penalties,
    each position shaped from its own prefix (module docstring). Unchanged when
    ``params`` asks for none of them."""
    if not params.shapes_logits:
        return logits
    assert logits.dim() == 2 and logits.shape[0] == len(where.paths), "one path per scored position"
    rows, vocab = logits.shape
    shaped = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=shaped.dtype, device=logits.device)
        shaped[:, ids] += bias
    if params.min_tokens and eos_token_ids:
        early = [row for row, path in enumerate(where.paths) if len(where.generated) + len(path) < params.min_tokens]
        if early:
            eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=logits.device)
            shaped[torch.tensor(early, device=logits.device)[:, None], eos] = float("-inf")
    if params.penalised:
        history = where.history if where.history is not None else TokenHistory()
        counts = _output_counts(where, history, vocab, logits.device)
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | history.prompt_mask(where.prompt, vocab, logits.device)
            penalty = params.repetition_penalty
            shaped = torch.where(seen, torch.where(shaped > 0, shaped / penalty, shaped * penalty), shaped)
        if params.frequency_penalty:
            shaped -= params.frequency_penalty * counts
        if params.presence_penalty:
            shaped -= params.presence_penalty * (counts > 0).to(shaped.dtype)
    return shaped


def _output_counts(where: Prefixes, history: TokenHistory, vocab: int, device: torch.device) -> torch.Tensor:
    """[positions, vocab]: how often each token occurs in each position's output prefix."""
    rows = len(where.paths)
    counts = history.output_counts(where.generated, vocab, device).expand(rows, vocab).clone()
    row_index = [row for row, path in enumerate(where.paths) for _ in path]
    if row_index:
        tokens = [token for path in where.paths for token in path]
        counts.index_put_(
            (torch.tensor(row_index, device=device), torch.tensor(tokens, dtype=torch.long, device=device)),
            torch.ones(len(tokens), device=device),
            accumulate=True,
        )
    return counts


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and the target's ``top`` at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first
    rank: int | None = None  # 1 + the tokens more likely than it (vLLM's), when asked for


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, ranks: bool = False) -> list[TokenLogprob]:
    """The target's log-probabilities of ``tokens``, row i of ``logits`` [n, vocab] the
    distribution ``tokens[i]`` was chosen at, with its ``top`` most likely tokens and, with
    ``ranks``, each token's rank: how many tokens are at least as likely, itself included
    (vLLM's count), so the most likely token's is 1."""
    assert logits.shape[0] == len(tokens)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens), device=logits.device), torch.tensor(tokens, dtype=torch.long, device=logits.device)]
    best: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top:
        values, indices = logprobs.topk(top, dim=-1)
        best = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist())]
    rank: list[int | None] = (logprobs >= chosen[:, None]).sum(dim=-1).tolist() if ranks else [None] * len(tokens)
    return [
        TokenLogprob(token, value, tuple(alternatives), place)
        for token, value, alternatives, place in zip(tokens, chosen.tolist(), best, rank)
    ]
