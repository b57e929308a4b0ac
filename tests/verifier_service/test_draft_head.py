"""The trained draft head: training a tiny one, its folder and manifest, the features it
reads, and exactness with it drafting (greedy and sampled), on the tiny seeded Llama."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from tests.conftest import build_tiny_model
from tests.verifier_service.test_engine_adaptive import CPU_COST, FrozenStepCost
from tests.verifier_service.test_trees import FLAT, NO_EOS, PROMPTS, TreeProposer, branch_tree, engine_for
from verifier_service.core.calibration import StepCostModel
from verifier_service.core.drafting import DraftEvidence, DraftRequest, DraftStep, MergedDraft
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine, reference_greedy
from verifier_service.core.planner import SOURCE_HEAD, HeadRecord, SequenceCalibration
from verifier_service.core.proposing import merge
from verifier_service.core.rejection import SamplingParams
from verifier_service.head import train as train_head
from verifier_service.head.model import (
    HEAD_FORMAT,
    MANIFEST,
    WEIGHTS,
    DraftHead,
    HeadDrafter,
    HeadManifest,
    HeadMismatch,
    cached_head_folder,
    find_head,
    load_head,
    save_head,
    target_fingerprint,
)
from verifier_service.head.proposer import DEFAULT_HEAD_DEPTH, HeadProposer, head_draft


def texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, 64)}" for _ in range(6)) for _ in range(count)]


TRAIN_TEXTS = texts(0, 48)
HELD_OUT_TEXTS = texts(1, 8)


def collected(model, tokenizer, texts):
    engine = SpeculativeEngine(
        model, tokenizer, None, EngineConfig(max_batch_size=8, successor_top_k=0), step_cost=StepCostModel.linear(0.01, 0.001)
    )
    engine.eos_token_ids = NO_EOS
    return train_head.collect(engine, tokenizer, texts, 24, 600.0, torch.float32)


@pytest.fixture(scope="module")
def trained(tiny_model, tiny_tokenizer, tmp_path_factory):
    """A tiny head trained for a fixed number of steps, saved, with its accuracy before and after."""
    traces = collected(tiny_model, tiny_tokenizer, TRAIN_TEXTS)
    held = collected(tiny_model, tiny_tokenizer, HELD_OUT_TEXTS)
    torch.manual_seed(0)
    head = DraftHead(32, 32, 64, 48)
    head.vocab.copy_(train_head.draft_vocabulary(traces, 48, 64))
    drafter = HeadDrafter(head, tiny_model)
    head.requires_grad_(True)
    examples, held_out = train_head.Examples(traces, len(train_head.UNROLL_WEIGHTS)), train_head.Examples(held, 1)
    before = train_head.evaluate(head, drafter, examples)
    train_head.train(head, drafter, examples, held_out, 600.0, 64, 3e-3, steps=300)
    after = train_head.evaluate(head, drafter, examples)
    folder = tmp_path_factory.mktemp("head") / "tiny"
    manifest = HeadManifest(HEAD_FORMAT, target_fingerprint(tiny_model, tiny_tokenizer), "v", 32, 32, 64, 48, len(examples), after[0])
    save_head(folder, head.eval(), manifest)
    return folder, before, after, traces


def test_collect_hands_over_the_feature_that_produced_each_token(tiny_model, tiny_tokenizer):
    """Each answer token comes with the target's last hidden state at the position before it,
    as full recomputation gives it (the output layer's input), and the tokens are greedy's."""
    traces = collected(tiny_model, tiny_tokenizer, TRAIN_TEXTS[:3])
    assert len(traces) == 3
    for text, (features, tokens) in zip(TRAIN_TEXTS[:3], traces):
        prompt = tiny_tokenizer(text).input_ids
        assert tokens.tolist() == reference_greedy(tiny_model, prompt, 24, NO_EOS)
        with torch.inference_mode():
            hidden = tiny_model(torch.tensor([prompt + tokens.tolist()]), output_hidden_states=True).hidden_states[-1][0]
        assert torch.allclose(features, hidden[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], atol=1e-4)


def test_training_a_tiny_head_makes_its_first_guess_the_targets(trained):
    _, (first_before, _), (first_after, chain_after), _ = trained
    assert first_after > max(0.5, first_before + 0.3), (first_before, first_after)
    assert chain_after > first_after  # deeper guesses are right too, sometimes


def test_a_saved_head_loads_onto_its_target_only(trained, tiny_model, tiny_tokenizer, tmp_path):
    folder, *_ = trained
    drafter = load_head(folder, tiny_model, tiny_tokenizer)
    assert drafter.manifest is not None and drafter.manifest.draft_vocabulary == 48
    assert drafter.readout.shape == (48, 32)
    other = build_tiny_model(seed=1)
    with pytest.raises(HeadMismatch, match="trained on another target"):
        load_head(folder, other, tiny_tokenizer)
    with pytest.raises(HeadMismatch, match="not a draft head folder"):
        load_head(tmp_path, tiny_model, tiny_tokenizer)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST).write_text((folder / MANIFEST).read_text())
    (broken / WEIGHTS).write_bytes(b"not a checkpoint")
    with pytest.raises(HeadMismatch, match="does not hold the head"):
        load_head(broken, tiny_model, tiny_tokenizer)
    (broken / MANIFEST).write_text('{"format": 2}')
    with pytest.raises(HeadMismatch, match="not a draft head manifest"):
        load_head(broken, tiny_model, tiny_tokenizer)


# A head folder is untrusted: each broken field, with the message that names it and the
# range it must be in. The tiny target: hidden and embedding size 32, 64 tokens.
DELETED = object()
BAD_MANIFEST_FIELDS = [
    ({"width": -1}, r"field width is -1, expected >= 1$"),
    ({"width": 0}, r"field width is 0, expected >= 1$"),
    ({"width": 2**40}, r"field width is 1099511627776, expected \[1, 512\] \(at most 16 x the target's hidden size 32\)"),
    ({"width": 513}, r"field width is 513, expected \[1, 512\]"),  # the first width past the bound
    ({"width": "64"}, r"field width must be an integer, found str '64'"),
    ({"width": True}, r"field width must be an integer, found bool True"),  # JSON's true is no 1
    ({"width": 64.0}, r"field width must be an integer, found float 64.0"),
    ({"width": None}, r"field width must be an integer, found NoneType None"),
    ({"width": [64]}, r"field width must be an integer, found list \[64\]"),
    ({"width": DELETED}, r"not a draft head manifest of format 2: fields width missing"),
    ({"hidden_size": 64}, r"field hidden_size is 64, expected 32 \(the target's hidden size\)"),
    ({"hidden_size": -32}, r"field hidden_size is -32, expected >= 1"),
    ({"embedding_size": 2**40}, r"field embedding_size is 1099511627776, expected 32 \(the target's embedding size\)"),
    ({"draft_vocabulary": 65}, r"field draft_vocabulary is 65, expected \[2, 64\] \(at most the target's vocabulary\)"),
    ({"draft_vocabulary": 1}, r"field draft_vocabulary is 1, expected >= 2 \(a level drafts the two best guesses\)"),
    ({"draft_vocabulary": "48"}, r"field draft_vocabulary must be an integer, found str '48'"),
    ({"trained_tokens": -1}, r"field trained_tokens is -1, expected >= 0"),
    ({"held_out_accuracy": 1.5}, r"field held_out_accuracy is 1.5, expected \[0.0, 1.0\]"),
    ({"held_out_accuracy": float("nan")}, r"field held_out_accuracy is nan, expected \[0.0, 1.0\]"),  # JSON's NaN
    ({"held_out_accuracy": "0.9"}, r"field held_out_accuracy must be a number, found str '0.9'"),
    ({"note": "x" * 2000}, r"field note's length is 2000, expected \[0, 1024\]"),
    ({"note": 7}, r"field note must be a string, found int 7"),
    ({"target": "abc"}, r"field target is 'abc', expected 16 hex digits"),
    ({"target": 123}, r"field target must be a string, found int 123"),
    ({"target": "0123456789abcdef"}, r"was trained on another target \(fingerprint 0123456789abcdef"),
    ({"format": 1}, r"head format 1, this verifier reads format 2"),
    ({"format": "2"}, r"field format must be an integer, found str '2'"),
    ({"extra": 1}, r"not a draft head manifest of format 2: unknown fields 'extra'"),
]


@pytest.fixture
def head_folder(tiny_model, tiny_tokenizer, tmp_path):
    """An untrained head for the tiny target (width 64, 48 draft tokens), whole and loadable."""
    return head_for(tiny_model, tiny_tokenizer, tmp_path / "head")


def head_for(model, tokenizer, folder, head=None):
    head = head if head is not None else DraftHead(32, 32, 64, 48)
    head.vocab.copy_(torch.arange(len(head.vocab)))
    save_head(folder, head, HeadManifest(HEAD_FORMAT, target_fingerprint(model, tokenizer), "v", 32, 32, 64, 48))
    return folder


def rewrite_manifest(folder, changes) -> None:
    record = json.loads((folder / MANIFEST).read_text())
    for name, value in changes.items():
        if value is DELETED:
            del record[name]
        else:
            record[name] = value
    (folder / MANIFEST).write_text(json.dumps(record))


def rewrite_weights(folder, change) -> None:
    """Save the head's tensors again after ``change`` edits the dict of them."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS))


def test_an_untouched_head_folder_loads(head_folder, tiny_model, tiny_tokenizer):
    drafter = load_head(head_folder, tiny_model, tiny_tokenizer)
    assert drafter.manifest is not None and drafter.readout.shape == (48, 32)


@pytest.mark.parametrize(("changes", "message"), BAD_MANIFEST_FIELDS)
def test_each_bad_manifest_field_is_refused_by_name_before_anything_is_built(head_folder, tiny_model, tiny_tokenizer, changes, message):
    rewrite_manifest(head_folder, changes)
    with pytest.raises(HeadMismatch, match=message) as raised:
        load_head(head_folder, tiny_model, tiny_tokenizer)
    assert str(head_folder) in str(raised.value)  # the folder to fix


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"{", r"not a draft head manifest: not JSON \(Expecting"),
        (b"[1, 2]", r"not a draft head manifest: a JSON object is expected, found list"),
        (b"null", r"not a draft head manifest: a JSON object is expected, found NoneType"),
        (b'"width"', r"not a draft head manifest: a JSON object is expected, found str"),
        (b"\xff\xfe{}", r"not a draft head manifest: not UTF-8 text"),
        (b" " * (64 * 1024 + 1), r"is 65537 bytes, more than a manifest's 65536"),
    ],
)
def test_a_manifest_that_is_not_a_json_object_is_refused(head_folder, tiny_model, tiny_tokenizer, text, message):
    (head_folder / MANIFEST).write_bytes(text)
    with pytest.raises(HeadMismatch, match=message):
        load_head(head_folder, tiny_model, tiny_tokenizer)


