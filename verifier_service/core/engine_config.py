"""The engine's settings (``EngineConfig``, each also a flag of the service) and the rules
a request must meet before it takes a slot (``check_request``)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.flags import setting
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.generation import GenerationRequest

# Cache positions per slot when neither the flag nor a shorter model context
# says otherwise: 16 slots x 4096 tokens of the default model is 3 GB of
# float32 cache, touched on the CPU only as far as requests reach.
DEFAULT_MAX_SEQUENCE_TOKENS = 4096
# The most predictions per position the drafter keeps (its successor table's bound).
MAX_PREDICTIONS = 16


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is also a flag of the service (``specdec.flags``)."""

    # Hard cap on K per step: the verify pass widens with K, and on CPU the
    # cost of scoring more than ~9 tokens a row stops being nearly free.
    max_speculative_tokens: int = setting(16, minimum=0, help="the most draft tokens a request may ask to verify per step")
    # n-gram chains past ~8 tokens are rarely all right, but a copy of a long
    # earlier occurrence (a file returned with an edit, an answer asked for
    # again) often is for dozens: the planner verifies as deep as the measured
    # acceptance at that match length pays for. The drafter's own cap is 32.
    max_adaptive_k: int = setting(
        32, minimum=1, formerly=["adaptive-max-k"], help="draft depth asked for when K is adaptive; the planner verifies what pays"
    )
    # The planner picks from these by expected tokens per second of step, so
    # asking for more costs the drafter's time, not the target's: on a GPU a
    # pass of 64 tokens costs about what one of 1 does, and wide trees pay.
    max_adaptive_nodes: int = setting(
        16,
        minimum=0,
        formerly=["adaptive-max-nodes"],
        help="draft tree nodes asked for when K is adaptive (0: chains only); the planner verifies those worth their cost",
    )
    # On a 2-core CPU a step of 16 rows costs ~2x a step of 1; more rows stop
    # paying long before memory runs out.
    max_batch_size: int = setting(16, minimum=1, help="cache slots: sequences decoding or prefilling at once")
    # None: the model's context, at most DEFAULT_MAX_SEQUENCE_TOKENS. Memory:
    # max_batch_size x this x the model's bytes per token.
    max_sequence_tokens: int | None = setting(
        None, minimum=1, help="KV cache positions per request, prompt + max_new_tokens (none: the model's context, at most 4096)"
    )
    # Bounds a request's hold on a batch slot.
    max_new_tokens_limit: int = setting(
        4096, minimum=1, flag="max-new-tokens", formerly=["max-new-tokens-limit"], help="the longest generation one request may ask for"
    )
    # Each stop string is searched for in every new piece of output, and
    # streaming holds back up to its length.
    max_stop_strings: int = setting(16, minimum=1, formerly=["stop-strings-limit"], help="stop strings one request may give")
    max_stop_string_length: int = setting(256, minimum=1, formerly=["stop-string-length-limit"], help="characters per stop string")
    # Larger chunks use the GEMMs better (per-token cost falls ~2x from 64 to
    # 256 tokens on CPU) but stall the running sequences longer; 256 costs
    # them about a 2-3 decode steps' time.
    prefill_chunk_tokens: int = setting(256, minimum=1, help="prompt tokens one step may prefill alongside the running sequences")
    # Readiness waits on it only when no calibration is stored: 9 s measures every
    # count for the default model on an idle 2-core AVX512-BF16 CPU, 30 s where
    # bfloat16 is emulated (AVX2); the coarse counts come first, later starts
    # complete the rest and real steps refine them all (calibration.py).
    calibration_budget_s: float = setting(
        15.0, minimum=0.0, help="seconds a start without a stored step-cost calibration may spend measuring one"
    )
    # The target's own top predictions at every position a step scores, sent to
    # the drafter (its successor table, which drafts where n-grams find nothing).
    # Top-8 after a token pair held the next token 44% of the time on open text.
    successor_top_k: int = setting(
        8, minimum=0, help="the target's top predictions per scored position sent to the drafter (0: none; at most 16)"
    )

    # Fixed shapes for every pass (core/invariance.py): a token's logits are then bitwise
    # the same whatever shares its pass, which exactness needs in bfloat16. Auto takes them
    # where the library's matrix rows are invariant already, at every row count or up to
    # one of at least a tile (a start-up probe; bfloat16 on a CPU with AVX512-BF16, up to
    # 32 rows with AMX): there they keep 0.74-0.91x the throughput; float32's tiles 0.57-0.64x
    # (bench.bench_dtype --batch-invariant off on).
    batch_invariant: str = setting(
        "auto",
        choices=["auto", "on", "off"],
        help="compute every pass with fixed shapes, so a token's logits do not depend on what else is in its pass "
        "(auto: where this machine's matrix kernels make it cheap, as a start-up probe finds)",
    )

    # The start-up chooser (core/forms.py) ranks the exact forms by the decoding tokens/s
    # their timed passes promise at one stream and at a full batch: one stream's speed is
    # what a user waits on, the batch's what a busy service serves; balanced weighs them alike.
    optimize_for: str = setting(
        "balanced",
        choices=["balanced", "latency", "throughput"],
        help="what the form chosen at start-up is fastest at: latency (one stream), throughput (a full batch, "
        "--max-batch-size up to 16) or balanced (the geometric mean of both)",
    )
    # Every candidate is timed in two rounds at least; a third, and the thread counts of the
    # best form, only within the budget (forms.py). ~16 s on an idle 2-core AVX512-BF16 CPU.
    form_budget_s: float = setting(
        15.0,
        minimum=0.0,
        help="seconds a start without a stored form choice spends timing the candidate forms: past it, each is timed in "
        "two rounds only and the best form's other thread counts are not weighed",
    )

    # Each entry costs a column write at every verified position of the request.
    max_logit_bias: int = setting(300, minimum=0, formerly=["logit-bias-limit"], help="logit_bias entries one request may give")
    # Each asked-for alternative costs a top-k per emitted token; OpenAI allows 20.
    max_logprobs: int = setting(20, minimum=0, help="the most alternatives per token a request may ask log-probabilities of")
    # A prompt's log-probabilities are kept per position (1 + alternatives values) until the
    # request ends and then rendered into its answer; the logits behind them never exceed one
    # prefill chunk. 4096 covers the default cache's longest prompt.
    max_prompt_logprobs_tokens: int = setting(
        4096, minimum=0, help="the longest prompt (in tokens) whose log-probabilities one request may ask for (prompt_logprobs, echo)"
    )

    def __post_init__(self) -> None:
        if self.successor_top_k > MAX_PREDICTIONS:
            raise ValueError(f"successor_top_k must be at most {MAX_PREDICTIONS} (what the drafter keeps), got {self.successor_top_k}")

    def check_logit_bias_count(self, entries: int) -> None:
        """``InvalidRequest`` for a ``logit_bias`` of more than --max-logit-bias entries. The
        front doors call it on the count alone, before converting or checking any entry (a
        600k-entry map took its conversion's time first), and ``validate`` again."""
        if entries > self.max_logit_bias:
            limit = self.max_logit_bias
            raise InvalidRequest("logit_bias", f"{{field}} takes at most {limit} tokens (--max-logit-bias), got {entries}")


