"""The form a model is served in, chosen at start-up by measuring: its dtype, its weights'
form and the thread count (``Form``).

Every form the service chooses by itself is exact: speculative output equals plain output
of the same form. float32 is (its rounding has been too small to flip a greedy choice, and
it is transformers' own arithmetic); a bfloat16 form is only with batch-invariant passes
(``invariance``), so it is a candidate only where the engine would run its passes with fixed
shapes. Which exact form is fastest depends on the machine, and nothing here assumes it from
the CPU's name: bfloat16 is emulated on a CPU without AVX512-BF16 or AMX, where its matrix
products of many rows cost more than float32's while a lone row's still cost less; PyTorch's
int4 kernel runs on CPUs only and unpacks its weight again for every few rows; one thread
can beat two where the other core is busy.

So ``choose_form`` builds an engine of each candidate and times the same passes in each,
round by round, every pass reading PROBE_CONTEXT cached tokens a row: a lone token, a chain
of the adaptive depth, and a full batch (``--max-batch-size``, at most 16 rows) of one and
of four tokens a row. From those it reckons what each form would decode (``Speed``): tokens
per second at one stream and at the full batch, speculative as the planner runs it, each
draft token accepted with the planner's prior odds (``planner.PRIOR_HAZARD``, 0.5), at the
draft depth that pays best in that form (0: plain decoding). ``--optimize-for`` weighs the
two: latency takes one stream's, throughput the batch's, balanced (the default) their
geometric mean. The forms at torch's thread count are ranked first, then the best of them
at one thread. A chosen form is kept in a folder, keyed by what decides it (the model, the
device, the CPU, torch, the candidates and the mix): later starts on the same machine take
it without measuring.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verifier_service.core.calibration import StepCostModel, cpu_kernels, cpu_name, time_pass
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.engine_config import EngineConfig
from verifier_service.core.keyed_file import KeyedFile
from verifier_service.core.llama_pass import forward_name
from verifier_service.core.model_loading import LoadedModel, has_fast_bfloat16, load_model
from verifier_service.core.packed_linear import output_kernel, use_packed_output
from verifier_service.core.planner import PRIOR_HAZARD
from verifier_service.core.weights import int4_supported, int8_supported, use_int4_weights, use_int8_weights

log = logging.getLogger(__name__)

# Each candidate's passes are timed this many times, round by round across the candidates
# (load comes in bursts; rounds spread a burst over all of them), and each pass's fastest kept.
# Rounds past MIN_ROUNDS run while --form-budget-seconds lasts: one round alone lets a burst
# decide (a one-token pass timed at 220 ms instead of 12 while another process took a core).
ROUNDS = 3
MIN_ROUNDS = 2
# Cached tokens each timed pass reads a row: attention's share of a pass, which fixed shapes
# change most, grows with it (a chat turn's context is hundreds of tokens).
PROBE_CONTEXT = 256
# The widest a timed row gets: a chain of the adaptive depth (at most 1 + max_speculative_tokens).
PROBE_TOKENS = 32
# Draft depths a full batch is timed at: a row's one token plus this many drafts, at most.
BATCH_DRAFTS = 3
# The weight of one stream's tokens/s in each --optimize-for mix (the batch's: the rest).
MIXES = {"latency": 1.0, "balanced": 0.5, "throughput": 0.0}
# Raised when what makes a form eligible changes, so choices stored before are measured again.
STORED_FORMAT = 3


@dataclass(frozen=True)
class Form:
    """How the model is computed: ``dtype`` (float32 or bfloat16), the linear layers'
    ``weights`` (float, in the dtype, int4 or int8) and torch's ``threads``."""

    dtype: str
    weights: str
    threads: int

    def __str__(self) -> str:
        weights = "" if self.weights == "float" else f", {self.weights} weights"
        return f"{self.dtype}{weights}, {self.threads} thread{'s' * (self.threads != 1)}"


@dataclass(frozen=True)
class Speed:
    """What a form's timed passes promise: decoding tokens per second at one stream and at a
    full batch of ``rows``, speculative as the planner runs it (``decode_speed``)."""

    one_stream: float
    batch: float
    rows: int

    def score(self, mix: str) -> float:
        """The geometric mean of the two, weighed by ``--optimize-for`` (``MIXES``)."""
        weight = MIXES[mix]
        return math.exp(weight * math.log(self.one_stream) + (1 - weight) * math.log(self.batch))

    def __str__(self) -> str:
        return f"{self.one_stream:.1f} at 1 stream, {self.batch:.1f} at {self.rows}"