def truncate(fraction):
    def cut(folder) -> None:
        data = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(data[: int(len(data) * fraction)])

    return cut


def oversized(folder) -> None:
    """A weights file of 1 GiB (sparse: nothing written), far past what the manifest's sizes take."""
    with open(folder / WEIGHTS, "r+b") as file:
        file.truncate(1 << 30)


def narrower(folder) -> None:
    rewrite_weights(folder, lambda tensors: tensors.update(DraftHead(32, 32, 48, 48).state_dict()))


def with_nan(folder) -> None:
    rewrite_weights(folder, lambda tensors: tensors["fuse.weight"].view(-1).__setitem__(0, float("nan")))


def float_vocab(folder) -> None:
    rewrite_weights(folder, lambda tensors: tensors.update(vocab=tensors["vocab"].float()))


def without_norm(folder) -> None:
    rewrite_weights(folder, lambda tensors: tensors.pop("norm.weight"))


def foreign_ids(folder) -> None:
    rewrite_weights(folder, lambda tensors: tensors["vocab"].__setitem__(0, 64))


def missing(folder) -> None:
    (folder / WEIGHTS).unlink()


BAD_WEIGHTS = [
    (truncate(0.25), r"it is \d+ bytes, a head of these sizes takes \d+ to \d+"),
    (truncate(0.999), r"incomplete metadata, file not fully covered"),  # within the bounds: safetensors' own check
    (oversized, r"it is 1073741824 bytes, a head of these sizes takes"),
    (narrower, r"gate_up.weight is F32 \[96, 32\], expected BF16 or F16 or F32 \[128, 32\]"),
    (float_vocab, r"vocab is F32 \[48\], expected I64 \[48\]"),
    (without_norm, r"tensors \['down.weight', 'fuse.weight', 'gate_up.weight', 'out_norm.weight', 'vocab'\], expected"),
    (with_nan, r"fuse.weight holds values that are not finite"),
    (missing, r"No such file"),
]


