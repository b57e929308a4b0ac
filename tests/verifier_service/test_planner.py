"""Adaptive K's parts on literal inputs: evidence buckets, learned hazards, the verification plan."""

from __future__ import annotations

import math

import pytest

from verifier_service.core.calibration import StepCostModel
from verifier_service.core.drafting import DraftEvidence
from verifier_service.core.planner import (
    AcceptanceModel,
    Planner,
    SequenceCalibration,
    evidence_bucket,
    plan_verification,
    survival,
)

# -- evidence buckets -----------------------------------------------------------------


@pytest.mark.parametrize(
    "evidence, position, bucket",
    [
        (DraftEvidence("context", 4, 3, 3), 0, ("context", 4, 2, 0)),  # the docstring example
        (DraftEvidence("context", 4, 1, 1), 1, ("context", 4, 1, 1)),  # unanimous but seen once
        (DraftEvidence("context", 2, 2, 5), 2, ("context", 2, 0, 2)),  # other continuations followed too
        (DraftEvidence("global", 7, 9, 9), 6, ("global", 5, 2, 3)),  # matches of 5-7 and late positions share a bucket
        (DraftEvidence("context", 40, 1, 1), 9, ("context", 32, 1, 3)),  # copies of 32 tokens and more share one
        (DraftEvidence("context", 16, 1, 1), 0, ("context", 16, 1, 0)),
        (None, 5, ("", 0, 0, 3)),  # a proposer without evidence
    ],
)
def test_evidence_bucket(evidence, position, bucket):
    assert evidence_bucket(evidence, position) == bucket


# -- AcceptanceModel ------------------------------------------------------------------

A, B, C = ("context", 4, 2, 0), ("context", 4, 2, 1), ("context", 4, 2, 2)


def shrink(accepted: float, reached: float, prior: float) -> float:
    """A level's estimate: its counts with the level above worth two observations."""
    return (accepted + 2 * prior) / (reached + 2)


def test_an_unseen_bucket_has_the_prior_hazard():
    assert AcceptanceModel().hazard(A) == 0.5


def test_learn_counts_accepted_tokens_and_the_first_rejection_only_at_every_level():
    model = AcceptanceModel()
    # Draft of 3 verified, first accepted, second rejected: the third was never reached.
    model.learn([A, B, C], accepted=1)
    root = shrink(0.995, 1.995, 0.5)  # all tokens: one accepted of two reached (the first faded once)
    assert model.hazard(A) == pytest.approx(shrink(1, 1, shrink(1, 1, root)))  # ("context", 0), then A itself
    assert model.hazard(B) == pytest.approx(shrink(0, 1, shrink(0, 1, root)))
    assert model.hazard(C) == pytest.approx(root)  # says nothing of its own: the estimate of all tokens


def test_an_unseen_bucket_starts_where_its_source_at_its_position_stands():
    model = AcceptanceModel()
    for _ in range(30):
        model.learn([("global", 2, 0, 0)], accepted=0)  # global drafts fail...
        model.learn([A], accepted=1)  # ...context drafts hold
    root = model.hazard(("", 0, 0, 3))  # nothing of its source or position seen: all tokens, ~even
    assert 0.4 < root < 0.6
    assert model.hazard(("global", 4, 2, 0)) < 0.1  # a new kind of global draft: as bad as global ones
    assert model.hazard(("context", 2, 0, 0)) > 0.9  # a new kind of context draft: as good as context ones


def test_a_fully_accepted_draft_teaches_nothing_of_its_own_about_later_positions():
    model = AcceptanceModel()
    model.learn([A, B], accepted=2)
    root = shrink(1.995, 1.995, 0.5)
    assert model.hazard(A) == model.hazard(B) == pytest.approx(shrink(1, 1, shrink(1, 1, root)))
    assert model.hazard(C) == pytest.approx(root)  # position 2 was never verified: censored, not accepted


def test_optimism_applies_while_the_top_level_has_little_evidence():
    model = AcceptanceModel()
    assert model.hazard(A, optimism=1.0) == pytest.approx(0.5 + math.sqrt(0.25 / 2))  # the docstring example
    for _ in range(4):
        model.learn([A], accepted=0)  # 3.97 faded observations: still below 4
    assert model.hazard(A, optimism=1.0) > model.hazard(A)
    model.learn([A], accepted=0)  # 4.95: the estimates alone decide
    assert model.hazard(A, optimism=1.0) == model.hazard(A)