@dataclass(frozen=True)
class Choice:
    """What ``choose_form`` found: the form, the model in it, and each timed form's expected
    speed (empty when there was one candidate, or the choice was stored)."""

    form: Form
    model: PreTrainedModel
    speeds: dict[Form, Speed]
    stored: bool = False


def load_served(
    name: str,
    device: torch.device,
    dtype: str = "auto",
    weights: str = "auto",
    threads: int = 0,
    config: EngineConfig | None = None,
    folder: Path | None = None,
    measure: bool = True,
) -> tuple[LoadedModel, Form]:
    """The model ``name`` in the form the flags ask for (``candidates``; the fastest measured
    where they leave a choice, or the first candidate without ``measure``), with torch set
    to the form's thread count: what a verifier serves, and the benchmarks measure."""
    config = config or EngineConfig()
    forms = candidates(dtype, weights, threads, device, config.batch_invariant)
    if not measure and len(forms) > 1:
        log.info("form not measured: %s", forms[0])
        forms = forms[:1]
    loaded = load_model(name, device=device, dtype="float32" if len({form.dtype for form in forms}) > 1 else forms[0].dtype)
    choice = choose_form(loaded.model, loaded.tokenizer, forms, config, folder)
    torch.set_num_threads(choice.form.threads)
    return replace(loaded, model=choice.model), choice.form


def candidates(dtype: str, weights: str, threads: int, device: torch.device, batch_invariant: str) -> list[Form]:
    """The forms a start may take for ``--dtype``, ``--weights`` and ``--threads`` (each may be
    "auto", or 0 threads), in order of preference on a tie.

    Left to itself the service considers only forms that can be exact (the module docstring):
    bfloat16 where passes may be batch-invariant (not ``--batch-invariant off``), and with
    float weights only where the hardware computes bfloat16 natively; int4 where its CPU
    kernel runs. A form named by the flags is taken as named."""
    named_bfloat16 = dtype == "bfloat16" or weights in ("int4", "int8")
    forms = []
    for form_dtype, form_weights in (("float32", "float"), ("bfloat16", "float"), ("bfloat16", "int4"), ("bfloat16", "int8")):
        if dtype not in ("auto", form_dtype) or weights not in ("auto", form_weights):
            continue
        if form_weights == "int8" and weights != "int8":  # named only: never faster than int4 (weights.py)
            continue
        supported = {"int4": int4_supported, "int8": int8_supported}.get(form_weights)
        if supported is not None and not supported(device):
            if weights == form_weights:
                raise ValueError(f"--weights {weights} runs on PyTorch's CPU kernel, which {device} lacks: use --weights float")
            continue
        if form_dtype == "bfloat16" and not named_bfloat16:
            if batch_invariant == "off" or (form_weights == "float" and not has_fast_bfloat16(device)):
                continue
        forms.append((form_dtype, form_weights))
    if not forms:
        raise ValueError(f"--weights {weights} computes with bfloat16 activations: --dtype {dtype} has no form with it")
    if threads:
        counts = [threads]
    else:  # one thread can beat several where the other cores are busy; a GPU's host thread count matters little
        counts = sorted({torch.get_num_threads(), 1}, reverse=True) if device.type == "cpu" else [torch.get_num_threads()]
    return [Form(form_dtype, form_weights, count) for form_dtype, form_weights in forms for count in counts]


def in_form(model: PreTrainedModel, form: Form, keep: bool = False) -> PreTrainedModel:
    """``model`` computed in ``form`` (a copy if ``keep``, else converted in place)."""
    if keep:
        model = copy.deepcopy(model)
    model = model.to(getattr(torch, form.dtype))
    if form.weights == "int4":
        use_int4_weights(model)
    elif form.weights == "int8":
        use_int8_weights(model)
    if form.dtype == "bfloat16":
        use_packed_output(model)
    return model