@pytest.mark.parametrize(("damage", "message"), BAD_WEIGHTS, ids=lambda value: getattr(value, "__name__", None))
def test_weights_that_do_not_match_the_manifest_are_refused_before_the_head_is_built(
    head_folder, tiny_model, tiny_tokenizer, damage, message
):
    damage(head_folder)
    with pytest.raises(HeadMismatch, match=f"{head_folder / WEIGHTS} does not hold the head its manifest describes: .*{message}"):
        load_head(head_folder, tiny_model, tiny_tokenizer)


def test_draft_vocabulary_ids_outside_the_target_are_refused(head_folder, tiny_model, tiny_tokenizer):
    foreign_ids(head_folder)
    with pytest.raises(HeadMismatch, match="its draft vocabulary names token ids outside the model's 64"):
        load_head(head_folder, tiny_model, tiny_tokenizer)


def test_weights_saved_in_half_precision_load(tiny_model, tiny_tokenizer, tmp_path):
    torch.manual_seed(0)
    full = DraftHead(32, 32, 64, 48)
    head_for(tiny_model, tiny_tokenizer, tmp_path / "half", full.half())
    drafter = load_head(tmp_path / "half", tiny_model, tiny_tokenizer)
    assert torch.equal(drafter.head.fuse.weight, full.fuse.weight.float())


