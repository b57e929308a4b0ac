"""The step's proposers as peers: asked in order, each seeing what those before drafted,
their drafts cleaned and merged into one per sequence; a faulty one costs its own drafts."""

from __future__ import annotations

import logging

from verifier_service.core.drafting import DraftEvidence, DraftRequest, FinishedSequence, MergedDraft, ProposedDraft
from verifier_service.core.proposing import Proposers, merge

VOCAB = 64
CONTEXT = DraftEvidence("context", 3, 2, 2)


class Fixed:
    """A proposer that answers every request with the same draft and records what it was asked."""

    def __init__(self, draft: ProposedDraft | None = None, fail: Exception | None = None, answers: int | None = None) -> None:
        self.draft, self.fail, self.answers = draft or ProposedDraft([]), fail, answers
        self.asked: list[list[DraftRequest]] = []
        self.closed: list[list[FinishedSequence]] = []

    def propose(self, requests):
        self.asked.append(requests)
        if self.fail is not None:
            raise self.fail
        return [self.draft] * (len(requests) if self.answers is None else self.answers)

    def close(self, finished):
        self.closed.append(finished)
        if self.fail is not None:
            raise self.fail


def requests(count: int = 2, max_nodes: int = 8) -> list[DraftRequest]:
    return [DraftRequest(f"s{index}", [1, 2, 3], 4, max_nodes=max_nodes) for index in range(count)]


def test_later_proposers_see_the_merged_draft_and_add_their_nodes_to_it():
    drafter = Fixed(ProposedDraft([5, 6], [CONTEXT, CONTEXT]))
    beside = Fixed(ProposedDraft([5, 9, 7], [], [-1, 0, -1]))
    merged = Proposers(drafter, [beside], VOCAB).propose(requests())
    assert all(request.drafted is None for request in drafter.asked[0])  # the first sees nothing before it
    assert [request.drafted for request in beside.asked[0]] == [MergedDraft([5, 6], [-1, 0], [CONTEXT, CONTEXT], 2)] * 2
    # 5 joins the drafter's 5; 9 becomes its second child; 7 a second root.
    assert merged == [MergedDraft([5, 6, 9, 7], [-1, 0, 0, -1], [CONTEXT, CONTEXT, None, None], 2)] * 2


def test_a_chain_request_keeps_the_first_non_empty_draft():
    drafter, beside = Fixed(ProposedDraft([])), Fixed(ProposedDraft([8, 9, 10, 11, 12]))
    [merged] = Proposers(drafter, [beside], VOCAB).propose(requests(1, max_nodes=0))
    assert (merged.tokens, merged.parents, merged.chain) == ([8, 9, 10, 11], [-1, 0, 1, 2], 0)  # cut to k; no drafter chain
    drafter.draft = ProposedDraft([3])
    [merged] = Proposers(drafter, [beside], VOCAB).propose(requests(1, max_nodes=0))
    assert merged.tokens == [3]


def test_a_proposer_that_fails_or_answers_out_of_turn_costs_only_its_own_drafts(caplog):
    good = Fixed(ProposedDraft([5, 6]))
    for faulty in (Fixed(fail=RuntimeError("down")), Fixed(ProposedDraft([7]), answers=1)):
        for order in ([faulty, good], [good, faulty]):
            with caplog.at_level(logging.ERROR, logger="verifier_service.core.proposing"):
                merged = Proposers(order[0], order[1:], VOCAB).propose(requests())
            assert [draft.tokens for draft in merged] == [[5, 6], [5, 6]]
            assert "failed; this step verifies no drafts from it" in caplog.text
            caplog.clear()


def test_drafts_outside_the_vocabulary_never_reach_the_step():
    [merged] = Proposers(Fixed(ProposedDraft([5, VOCAB, 7], [], [-1, -1, 1])), [], VOCAB).propose(requests(1))
    assert (merged.tokens, merged.parents) == ([5], [-1])  # 64 is outside, and its child 7 goes with it


def test_every_proposer_hears_of_finished_sequences_even_after_one_fails(caplog):
    failing, other = Fixed(fail=OSError("gone")), Fixed()
    finished = [FinishedSequence("s0", [1, 2, 3])]
    with caplog.at_level(logging.ERROR, logger="verifier_service.core.proposing"):
        Proposers(failing, [other], VOCAB).close(finished)
    assert failing.closed == [finished] and other.closed == [finished]
    assert "closing 1 sessions with Fixed failed" in caplog.text


def test_merging_nothing_keeps_the_draft_and_the_first_proposers_chain_is_what_feedback_is_about():
    base = MergedDraft([5, 6], [-1, 0], [None, None], 2)
    assert merge(base, MergedDraft([], [], [], 0), tree=True) is base
    assert merge(MergedDraft([], [], [], 0), base, tree=True, first=True).chain == 2
    assert merge(MergedDraft([], [], [], 0), base, tree=True).chain == 0


def test_the_drafter_can_be_swapped_and_removed_and_those_beside_it_stay():
    drafter, beside = Fixed(), Fixed()
    proposers = Proposers(drafter, [beside], VOCAB)
    assert proposers.proposers == [drafter, beside]
    proposers.drafter = replacement = Fixed()
    assert proposers.proposers == [replacement, beside]
    proposers.drafter = None
    assert proposers.proposers == [beside] and proposers
    proposers.drafter = drafter
    assert proposers.proposers == [drafter, beside]
    assert not Proposers(None, [], VOCAB)
