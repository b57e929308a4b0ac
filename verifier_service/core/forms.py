"""The form a model is served in, chosen at start-up by measuring: its dtype, its weights'
form and the thread count (``Form``).

Every form the service chooses by itself is exact: speculative output equals plain output
of the same form. float32 is (its rounding has been too small to flip a greedy choice, and
it is transformers' own arithmetic); a bfloat16 form is only with batch-invariant passes
(``invariance``), so it is a candidate only where the engine would run its passes with fixed
shapes. Which exact form is fastest depends on the machine: bfloat16 is emulated, and slower
than float32, on a CPU without AVX512-BF16 or AMX; PyTorch's int4 kernel runs on CPUs only;
one thread can beat two where the other core is busy. So ``choose_form`` builds an engine of
each candidate and times the same passes in each, round by round, and keeps the form whose
passes cost least (the geometric mean over a one-token pass, a chain's pass, and a batch's
passes of one and of four tokens a row): first the forms at torch's thread count, then the
fastest of them at one thread. A chosen form is kept in a folder, keyed by what
decides it (the model, the device, the CPU, torch and the candidates): later starts on
the same machine take it without measuring.
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

from verifier_service.core.calibration import StepCostModel, cpu_name, time_pass
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.engine_config import EngineConfig
from verifier_service.core.keyed_file import KeyedFile
from verifier_service.core.llama_pass import forward_name
from verifier_service.core.model_loading import LoadedModel, has_fast_bfloat16, load_model
from verifier_service.core.packed_linear import output_kernel, use_packed_output
from verifier_service.core.weights import int4_supported, int8_supported, use_int4_weights, use_int8_weights

log = logging.getLogger(__name__)

# Each candidate's passes are timed this many times, round by round across the candidates
# (load comes in bursts; rounds spread a burst over all of them), and each pass's fastest kept.
ROUNDS = 3
# Cache positions of the engines that only time passes: each pass reads one cached column.
PROBE_CAPACITY = 64
# Raised when what makes a form eligible changes, so choices stored before are measured again.
STORED_FORMAT = 2


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
class Choice:
    """What ``choose_form`` found: the form, the model in it, and each timed form's mean
    seconds per pass (empty when there was one candidate, or the choice was stored)."""

    form: Form
    model: PreTrainedModel
    timings: dict[Form, float]
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


def pass_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """(tokens, rows) of the passes a form is timed on: one token; a chain of the adaptive depth;
    a full batch of one token a row and of four."""
    rows = min(config.max_batch_size, 16)
    chain = 1 + min(config.max_adaptive_k, config.max_speculative_tokens)
    return sorted({(1, 1), (chain, 1), (rows, rows), (4 * rows, rows)})


def choose_form(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    forms: list[Form],
    config: EngineConfig,
    folder: Path | None = None,
) -> Choice:
    """The form of ``forms`` whose passes cost least on this machine, with ``model`` (in
    float32, or in the one dtype of ``forms``) converted into it. One candidate is taken
    without measuring; a form stored in ``folder`` under the same key is taken at once."""
    if len(forms) == 1:
        return Choice(forms[0], in_form(model, forms[0]), {})
    key = form_key(model, forms, config)
    stored = read_choice(folder, key) if folder is not None else None
    if stored is not None:
        log.info("serving in %s (stored for this machine)", stored)
        return Choice(stored, in_form(model, stored), {}, stored=True)
    started = time.monotonic()
    engines: dict[Form, SpeculativeEngine] = {}

    def timed(these: list[Form]) -> dict[Form, float]:
        for form in these:
            if form not in engines:
                with using_threads(form.threads):
                    engines[form] = probe_engine(in_form(model, form, keep=True), tokenizer, config)
        exact = [form for form in these if form.dtype == "float32" or engines[form].target.invariance is not None]
        if config.batch_invariant == "off" or not exact:  # inexact forms asked for by name
            exact = these
        for form in set(these) - set(exact):
            log.info("%s left out: its passes would not be batch-invariant here, so not exact", form)
        return time_forms({form: engines[form] for form in exact}, pass_shapes(config))

    # The forms at the first thread count, then the fastest of them at the others.
    timings = timed([form for form in forms if form.threads == forms[0].threads])
    chosen = min(timings, key=lambda form: timings[form])
    other_threads = [form for form in forms if (form.dtype, form.weights) == (chosen.dtype, chosen.weights) and form != chosen]
    if other_threads:
        timings |= timed([chosen, *other_threads])
        chosen = min([chosen, *other_threads], key=lambda form: timings[form])
    engines.clear()
    gc.collect()
    log.info(
        "serving in %s, the fastest exact form here (ms per pass, geometric mean: %s; measured in %.1f s)",
        chosen,
        ", ".join(f"{form}: {1000 * seconds:.1f}" for form, seconds in timings.items()),
        time.monotonic() - started,
    )
    if folder is not None:
        write_choice(folder, key, chosen, timings)
    return Choice(chosen, in_form(model, chosen), timings)


def probe_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig) -> SpeculativeEngine:
    """An engine of ``config``'s slots and passes (batch-invariant or free, as it would serve)
    that only times passes: a short cache and a flat step cost, no calibration."""
    short = replace(config, max_sequence_tokens=PROBE_CAPACITY)
    return SpeculativeEngine(model, tokenizer, None, short, StepCostModel({1: 1.0, 1024: 1.0}))


def time_forms(engines: dict[Form, SpeculativeEngine], shapes: list[tuple[int, int]]) -> dict[Form, float]:
    """Each engine's geometric mean over ``shapes`` of its fastest pass in ROUNDS rounds, the
    engines taking turns within each round."""
    best: dict[Form, dict[tuple[int, int], float]] = {form: {} for form in engines}
    with torch.inference_mode():
        for form, engine in engines.items():  # a first pass of each shape: warm-up, not timed
            with using_threads(form.threads):
                for tokens, rows in shapes:
                    time_pass(engine, tokens, rows)
        for _ in range(ROUNDS):
            for form, engine in engines.items():
                with using_threads(form.threads):
                    for shape in shapes:
                        seconds = time_pass(engine, *shape)
                        best[form][shape] = min(best[form].get(shape, math.inf), seconds)
    return {form: math.exp(sum(math.log(s) for s in times.values()) / len(times)) for form, times in best.items()}


def form_key(model: PreTrainedModel, forms: list[Form], config: EngineConfig) -> dict:
    """What decides the choice: a stored one is taken only under the same."""
    parameter = next(model.parameters())
    device = parameter.device
    key = {
        "format": STORED_FORMAT,
        "model": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "candidates": [asdict(form) for form in forms],
        "shapes": pass_shapes(config),
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


def write_choice(folder: Path, key: dict, form: Form, timings: dict[Form, float]) -> None:
    """Store the choice whole (by rename); a folder that cannot be written is logged, not fatal."""
    try:
        KeyedFile(folder, "form", key).write({"form": asdict(form), "seconds_per_pass": {str(f): s for f, s in timings.items()}})
    except OSError as error:
        log.warning("the chosen form is not kept (%s): the next start measures again", error)