AUTO_CASES = [
    ("width -1", lambda folder: rewrite_manifest(folder, {"width": -1}), "field width is -1"),
    ("width 2**40", lambda folder: rewrite_manifest(folder, {"width": 2**40}), "field width is 1099511627776"),
    ("width a string", lambda folder: rewrite_manifest(folder, {"width": "64"}), "field width must be an integer"),
    ("no JSON", lambda folder: (folder / MANIFEST).write_text("{"), "not JSON"),
    ("not UTF-8", lambda folder: (folder / MANIFEST).write_bytes(b"\xff"), "not UTF-8"),
    ("narrower weights", narrower, "gate_up.weight is F32 [96, 32]"),
    ("truncated weights", truncate(0.25), "a head of these sizes takes"),
]


@pytest.mark.parametrize(("damage", "message"), [case[1:] for case in AUTO_CASES], ids=[case[0] for case in AUTO_CASES])
def test_auto_serves_without_an_unusable_cached_head_with_one_warning(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, caplog, damage, message
):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    folder = head_for(tiny_model, tiny_tokenizer, cached_head_folder(tmp_path, target_fingerprint(tiny_model, tiny_tokenizer)))
    assert find_head("auto", tiny_model, tiny_tokenizer) is not None  # untouched, it is found
    damage(folder)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert find_head("auto", tiny_model, tiny_tokenizer) is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("the cached draft head is not usable, serving without one: ")
    assert message in record.getMessage()
    with pytest.raises(HeadMismatch) as raised:  # named with --draft-head FOLDER, the same head stops the start
        find_head(str(folder), tiny_model, tiny_tokenizer)
    assert message in str(raised.value)


def test_the_fingerprint_tells_a_fine_tune_from_its_base(tiny_model, tiny_tokenizer, tmp_path):
    tuned = build_tiny_model(seed=0)
    tiny_model.save_pretrained(tmp_path)  # saving fills in config fields (architectures): not part of which model it is
    assert target_fingerprint(tuned, tiny_tokenizer) == target_fingerprint(tiny_model, tiny_tokenizer)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.reshape(-1)[0] += 1e-3
    assert target_fingerprint(tuned, tiny_tokenizer) != target_fingerprint(tiny_model, tiny_tokenizer)


def head_engine(trained, model, tokenizer, proposer=None, cost=FLAT, depth=DEFAULT_HEAD_DEPTH, **config) -> SpeculativeEngine:
    """An engine whose proposers are ``proposer`` (when given) and the trained head after it."""
    folder, *_ = trained
    head = HeadProposer(load_head(folder, model, tokenizer), depth)
    engine = SpeculativeEngine(model, tokenizer, proposer, EngineConfig(**config), step_cost=FrozenStepCost(cost), beside=[head])
    engine.eos_token_ids = NO_EOS
    return engine


def head_of(engine: SpeculativeEngine) -> HeadProposer:
    [head] = engine.proposers.beside
    return head