def test_old_evidence_fades_so_a_bucket_judged_hopeless_recovers():
    model = AcceptanceModel()
    for _ in range(50):
        model.learn([A], accepted=0)
    low = model.hazard(A)
    for _ in range(50):
        model.learn([A], accepted=1)
    assert low < 0.05 and model.hazard(A) > 0.5


def test_age_fades_every_levels_evidence_towards_the_prior():
    model = AcceptanceModel()
    for _ in range(20):
        model.learn([A], accepted=0)
    before = model.hazard(A)
    for _ in range(2000):
        model.age()
    reached = sum(0.995**i for i in range(20)) * 0.999**2000  # ~19.1 observations fade to ~2.6
    level = 0.5
    for _ in range(3):  # all tokens, ("context", 0), A: the same counts at each level
        level = shrink(0, reached, level)
    assert model.hazard(A) == pytest.approx(level)
    assert before < 0.001 < model.hazard(A)


# -- SequenceCalibration --------------------------------------------------------------


def test_calibration_factor_is_accepted_over_expected_with_two_pseudo_observations():
    calibration = SequenceCalibration()
    assert calibration.factor == 1.0
    # Predicted 0.9 and 0.8 for two verified tokens; the first was rejected: expected 0.9, accepted 0.
    calibration.learn([0.9, 0.8], accepted=0)
    assert calibration.factor == pytest.approx(2 / 2.9)
    calibration.age()  # a step: both faded by 0.99, (0 + 2) / (0.891 + 2)
    assert calibration.factor == pytest.approx(2 / 2.891)
    # A second verified draft fades the first by 0.9: predicted 0.5, accepted.
    calibration.learn([0.5, 0.5], accepted=1)  # (1 + 2) / (0.8019 + 0.5 + 0.5 + 2)
    assert calibration.factor == pytest.approx(3 / 3.8019)


def test_a_sequence_with_a_record_of_failures_is_retried_later_the_longer_the_record():
    def steps_until_retried(failures: int, threshold: float = 0.5, hazard: float = 0.8) -> int:
        calibration = SequenceCalibration()
        for _ in range(failures):
            calibration.learn([hazard], accepted=0)
        steps = 0
        while hazard * calibration.factor < threshold:
            calibration.age()
            steps += 1
        return steps

    assert steps_until_retried(1) == 0
    retried = [steps_until_retried(n) for n in (3, 6, 12)]
    assert 0 < retried[0] < retried[1] < retried[2] < 200


def test_survival_docstring_example():
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert survival([]) == []


# -- plan_verification ----------------------------------------------------------------


def linear_cost(tokens: int) -> float:
    return 1 + tokens / 10


def test_plan_docstring_example():
    plan = plan_verification([[0.9, 0.8], [0.2]], base_tokens=2, base_expected=2.0, cost=linear_cost)
    assert plan.counts == [2, 0]
    assert plan.expected_tokens == pytest.approx(3.7)
    assert plan.tokens == 4


def test_plan_ranks_across_rows_so_rows_verify_different_lengths():
    # Flat cost up to 6 tokens, steep after: the 4 best drafts of 8 fit.
    plan = plan_verification([[0.9, 0.85, 0.3], [0.95, 0.9, 0.2]], 2, 2.0, lambda n: 1.0 if n <= 6 else 10.0)
    assert plan.counts == [2, 2]


def test_plan_with_steep_cost_verifies_nothing():
    plan = plan_verification([[0.6, 0.5], [0.6]], 2, 2.0, lambda n: float(n))  # a token's cost is a whole row's
    assert plan.counts == [0, 0] and plan.tokens == 2


def test_plan_with_flat_cost_verifies_every_draft():
    plan = plan_verification([[0.1, 0.05], [0.01]], 2, 2.0, lambda n: 1.0)
    assert plan.counts == [2, 1]


def test_plan_without_drafts_is_plain_decoding():
    assert plan_verification([[], []], 2, 2.0, linear_cost).counts == [0, 0]
    assert plan_verification([], 1, 1.0, linear_cost).counts == []


def test_a_prefill_chunk_riding_along_does_not_make_drafts_look_free():
    """With 100 prefill tokens the step costs 11 s: by tokens per second of the whole
    step, any draft would pay (0.05 more tokens for 1% more time). Priced at the
    decode-only rate, only drafts that pay for their own marginal cost join."""
    survivals = [[0.9, 0.05]]
    assert plan_verification(survivals, 1, 1.0, linear_cost).counts == [1]
    assert plan_verification(survivals, 1, 1.0, linear_cost, extra_tokens=100).counts == [1]