@contextlib.contextmanager
def using_threads(count: int) -> Iterator[None]:
    """torch computing with ``count`` threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def batch_rows(config: EngineConfig) -> int:
    """The rows of the full batch a form is timed and ranked at."""
    return min(config.max_batch_size, 16)


def chain_tokens(config: EngineConfig) -> int:
    """A one-stream pass's most tokens: the row's own and a draft of the adaptive depth."""
    return min(1 + min(config.max_adaptive_k, config.max_speculative_tokens), PROBE_TOKENS)


def pass_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """(tokens, rows) of the passes a form is timed on: one token; a chain of the adaptive depth;
    a full batch of one token a row and of 1 + BATCH_DRAFTS."""
    rows = batch_rows(config)
    return sorted({(1, 1), (chain_tokens(config), 1), (rows, rows), ((1 + BATCH_DRAFTS) * rows, rows)})


def choose_form(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    forms: list[Form],
    config: EngineConfig,
    folder: Path | None = None,
) -> Choice:
    """The form of ``forms`` that promises the most for ``config.optimize_for`` on this
    machine, with ``model`` (in float32, or in the one dtype of ``forms``) converted into it.
    One candidate is taken without measuring; a form stored in ``folder`` under the same key
    is taken at once."""
    if len(forms) == 1:
        return Choice(forms[0], in_form(model, forms[0]), {})
    key = form_key(model, forms, config)
    stored = read_choice(folder, key) if folder is not None else None
    if stored is not None:
        log.info("serving in %s (stored for this machine)", stored)
        return Choice(stored, in_form(model, stored), {}, stored=True)
    started = time.monotonic()
    deadline = started + config.form_budget_s
    engines: dict[Form, SpeculativeEngine] = {}
    timings: dict[Form, dict[tuple[int, int], float]] = {}  # each form's fastest pass of each shape, over every round
    mix = config.optimize_for
    log.info(
        "measuring which form serves fastest here, once (%s): %s; " "%d to %d rounds each, more only within %.0f s (--form-budget-seconds)",
        f"kept for later starts in {folder}" if folder is not None else "not kept: no cache folder",
        "; ".join(str(form) for form in forms if form.threads == forms[0].threads),
        MIN_ROUNDS,
        ROUNDS,
        config.form_budget_s,
    )

    def timed(these: list[Form]) -> dict[Form, Speed]:
        for form in these:
            if form not in engines:
                with using_threads(form.threads):
                    engines[form] = probe_engine(in_form(model, form, keep=True), tokenizer, config)
        exact = [form for form in these if form.dtype == "float32" or engines[form].target.invariance is not None]
        if config.batch_invariant == "off" or not exact:  # inexact forms asked for by name
            exact = these
        for form in set(these) - set(exact):
            log.info("%s left out: its passes would not be batch-invariant here, so not exact", form)
        seconds = time_forms({form: engines[form] for form in exact}, pass_shapes(config), deadline, timings)
        speeds = {form: decode_speed(seconds[form], config) for form in exact}
        for form, speed in speeds.items():
            log.info("%s: decoding tokens/s expected %s (%.0f s in)", form, speed, time.monotonic() - started)
        return speeds

    # The forms at the first thread count, then the best of them at the others.
    speeds = timed([form for form in forms if form.threads == forms[0].threads])
    chosen = max(speeds, key=lambda form: speeds[form].score(mix))
    other_threads = [form for form in forms if (form.dtype, form.weights) == (chosen.dtype, chosen.weights) and form != chosen]
    if other_threads and time.monotonic() >= deadline:
        log.info("%s not weighed: the form budget is spent (--form-budget-seconds)", "; ".join(map(str, other_threads)))
    elif other_threads:
        speeds |= timed([chosen, *other_threads])
        chosen = max([chosen, *other_threads], key=lambda form: speeds[form].score(mix))
    engines.clear()
    gc.collect()
    runner_up = max((form for form in speeds if form != chosen), key=lambda form: speeds[form].score(mix), default=None)
    log.info(
        "serving in %s: the most decoding tokens/s for --optimize-for %s (%s)%s; measured in %.1f s",
        chosen,
        mix,
        MIX_WORDS[mix],
        "" if runner_up is None else f", {speeds[chosen].score(mix) / speeds[runner_up].score(mix):.2f}x the next, {runner_up}",
        time.monotonic() - started,
    )
    if folder is not None:
        write_choice(folder, key, chosen, speeds)
    return Choice(chosen, in_form(model, chosen), speeds)


MIX_WORDS = {
    "latency": "one stream",
    "balanced": "the geometric mean of one stream and a full batch",
    "throughput": "a full batch",
}


def probe_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig) -> SpeculativeEngine:
    """An engine of ``config``'s slots and passes (batch-invariant or free, as it would serve)
    that only times passes: a cache of PROBE_CONTEXT tokens and the widest timed row, a flat
    step cost, no calibration."""
    short = replace(config, max_sequence_tokens=PROBE_CONTEXT + PROBE_TOKENS)
    return SpeculativeEngine(model, tokenizer, None, short, StepCostModel({1: 1.0, 1024: 1.0}))


def time_forms(
    engines: dict[Form, SpeculativeEngine],
    shapes: list[tuple[int, int]],
    deadline: float = math.inf,
    best: dict[Form, dict[tuple[int, int], float]] | None = None,
) -> dict[Form, dict[tuple[int, int], float]]:
    """Each engine's fastest seconds per pass of each of ``shapes`` (every row reading
    PROBE_CONTEXT cached tokens) in ROUNDS rounds, the engines taking turns within each round;
    rounds past the first only before ``deadline`` (``time.monotonic``). Into ``best`` where
    given: a form timed before keeps its faster passes."""
    best = {} if best is None else best
    for form in engines:
        best.setdefault(form, {})
    with torch.inference_mode():
        for form, engine in engines.items():  # a first pass of each shape: warm-up, not timed
            with using_threads(form.threads):
                for tokens, rows in shapes:
                    time_pass(engine, tokens, rows, PROBE_CONTEXT)
        for round_ in range(ROUNDS):
            if round_ >= MIN_ROUNDS and time.monotonic() >= deadline:
                log.info("form timing stopped after %d of %d rounds (--form-budget-seconds)", round_, ROUNDS)
                break
            for form, engine in engines.items():
                with using_threads(form.threads):
                    for shape in shapes:
                        seconds = time_pass(engine, *shape, PROBE_CONTEXT)
                        best[form][shape] = min(best[form].get(shape, math.inf), seconds)
    return best


def decode_speed(seconds: dict[tuple[int, int], float], config: EngineConfig) -> Speed:
    """What passes costing ``seconds`` (by (tokens, rows), ``pass_shapes``) decode: at one
    stream, the best over draft depths 0 to the adaptive depth of the tokens a step yields
    (its own, and each draft token kept with the odds PRIOR_HAZARD of every one before it)
    per second of a pass of that many tokens; at the full batch the same with every row at
    one depth, up to BATCH_DRAFTS. A pass of a count not timed costs by linear interpolation
    between the timed counts of its row count."""
    rows = batch_rows(config)

    def best(width: int, depths: int) -> float:
        timed = sorted((tokens, cost) for (tokens, count), cost in seconds.items() if count == width)
        rates = []
        for drafts in range(depths + 1):
            tokens = width * (1 + drafts)
            if tokens > timed[-1][0]:
                break
            yielded = width * sum(PRIOR_HAZARD**kept for kept in range(drafts + 1))
            rates.append(yielded / _interpolated(timed, tokens))
        return max(rates)

    return Speed(best(1, chain_tokens(config) - 1), best(rows, BATCH_DRAFTS), rows)


def _interpolated(points: list[tuple[int, float]], tokens: int) -> float:
    """The cost at ``tokens`` on the line through the timed ``points`` (sorted) around it."""
    for (low, low_cost), (high, high_cost) in zip(points, points[1:]):
        if low <= tokens <= high:
            return low_cost + (high_cost - low_cost) * (tokens - low) / (high - low)
    return points[0][1]


def form_key(model: PreTrainedModel, forms: list[Form], config: EngineConfig) -> dict:
    """What decides the choice: a stored one is taken only under the same."""
    parameter = next(model.parameters())
    device = parameter.device
    key = {
        "format": STORED_FORMAT,
        "model": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "cpu": cpu_name(),
        "kernels": cpu_kernels(),
        "torch": torch.__version__,
        "candidates": [asdict(form) for form in forms],
        "shapes": pass_shapes(config),
        "context": PROBE_CONTEXT,
        "optimize_for": config.optimize_for,
        "batch_invariant": config.batch_invariant,
        "forward": forward_name(model),
        "output": output_kernel(model),
    }
    return json.loads(json.dumps(key))  # as it reads back from a file: tuples as lists


def read_choice(folder: Path, key: dict) -> Form | None:
    """The form stored for ``key``; None when there is none, or it is unreadable or of another key."""
    try:
        stored = KeyedFile(folder, "form", key).read()
        form = None if stored is None else Form(**stored["form"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return form if form is not None and asdict(form) in key["candidates"] else None


def write_choice(folder: Path, key: dict, form: Form, speeds: dict[Form, Speed]) -> None:
    """Store the choice whole (by rename); a folder that cannot be written is logged, not fatal."""
    try:
        measured = {str(f): {"one_stream": speed.one_stream, "batch": speed.batch, "rows": speed.rows} for f, speed in speeds.items()}
        KeyedFile(folder, "form", key).write({"form": asdict(form), "tokens_per_second": measured})
    except OSError as error:
        log.warning("the chosen form is not kept (%s): the next start measures again", error)