@pytest.mark.parametrize("k", [3, None])
def test_greedy_output_with_the_head_drafting_equals_plain_decoding(trained, tiny_model, tiny_tokenizer, k):
    """The head alone (no drafter service): chains for a fixed K, its chain and second guess
    for adaptive K; what it gets right is accepted, and the output is plain greedy's."""
    prompts = [tiny_tokenizer(text).input_ids for text in HELD_OUT_TEXTS[:4]]
    engine = head_engine(trained, tiny_model, tiny_tokenizer, max_adaptive_k=4, depth=3)
    outcomes_sources = []
    handles = [engine.add(GenerationRequest(p, 30, num_speculative_tokens=k)) for p in prompts]
    results = {}
    while engine.busy:
        for outcome in engine.step():
            outcomes_sources += outcome.sources
            if outcome.result is not None:
                results[outcome.sequence] = outcome.result
    for prompt, handle in zip(prompts, handles):
        assert results[handle].token_ids == reference_greedy(tiny_model, prompt, 30, NO_EOS)
    assert sum(results[h].stats.accepted_tokens for h in handles) > 10
    for handle in handles:  # a step that kept a draft token kept at least one, at most all it verified
        stats = results[handle].stats
        assert stats.steps_with_accepted_drafts <= stats.verify_steps_with_drafts
        assert stats.steps_with_accepted_drafts * 4 >= stats.accepted_tokens  # drafts are at most 4 deep here
    assert sum(results[h].stats.steps_with_accepted_drafts for h in handles) > 0
    assert SOURCE_HEAD in outcomes_sources


def test_greedy_with_the_head_and_a_drafter_tree_stays_exact(trained, tiny_model, tiny_tokenizer):
    """Head nodes merged into a drafter's trees (whose true path hides in second children)."""
    from tests.verifier_service.test_engine_adaptive import truth

    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt), shape=lambda path, depth: branch_tree(path, min(depth, 2)))
    engine = head_engine(trained, tiny_model, tiny_tokenizer, proposer, max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 31, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:31]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_output_with_the_head_is_plain_samplings(trained, tiny_model, tiny_tokenizer, seed):
    """Head drafts are points, verified by the rule every draft is: with a seed, the same
    tokens as plain sampling, whatever the head guessed."""
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=seed)
    prompts = [tiny_tokenizer(text).input_ids for text in HELD_OUT_TEXTS[:4]]
    plain = engine_for(tiny_model, tiny_tokenizer, None)
    expected = [r.token_ids for r in plain.generate([GenerationRequest(p, 30, sampling, num_speculative_tokens=0) for p in prompts])]
    engine = head_engine(trained, tiny_model, tiny_tokenizer, max_adaptive_k=4)
    results = engine.generate([GenerationRequest(p, 30, sampling, num_speculative_tokens=None) for p in prompts])
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.draft_tokens for r in results) > 0


def test_no_head_drafts_for_requests_without_speculation_or_with_depth_0(trained, tiny_model, tiny_tokenizer):
    prompt = tiny_tokenizer(HELD_OUT_TEXTS[0]).input_ids
    for engine, k in (
        (head_engine(trained, tiny_model, tiny_tokenizer), 0),
        (head_engine(trained, tiny_model, tiny_tokenizer, depth=0), None),
    ):
        [result] = engine.generate([GenerationRequest(prompt, 12, num_speculative_tokens=k)])
        assert result.stats.draft_tokens == 0
        assert result.token_ids == reference_greedy(tiny_model, prompt, 12, NO_EOS)


def evidence(probability: float) -> DraftEvidence:
    return DraftEvidence(SOURCE_HEAD, 0, round(probability * 1000), 1000)


