"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) as a proposer of our engine, for benchmarks.

The drafts come from Arctic Inference's ``SuffixDecodingCache``, the implementation vLLM's
``suffix`` method runs: a suffix tree per active request over its prompt and its output so
far, and a global tree over the outputs of earlier requests (at most
``max_cached_requests`` of them, the oldest evicted first). Each step it matches the
sequence's last ``max_tree_depth`` tokens in both trees and returns the likelier
continuation, at most ``max_spec_factor`` times the matched length and never a token whose
estimated probability is under ``min_token_prob``.

The adapter drives the cache as vLLM's ``SuffixDecodingProposer`` does (``start_request``
with the prompt, ``add_active_response`` with each step's new tokens, ``speculate`` on the
last ``max_tree_depth`` tokens, ``stop_request`` at the end) and returns its draft as a
chain. Verification, and so greedy exactness, is the engine's: the adapter only proposes.
Two differences from vLLM, both in the cache's favour: a sequence's last tokens (those
after its last draft) are added before it stops, so the global tree holds whole outputs,
as our drafter's global table does; and cache keys are the adapter's own, so two engines'
session ids (each engine counts from ``seq-0``) never evict each other's outputs.

``arctic_inference`` is imported only when no cache is given, so tests can pass a fake one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from verifier_service.core.drafting import DraftRequest, FinishedSequence, ProposedDraft
from verifier_service.core.proposing import leading_chain


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's defaults for the ``suffix`` method (``SpeculativeConfig.suffix_decoding_*``)."""

    # Tokens of context matched and of continuation stored per tree node path.
    max_tree_depth: int = 24
    # Earlier requests' outputs the global tree keeps (FIFO eviction past it).
    max_cached_requests: int = 10000
    # A draft is at most this many times as long as the context it matched.
    max_spec_factor: float = 1.0
    # Draft tokens whose estimated probability (count share in the tree) is below this end the draft.
    min_token_prob: float = 0.1
    # The most draft tokens per step: vLLM's num_speculative_tokens for suffix defaults to max_tree_depth.
    max_spec_tokens: int = 24


class SuffixCache(Protocol):
    """What the adapter uses of ``arctic_inference.suffix_decoding.SuffixDecodingCache``."""

    def start_request(self, req_id: Any, prompt_token_ids: Sequence[int]) -> None: ...

    def add_active_response(self, req_id: Any, token_ids: Sequence[int]) -> None: ...

    def speculate(
        self,
        req_id: Any,
        context: Sequence[int],
        max_spec_tokens: int | None = None,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> Any: ...

    def stop_request(self, req_id: Any) -> None: ...


@dataclass
class _Active:
    key: int  # the request's id in the cache
    sent: int  # tokens of the sequence the cache holds (prompt and response)


class SuffixProposer:
    """A ``DraftProposer`` over one ``SuffixDecodingCache``, kept for as long as the proposer is
    (``cache``: one to use instead, such as a test's fake)."""

    def __init__(self, settings: SuffixSettings | None = None, cache: SuffixCache | None = None) -> None:
        self.settings = settings or SuffixSettings()
        if cache is None:
            from arctic_inference.suffix_decoding import SuffixDecodingCache

            cache = SuffixDecodingCache(max_tree_depth=self.settings.max_tree_depth, max_cached_requests=self.settings.max_cached_requests)
        self.cache: SuffixCache = cache
        self._active: dict[str, _Active] = {}  # engine session id -> its request in the cache
        self._keys = itertools.count()

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: DraftRequest) -> ProposedDraft:
        """Feed the cache the tokens it lacks, then its draft for the sequence's last tokens.

        The engine first asks for a sequence's draft right after its prefill sampled the
        first output token, so the first call's tokens are the prompt and that token: the
        prompt goes to the request's own tree, the token to its response (as in vLLM).
        Prompt [5, 6, 7], first token 8 -> start_request(key, [5, 6, 7]), add_active_response(key, [8]).
        """
        tokens = request.tokens
        active = self._active.get(request.session_id)
        if active is None:
            active = self._active[request.session_id] = _Active(next(self._keys), len(tokens) - 1)
            self.cache.start_request(active.key, tokens[:-1])
        if len(tokens) > active.sent:
            self.cache.add_active_response(active.key, tokens[active.sent :])
            active.sent = len(tokens)
        if request.k <= 0:  # the cache reads max_spec_tokens 0 as "up to its tree depth"
            return ProposedDraft([])
        draft = self.cache.speculate(
            active.key,
            tokens[-self.settings.max_tree_depth :],
            max_spec_tokens=min(request.k, self.settings.max_spec_tokens),
            max_spec_factor=self.settings.max_spec_factor,
            min_token_prob=self.settings.min_token_prob,
        )
        return ProposedDraft(chain_of(list(draft.token_ids), list(draft.parents)))

    def close(self, finished: list[FinishedSequence]) -> None:
        """The rest of each ended sequence into its response, then its request stopped (its
        prompt tree freed; its response stays in the global tree until evicted)."""
        for session_id, tokens, _ in (FinishedSequence(*ended) for ended in finished):
            active = self._active.pop(session_id, None)
            if active is None:
                continue
            if len(tokens) > active.sent:
                self.cache.add_active_response(active.key, tokens[active.sent :])
            self.cache.stop_request(active.key)


def chain_of(tokens: list[int], parents: list[int]) -> list[int]:
    """The draft's tokens up to its first branch: [7, 8, 9] with parents [-1, 0, 0] -> [7, 8].
    Without tree speculation the cache returns a chain (parents -1, 0, 1, ...), kept whole."""
    return tokens[: leading_chain(parents)] if parents else tokens