def test_fixed_rows_yield_counts_in_the_rate_drafts_must_beat():
    # A fixed-K row feeds 3 drafts it expects to keep all of: the step yields 5 of 5 tokens
    # fed, and a 0.9 draft (0.9 for a token) would lower that rate. Counting the fixed
    # drafts' cost but not their yield (2 of 5) would make it look worth adding.
    cost = float  # a token costs one second
    assert plan_verification([[0.9]], base_tokens=5, base_expected=5.0, cost=cost).counts == [0]
    assert plan_verification([[0.9]], base_tokens=5, base_expected=2.0, cost=cost).counts == [1]


def test_a_sequences_calibration_is_kept_per_source():
    # The target's earlier predictions keep missing while context copies hold: only the former's factor falls.
    calibration = SequenceCalibration()
    for _ in range(10):
        calibration.learn_reached([("successor", 0.8, False), ("context", 0.5, True)])
    assert calibration.factor_of("successor") < 0.3
    assert calibration.factor_of("context") > 1.3
    assert calibration.factor == calibration.factor_of("global") == 1.0  # sources never verified: no evidence either way


def test_survival_of_a_tree_follows_each_nodes_path():
    assert survival([0.5, 0.4, 0.5], parents=[-1, -1, 0]) == [0.5, 0.4, 0.25]  # the docstring example
    assert survival([0.5, 0.5, 1.0]) == survival([0.5, 0.5, 1.0], parents=[-1, 0, 1])  # a chain is a tree


def test_a_plan_over_trees_is_closed_under_ancestors():
    # Row 0's tree: node 0 (0.9) with children 1 (0.3) and 2 (0.6); node 3 (0.5) under node 2 (0.6 * 0.5 = 0.3).
    survivals = [survival([0.9, 1 / 3, 2 / 3, 0.5], parents=[-1, 0, 0, 2])]
    plan = plan_verification(survivals, 1, 1.0, lambda n: 1.0 + 0.25 * n)
    assert plan.chosen == [[0, 2]]  # 0.9 and 0.6 pay at 0.25 a token; the 0.3s do not
    assert plan.counts == [2]
    for chosen in (plan_verification(survivals, 1, 1.0, lambda n: 1.0).chosen[0], [0, 2]):
        assert all(node == 0 or [-1, 0, 0, 2][node] in chosen for node in chosen)


# -- the planner's own record ---------------------------------------------------------


class PlannedChain:
    """A decoding row with a chain draft in ``buckets`` (what ``Planner`` reads and sets)."""

    def __init__(self, buckets: list[tuple]) -> None:
        self.draft = list(range(len(buckets)))
        self.buckets = buckets
        self.parents = list(range(-1, len(buckets) - 1))
        self.tree, self.verify, self.probe, self.adaptive = False, 0, False, True
        self.calibration = SequenceCalibration()

    def choose(self, chosen: list[int]) -> None:
        self.verify = len(chosen)


def planner_step(planner: Planner, rows: int, accept: bool) -> int:
    """One planned step of ``rows`` chains whose verified tokens are all accepted (or none): tokens verified."""
    chains = [PlannedChain([A, B, C]) for _ in range(rows)]
    planner.plan(chains, 0, 0)
    for chain in chains:
        planner.learn(chain, list(range(chain.verify)) if accept else [])
    planner.age()
    return sum(chain.verify for chain in chains)


def test_the_planners_realism_falls_when_what_it_chose_was_rejected_and_recovers_no_higher_than_one():
    planner = Planner(StepCostModel.linear(1.0, 0.01))
    assert planner.realism("context") == 1.0
    assert planner_step(planner, 4, accept=False) > 0
    low = planner.realism("context")
    assert low < 1.0
    for _ in range(60):
        planner_step(planner, 4, accept=True)
    assert low < planner.realism("context") <= 1.0


def test_a_planner_that_overestimated_verifies_fewer_tokens_where_each_barely_pays():
    # 16 rows, each token 4% of a step: one pays only if it survives with ~0.4 or more.
    trusted, burnt = Planner(StepCostModel.linear(1.0, 0.04)), Planner(StepCostModel.linear(1.0, 0.04))
    for _ in range(3):
        planner_step(burnt, 16, accept=False)
    assert burnt.realism("context") < 0.5
    for _ in range(20):  # the same well-accepted estimates for both
        trusted.acceptance.learn([A, B, C], accepted=3)
    burnt.acceptance = trusted.acceptance
    assert planner_step(trusted, 16, accept=True) == 48
    assert planner_step(burnt, 16, accept=True) < 48