def test_the_heads_chain_joins_the_drafters_tree_where_they_agree(trained, tiny_model, tiny_tokenizer):
    engine = head_engine(trained, tiny_model, tiny_tokenizer)
    context = DraftEvidence("context", 3, 2, 2)
    drafted = MergedDraft([10, 11, 20], [-1, 0, -1], [context] * 3, 2)
    head = engine.proposers.usable(head_draft([10, 12, 13], [0.9, 0.5, 0.4], (30, 0.05)), k=3, max_nodes=12)
    merged = merge(drafted, head, tree=True)
    # 10 is the drafter's first node: the head follows it, adds 12 under it, 13 under 12, and 30 at the root.
    assert merged.tokens == [10, 11, 20, 12, 13, 30]
    assert merged.parents == [-1, 0, -1, 0, 3, -1]
    assert merged.evidence[3:] == [evidence(0.5), evidence(0.4), evidence(0.05)]
    assert merged.chain == 2  # feedback is about the drafter's chain
    # A second guess the tree already holds at the root is not repeated; depth cuts the chain.
    head = engine.proposers.usable(head_draft([10, 12, 13], [0.9, 0.5, 0.4], (20, 0.05)), k=2, max_nodes=12)
    merged = merge(MergedDraft([20], [-1], [context], 1), head, tree=True)
    assert (merged.tokens, merged.parents) == ([20, 10, 12], [-1, -1, 1])


def test_a_chain_request_takes_the_heads_chain_only_where_the_drafter_had_none(trained, tiny_model, tiny_tokenizer):
    engine = head_engine(trained, tiny_model, tiny_tokenizer)
    head = engine.proposers.usable(head_draft([10, 12], [0.9, 0.5], (-1, 0.0)), k=2, max_nodes=0)
    merged = merge(MergedDraft([7, 8], [-1, 0], [None, None], 2), head, tree=False)
    assert (merged.tokens, merged.parents) == ([7, 8], [-1, 0])
    head = engine.proposers.usable(head_draft([10, 12, 13], [0.9, 0.5, 0.4], (-1, 0.0)), k=2, max_nodes=0)
    merged = merge(MergedDraft([], [], [], 0), head, tree=False)
    assert (merged.tokens, merged.parents) == ([10, 12], [-1, 0])  # no deeper than K


def test_the_heads_draft_is_its_chain_and_its_second_guess_at_the_root():
    draft = head_draft([10, 12], [0.9, 0.5], (30, 0.05))
    assert (draft.tokens, draft.parents) == ([10, 12, 30], [-1, 0, -1])
    assert draft.evidence == [evidence(0.9), evidence(0.5), evidence(0.05)]
    assert head_draft([10, 12], [0.9, 0.5], (-1, 0.0)).tokens == [10, 12]
    assert head_draft([], [], (30, 0.05)).tokens == []  # no chain, no branch


def test_a_level_gives_the_heads_two_best_guesses_with_their_probabilities(trained, tiny_model, tiny_tokenizer):
    folder, *_, traces = trained
    drafter = load_head(folder, tiny_model, tiny_tokenizer)
    features, tokens = traces[0][0][:5], traces[0][1][:5]
    predicted, guesses, probabilities = drafter.level(features, tokens)
    full = drafter.logits(predicted).float().softmax(dim=-1)
    best, index = full.topk(2, dim=-1)
    assert torch.equal(guesses, drafter.vocab[index])
    assert torch.allclose(probabilities, best, atol=1e-5)
    cut = load_head(folder, tiny_model, tiny_tokenizer, vocabulary=16)  # the 16 most frequent entries only
    assert torch.equal(cut.vocab, drafter.vocab[:16]) and cut.readout.shape == (16, 32)
    _, guesses, probabilities = cut.level(features, tokens)
    assert set(guesses.flatten().tolist()) <= set(cut.vocab.tolist())
    assert bool((probabilities.sum(dim=-1) <= 1 + 1e-5).all())


def test_the_draft_vocabulary_is_stored_most_frequent_first():
    traces = [(torch.zeros(7, 2), torch.tensor([5, 3, 3, 9, 9, 9, 1]))]
    assert train_head.draft_vocabulary(traces, 4, 12).tolist() == [9, 3, 1, 5]  # ties by id


def teach(engine, source, hazard):
    """Make the planner's shared estimate of ``source``'s tokens (every band, every position) about ``hazard``."""
    buckets = [(source, band, 0, position) for band in range(5) for position in range(4)]
    for _ in range(60):
        engine.planner.acceptance.learn_outcomes([(bucket, random.random() < hazard) for bucket in buckets])