def check_request(request: GenerationRequest, config: EngineConfig, vocab_size: int, capacity: int) -> None:
    """Every rule a request must meet, in one place: an ``InvalidRequest`` naming the
    field (and the flag that sets its limit), fit to show the client."""
    if not request.prompt_ids:
        raise InvalidRequest("prompt_ids", "prompt is empty: set prompt (text) or prompt_token_ids")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest("prompt_ids", f"{{field}}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if request.max_new_tokens == 0 and request.prompt_logprobs is None:
        raise InvalidRequest(
            "max_new_tokens", "{field} 0 generates nothing; it is taken only to score the prompt (its log-probabilities asked for)"
        )
    if not 0 <= request.max_new_tokens <= config.max_new_tokens_limit:
        raise InvalidRequest(
            "max_new_tokens",
            f"{{field}} must be in [1, {config.max_new_tokens_limit}] (the server's --max-new-tokens), got {request.max_new_tokens}",
        )
    needed = len(request.prompt_ids) + request.max_new_tokens
    if needed > capacity:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({len(request.prompt_ids)} tokens) + {{field}} ({request.max_new_tokens}) needs {needed} "
            f"cache positions; this server holds at most {capacity} per request",
        )
    if request.num_speculative_tokens is not None and not 0 <= request.num_speculative_tokens <= config.max_speculative_tokens:
        raise InvalidRequest(
            "num_speculative_tokens",
            f"{{field}} must be in [0, {config.max_speculative_tokens}] (unset = adaptive), got {request.num_speculative_tokens}",
        )
    if len(request.stop) > config.max_stop_strings:
        raise InvalidRequest(
            "stop", f"{{field}} takes at most {config.max_stop_strings} strings (--max-stop-strings), got {len(request.stop)}"
        )
    for index, stop in enumerate(request.stop):
        if not stop:
            raise InvalidRequest("stop", f"{{field}}[{index}] is empty; stop strings must be non-empty")
        if len(stop) > config.max_stop_string_length:
            raise InvalidRequest(
                "stop",
                f"{{field}}[{index}] is {len(stop)} characters; at most {config.max_stop_string_length} (--max-stop-string-length)",
            )
    sampling = request.sampling
    config.check_logit_bias_count(len(sampling.logit_bias))
    sampling.validate()
    outside = [token for token, _ in sampling.logit_bias if not 0 <= token < vocab_size]
    if outside:
        raise InvalidRequest("logit_bias", f"{{field}} names token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    if sampling.min_tokens > request.max_new_tokens:
        raise InvalidRequest(
            "min_tokens", f"{{field}} ({sampling.min_tokens}) must not exceed the tokens asked for ({request.max_new_tokens})"
        )
    if request.logprobs is not None and not 0 <= request.logprobs <= config.max_logprobs:
        raise InvalidRequest(
            "logprobs", f"{{field}} must be in [0, {config.max_logprobs}] alternatives (--max-logprobs), got {request.logprobs}"
        )
    _check_prompt_logprobs(request, config)


def _check_prompt_logprobs(request: GenerationRequest, config: EngineConfig) -> None:
    top = request.prompt_logprobs
    if top is None:
        return
    if not 0 <= top <= config.max_logprobs:
        raise InvalidRequest("prompt_logprobs", f"{{field}} must be in [0, {config.max_logprobs}] alternatives (--max-logprobs), got {top}")
    if len(request.prompt_ids) > config.max_prompt_logprobs_tokens:
        raise InvalidRequest(
            "prompt_logprobs",
            f"the prompt's log-probabilities ({{field}}) are computed for prompts of at most {config.max_prompt_logprobs_tokens} "
            f"tokens (--max-prompt-logprobs-tokens); this one has {len(request.prompt_ids)}",
        )