class PlannedTree(PlannedChain):
    """A row whose draft is a context chain [A, B] and a head branch beside it at the root."""

    def __init__(self) -> None:
        super().__init__([A, B, HEAD])
        self.parents, self.tree = [-1, 0, -1], True


HEAD = ("head", 4, 0, 0)


def test_one_sources_overestimates_lower_only_its_own_realism():
    """Each row's head guess is verified and rejected while the context chain is accepted:
    the head's record falls, the context's stays whole, so the next plan still verifies the
    context chain on 16 rows where only well-trusted tokens pay."""
    planner = Planner(StepCostModel.linear(1.0, 0.04))
    for _ in range(20):
        planner.acceptance.learn_outcomes([(A, True), (B, True), (HEAD, True)])
    rows = [PlannedTree() for _ in range(16)]
    planner.plan(rows, 0, 0)
    assert [row.verify for row in rows] == [3] * 16
    for row in rows:
        planner.learn(row, [0, 1])
    planner.age()
    assert planner.realism("context") == 1.0
    assert planner.realism("head") < 0.5
    rows = [PlannedTree() for _ in range(16)]
    planner.plan(rows, 0, 0)
    assert [row.verify for row in rows] == [2] * 16


def test_scaled_survivals_never_exceed_their_parents():
    """A trusted source's token under a distrusted one's keeps at most its parent's scaled
    survival, so a plan ranked by it stays closed under ancestors."""
    planner = Planner(StepCostModel.linear(1.0, 0.04))
    planner._record = {"context": [0.0, 10.0], "head": [10.0, 10.0]}
    row = PlannedChain([A, HEAD])
    assert planner._scaled(row, [0.9, 0.8]) == [pytest.approx(0.9 * planner.realism("context"))] * 2


def test_where_every_token_reads_its_rows_cache_drafts_at_long_context_are_dearer_and_fewer_are_verified():
    # Each token 4% of a step, each cached token read 0.01%: 16 rows at 500 cached tokens read
    # 8,000 either way; read again by every draft token, a draft costs 4% + 5%: a first draft
    # token surviving half the time pays for 4% (it needs ~0.27) but not for 9% (~0.6).
    cost = StepCostModel({1: 1.0, 1024: 1.0 + 0.04 * 1023}, per_context_token=1e-4)
    planners = [Planner(cost), Planner(cost)]
    for planner in planners:
        for index in range(20):
            planner.acceptance.learn([A, B, C], accepted=index % 2)  # the first token survives half the time
    verified = []
    for planner, reads_per_token in zip(planners, (0.0, 500.0)):
        chains = [PlannedChain([A, B, C]) for _ in range(16)]
        planner.plan(chains, 0, 16 * 500, reads_per_token)
        verified.append(sum(chain.verify for chain in chains))
    assert verified[0] > verified[1]


def test_probes_share_the_tokens_one_probe_opens_with_the_rows_due_soonest():
    """16 rows whose drafts never pay, on a machine where 17 to 20 tokens cost the same
    (int4 weights are read once per four rows): the row due a probe opens the block, and the
    three free tokens go to the first draft tokens of the rows nearest their own probes (at
    least half way there), not to rows probed just now; on a machine where every token
    costs, the probe goes alone."""
    blocks = StepCostModel({count: 1.0 + 0.3 * ((count + 3) // 4) for count in range(1, 33)})
    for cost, probed in ((blocks, {0: 1, 5: 1, 6: 1, 7: 1}), (StepCostModel.linear(1.0, 0.05), {0: 1})):
        planner = Planner(cost)
        for _ in range(30):  # every draft rejected: none pays
            planner.acceptance.learn_outcomes([(A, False)])
        rows = [PlannedChain([A, B, C]) for _ in range(16)]
        for index, row in enumerate(rows):
            row.calibration.idle = {0: 8, 5: 7, 6: 6, 7: 4, 8: 3}.get(index, 0)  # row 0 due (after 8), 5-7 over half way
        planner.plan(rows, 0, 0)
        assert {index: row.verify for index, row in enumerate(rows) if row.verify} == probed
        assert all(row.probe for row in rows if row.verify)