def head_request(engine, model, tokenizer, text, rows, draft=(), evidence=None) -> DraftRequest:
    """What a step of ``rows`` decode rows asks the head for one sequence that has decoded: its
    feature at the last token, and the drafter's chain ``draft`` (each token with ``evidence``)."""
    prompt = tokenizer(text).input_ids
    with torch.inference_mode():
        feature = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    drafted = MergedDraft(list(draft), list(range(-1, len(draft) - 1)), [evidence] * len(draft), len(draft))
    step = DraftStep(rows, 0, engine.planner)
    return DraftRequest(
        text, prompt, 4, max_nodes=12, feature=feature, adaptive=True, calibration=SequenceCalibration(), step=step, drafted=drafted
    )


def head_tokens(draft) -> int:
    return sum(1 for item in draft.evidence if item is not None and item.source == SOURCE_HEAD)


def test_the_head_drafts_only_for_rows_whose_drafter_draft_is_weak(trained, tiny_model, tiny_tokenizer):
    random.seed(0)
    engine = head_engine(trained, tiny_model, tiny_tokenizer, max_adaptive_k=4, max_adaptive_nodes=12)
    teach(engine, "context", 0.95)
    teach(engine, "global", 0.05)
    teach(engine, SOURCE_HEAD, 0.6)
    requests = [
        head_request(engine, tiny_model, tiny_tokenizer, HELD_OUT_TEXTS[0], 3, [11, 12], DraftEvidence("context", 3, 2, 2)),  # strong
        head_request(engine, tiny_model, tiny_tokenizer, HELD_OUT_TEXTS[1], 3, [11, 12], DraftEvidence("global", 1, 1, 3)),  # weak
        head_request(engine, tiny_model, tiny_tokenizer, HELD_OUT_TEXTS[2], 3),  # empty
    ]
    strong, weak, empty = head_of(engine).propose(requests)
    assert strong.tokens == []
    assert head_tokens(weak) >= 4  # its chain, 4 deep, beside the drafter's (and a second guess)
    assert head_tokens(empty) >= 4
    merged = merge(requests[1].drafted, engine.proposers.usable(weak, 4, 12), tree=True)
    assert merged.tokens[:2] == [11, 12] and head_tokens(merged) >= 4


@pytest.mark.parametrize(("cost", "rows", "expected"), [(FLAT, 16, 4), (CPU_COST, 1, 2), (CPU_COST, 16, 0)])
def test_the_heads_chain_stops_where_verifying_it_would_not_pay(trained, tiny_model, tiny_tokenizer, cost, rows, expected):
    """With the head's guesses accepted half the time, a chain's survival halves each level:
    worth any depth when a wider pass is free, two levels on a CPU-like step at one row
    (a token must survive 0.14 of the time), none at 16 rows (0.73)."""
    random.seed(0)
    engine = head_engine(trained, tiny_model, tiny_tokenizer, cost=cost, max_adaptive_k=4, max_adaptive_nodes=12)
    teach(engine, SOURCE_HEAD, 0.5)
    requests = [head_request(engine, tiny_model, tiny_tokenizer, HELD_OUT_TEXTS[index % 8], rows) for index in range(rows)]
    drafts = head_of(engine).propose(requests)
    chains = [sum(1 for parent in draft.parents if parent >= 0) + (1 if draft.tokens else 0) for draft in drafts]
    assert chains == [expected] * rows, (engine.planner.floor(rows, 0), chains)


class CountedLevels:
    """Wraps a HeadDrafter's ``level`` to count the rows each call drafts for."""

    def __init__(self, engine) -> None:
        self.calls: list[int] = []
        head = head_of(engine).head
        level = head.level

        def counted(features, tokens):
            self.calls.append(len(tokens))
            return level(features, tokens)

        head.level = counted


@pytest.mark.parametrize(("cost", "rows", "runs"), [(FLAT, 16, True), (CPU_COST, 1, True), (CPU_COST, 16, False)])
def test_the_heads_first_level_runs_only_where_its_guesses_have_paid(trained, tiny_model, tiny_tokenizer, cost, rows, runs):
    """The first step tries the head and sees where its guesses fall; after that the first
    level runs only where a guess like those is worth verifying: at one row on a CPU-like
    step or at any width on a flat one, not at 16 rows on a CPU, where none would be."""
    random.seed(0)
    engine = head_engine(trained, tiny_model, tiny_tokenizer, cost=cost, max_adaptive_k=4, max_adaptive_nodes=12)
    teach(engine, SOURCE_HEAD, 0.5)
    levels = CountedLevels(engine)
    for attempt in range(3):
        head_of(engine).propose(
            [head_request(engine, tiny_model, tiny_tokenizer, HELD_OUT_TEXTS[index % 8], rows) for index in range(rows)]
        )
        if attempt == 0:
            assert levels.calls[0] == rows  # tried once, whatever the cost
            first = len(levels.calls)
    assert (len(levels.calls) > first) == runs, levels.calls


