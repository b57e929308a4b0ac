"""Deciding which draft tokens to keep: the exact acceptance rules.

Terms used across the project (defined here once):

* **draft tokens** ``d_1..d_k``: the drafter's guesses for the next k positions.
* **target distributions** ``p_1..p_{k+1}``: what the target model gives for
  each of those positions (and one past them) in a single forward pass over
  ``[last token, d_1..d_k]``; ``p_i`` conditions on the context plus ``d_<i``.
* **accepted** tokens: the draft prefix the rule keeps.
* **rejected** token: the first draft token the rule refuses; every draft
  after it is discarded too, with its KV cache entries.
* **recovered** token: the token emitted in place of the rejected one.
* **bonus** token: when all k drafts are accepted, ``p_{k+1}`` is already
  computed, so one more token comes for free.

Every verification step therefore emits ``accepted + 1`` tokens.

Greedy: a draft is accepted while it equals the target's argmax; the
recovered/bonus token is the argmax. The output is the target's greedy output.

Sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): accept ``d`` with
probability ``min(1, p(d) / q(d))``; on rejection sample the recovered token
from the residual ``norm(max(0, p - q))``. The output is distributed exactly
as sampling from ``p``. The n-gram drafter is deterministic (``q`` is a point
mass on ``d``), so the rule becomes: accept ``d`` with probability ``p(d)``,
else sample from ``p`` with ``d`` removed and renormalized. We draw that with
one sample ``x ~ p`` per position, from a generator seeded by (request seed,
position): accept iff ``x == d``, emit ``x`` either way. ``P(accept) = p(d)``
and ``x | x != d`` is the residual, so this *is* the rule; and since ``x`` does
not depend on the draft, a seeded request yields the same tokens whatever was
drafted, and the same as plain sampling with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier_service.core.errors import InvalidRequest

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """splitmix64's finaliser: every input bit flips about half the output bits.

    torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, and
    streams from nearly equal seeds start out correlated; mixing first makes
    the (seed, position) streams independent in practice.
    """
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


# Temperatures below this decode greedily (vLLM's rule too): the limit of
# sampling as T -> 0 is the argmax, and logits / T for a T near float32's
# smallest values overflows to inf and softmax to NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5
# The repetition penalty r multiplies a seen token's logit by r or 1/r
# (``processing``), and nothing else a request sets can push a finite logit
# x to inf: a logit_bias adds at most 100, the frequency and presence
# penalties subtract at most 2 x (count + 1), temperature divides by at least
# MIN_SAMPLING_TEMPERATURE, so a shaped score is at most
# ((|x| + 100) x max(r, 1/r) + 2 x (positions + 1)) / 1e-5. Unbounded, r = 1e-38
# turned x = 3.5 into inf (float32 ends at 3.4e38) and softmax into NaN. With r
# in [0.01, 100] the score stays finite for any |x| < 1e31, far beyond any
# model's logits (tens). No use needs more: CTRL suggests 1.2, and at 100 a
# seen token's positive logit keeps 1% of itself, a negative one grows 100-fold.
# The low end is 0.01 as float32 rounds it (just below), so gRPC's float32 0.01 is taken too.
REPETITION_PENALTY_RANGE = (torch.tensor(0.01, dtype=torch.float32).item(), 100.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below MIN_SAMPLING_TEMPERATURE (0 included) means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 0 or 1 means no nucleus filter (0: proto3's unset value)
    seed: int | None = None  # None: the engine draws a fresh one per request
    # Shaping the logits before a token is chosen, per verified position from its
    # own prefix (``processing``, which defines each); the defaults shape nothing.
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0  # transformers' (CTRL), in REPETITION_PENALTY_RANGE; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_tokens: int = 0  # no end-of-sequence token (nor stop string) before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether any rule of ``processing`` applies."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        """The one place these rules live: an ``InvalidRequest`` naming the field, fit to show the client."""
        if not 0.0 <= self.temperature < float("inf"):  # NaN fails too
            raise InvalidRequest(
                "temperature",
                f"{{field}} must be a finite number >= 0 (below {MIN_SAMPLING_TEMPERATURE:g} = greedy), got {self.temperature}",
            )
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"{{field}} must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"{{field}} must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(name, f"{{field}} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN fails too
            raise InvalidRequest(
                "repetition_penalty",
                f"{{field}} must be in [{low:g}, {high:g}] (1 = off; beyond, penalised logits can overflow), got {self.repetition_penalty}",
            )
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest("logit_bias", f"{{field}}[{token}] must be in [-100, 100], got {bias}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequest("logit_bias", "{field} names a token twice")
        if self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"{{field}} must be >= 0, got {self.min_tokens}")


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution after temperature, top-k, then top-p (transformers' order).

    logits: [n, vocab] -> probabilities [n, vocab], float32.
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got {tuple(logits.shape)}"
    assert not params.greedy, "greedy decoding has no sampling distribution"
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth_largest = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is <= 1 - top_p; the top token always stays.
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def greedy_choices(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` [..., vocab]: ``max``'s indices, which are
    argmax's (the first of equal maxima, a NaN first of all). In bfloat16 argmax takes a
    slower path on CPU: 16 rows of 49,152 logits took 1.41 ms against max's 0.33 (2 threads,
    AVX512-BF16), and ties are common in bfloat16, so the two must agree on them."""
    return logits.max(dim=-1).indices.tolist()


def accept_greedy(target_choices: list[int], draft: list[int]) -> tuple[int, int]:
    """Longest draft prefix equal to the target's argmax.

    target_choices: the target's argmax at each of the len(draft) + 1
    positions (one batched argmax over the whole step gives them all).
    Returns (num_accepted, next_token): the recovered or bonus token is the
    argmax right after the accepted prefix.

    argmax [7, 8, 9, 5] and draft [7, 8, 4]: 7 and 8 accepted, 4 rejected -> (2, 9).
    """
    assert len(target_choices) == len(draft) + 1, f"{len(target_choices)} choices for a draft of {len(draft)}"
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_choices[accepted]:
        accepted += 1
    return accepted, target_choices[accepted]


def position_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one output position of one request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ position))
    return generator


def accept_sampled(target_probs: torch.Tensor, draft: list[int], seed: int, first_position: int) -> tuple[int, int]:
    """Modified rejection sampling for a deterministic (point-mass) draft.

    target_probs: [k+1, vocab], row i for output position first_position + i.
    Returns (num_accepted, next_token). See the module docstring for why one
    sample per position implements the rule exactly.
    """
    assert target_probs.dim() == 2 and target_probs.shape[0] == len(draft) + 1
    for i in range(len(draft) + 1):
        generator = position_generator(seed, first_position + i, target_probs.device)
        sampled = int(torch.multinomial(target_probs[i], 1, generator=generator))
        if i == len(draft) or sampled != draft[i]:
            return i, sampled
    raise AssertionError("unreachable: the loop returns at the bonus position")


def _children(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """Per tree node (0: the root, the last emitted token; 1 + j: draft j), its
    children's tokens -> their node index. A repeated sibling token keeps its first node."""
    children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for index, (token, parent) in enumerate(zip(tokens, parents)):
        children[parent + 1].setdefault(token, index + 1)
    return children


def accept_tree_greedy(target_choices: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance over a draft tree: follow the target's argmax through the children.

    tokens[j], parents[j]: draft node j and its parent (-1: the root, which is
    the last emitted token; every parent comes before its child).
    target_choices[i]: the target's argmax at node i (0: the root, 1 + j: draft j).
    Returns (path, next_token): the accepted draft nodes, root to leaf, and
    the argmax after the last of them. Each accepted token is the argmax
    given the tokens before it, so the output is the target's greedy output.

    tokens [7, 4, 8], parents [-1, -1, 0], argmax [7, 8, 2, 9]: 7 (node 0) is
    the root's argmax, then 8 (node 2) is node 0's -> ([0, 2], 9).
    """
    assert len(target_choices) == len(tokens) + 1 and len(parents) == len(tokens)
    children = _children(tokens, parents)
    path: list[int] = []
    node = 0
    while (child := children[node].get(target_choices[node])) is not None:
        path.append(child - 1)
        node = child
    return path, target_choices[node]


def accept_tree_sampled(
    target_probs: torch.Tensor, tokens: list[int], parents: list[int], seed: int, first_position: int
) -> tuple[list[int], int]:
    """Sampled acceptance over a tree of deterministic drafts.

    target_probs: [len(tokens) + 1, vocab], row i the target's (warped)
    distribution at node i (0: the root, 1 + j: draft j), given the context
    and the node's path. At the node reached after emitting m tokens, draw
    x ~ p from the generator of output position first_position + m; if a
    child of that node carries x, accept it and descend; else emit x and stop.
    Returns (path, next_token) as ``accept_tree_greedy``.

    Why this keeps the target's distribution: the token emitted at output
    position first_position + m is always the draw x_m from the target's
    distribution given the m tokens emitted before it (the node reached is
    exactly the tree node whose path is those tokens, and its row of
    target_probs is the target's distribution there), from a generator that
    depends only on (seed, position). The tree decides only how many of those
    draws one pass gets to check, never which token is drawn. So the output
    is token for token what plain sampling with the same seed emits, and in
    particular distributed as sampling from the target. For a chain this is
    ``accept_sampled``; for a node with several children it is SpecInfer's
    multi-step rule specialised to point-mass drafts, where accepting child c
    with probability p(c), else trying the next on the residual, is the same
    as one draw compared against every child.
    """
    assert target_probs.dim() == 2 and target_probs.shape[0] == len(tokens) + 1 and len(parents) == len(tokens)
    children = _children(tokens, parents)
    path: list[int] = []
    node = 0
    while True:
        generator = position_generator(seed, first_position + len(path), target_probs.device)
        sampled = int(torch.multinomial(target_probs[node], 1, generator=generator))
        child = children[node].get(sampled)
        if child is None:
            return path, sampled
        path.append(child - 1)
        node = child


def rejection_sample(
    draft: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """The general rule, for drafters that sample from a distribution q.

    draft_probs: [k, vocab] (q_i, from which d_i was drawn); target_probs:
    [k+1, vocab]. Returns (num_accepted, next_token).
    """
    k = len(draft)
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1
    for i, token in enumerate(draft):
        p, q = target_probs[i], draft_probs[i]
        # Leviathan et al. 2023, Alg. 1: accept d with prob min(1, p(d)/q(d)).
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct
            residual = p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