def test_training_positions_skip_answers_too_short_to_unroll():
    """An answer shorter than the unrolled levels (one cut short at the budget's end) gives no
    position; the positions of the others stay within their own answer."""
    traces = [(torch.zeros(2, 4), torch.tensor([1, 2])), (torch.zeros(6, 4), torch.arange(6))]
    assert train_head.Examples(traces, 3).usable.tolist() == [2, 3, 4]


def test_the_head_stops_at_a_width_where_its_drafts_lost_and_probes_there_now_and_then():
    """Steps of 16 rows where the head's verified tokens were all rejected make a loss: the
    head skips such steps but for one in PROBE_EVERY; steps of one row keep their own record."""
    record = HeadRecord()
    for _ in range(5):
        assert record.pays(16)
        record.pending = (16, 0.5, 0.4)
        record.settle(verified=3, accepted=0)
    decisions = [record.pays(16) for _ in range(2 * HeadRecord.PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[HeadRecord.PROBE_EVERY - 1]
    assert record.pays(1)
    record.pending = (1, 0.05, 0.02)
    record.settle(verified=3, accepted=2)
    assert record.pays(1)


def test_a_head_whose_steps_vary_is_not_stopped_by_a_few_unlucky_ones():
    """Steps that alternate between all rejected and all accepted (a loss of 1.7 tokens, a
    gain of 1.3: a mean a little below zero, by less than its standard error) keep the head
    drafting; a steady loss of the same mean stops it."""
    noisy, steady = HeadRecord(), HeadRecord()
    for step in range(12):
        for record, accepted, verified in ((noisy, 3 * (step % 2), 3), (steady, 0, 0)):
            assert record.pays(4) or record is steady
            record.pending = (4, 0.5 if record is noisy else 0.2, 0.4)
            record.settle(verified, accepted)
    assert noisy.pays(4)
    assert not steady.pays(4)


def test_a_step_settles_what_the_heads_tokens_brought(trained, tiny_model, tiny_tokenizer):
    """A real step with the head drafting records its outcome for that step's width."""
    engine = head_engine(trained, tiny_model, tiny_tokenizer, max_adaptive_k=4, max_adaptive_nodes=12)
    for text in HELD_OUT_TEXTS[:3]:
        engine.add(GenerationRequest(tiny_tokenizer(text).input_ids, 12))
    emitted = 0
    while engine.busy:
        emitted += sum(len(outcome.tokens) for outcome in engine.step())
    assert emitted == 3 * 12
    _, _, steps = engine.planner.head._net[(3).bit_length()]
    assert steps > 0 and engine.planner.head.pending is None


def test_each_feature_goes_to_the_head_once_through_the_draft_request(trained, tiny_model, tiny_tokenizer):
    engine = head_engine(trained, tiny_model, tiny_tokenizer, max_adaptive_k=4, max_adaptive_nodes=12)
    engine.add(GenerationRequest(tiny_tokenizer(HELD_OUT_TEXTS[0]).input_ids, 12))
    while not any(sequence.feature is not None for sequence in engine._active):
        engine.step()  # the prefill, then a step whose features the head keeps
    given = []
    head = head_of(engine)
    propose = head.propose
    head.propose = lambda requests: (given.extend(r.feature for r in requests), propose(requests))[1]
    engine.propose()
    assert len(given) == 1 and given[0] is not None
    assert all(sequence.feature is None for sequence in engine._active)  # taken by the request, not drafted from twice


def test_a_budget_too_short_for_any_answer_stops_the_trainer_with_what_to_change():
    args = train_head.parser().parse_args(["--minutes", "0.05"])
    trace = (torch.zeros(3, 4), torch.arange(3))
    assert train_head.too_little_data([trace], [trace], args) is None
    for traces, held_out, which in (([], [trace], "for training"), ([trace], [], "held out")):
        message = train_head.too_little_data(traces, held_out, args)
        assert message is not None and which in message and "--minutes 0.05" in message and "--data-share 0.5" in message
