"""What a forward pass costs on this machine: ``StepCostModel``, and measuring it at start-up.

The engine prices every step with a ``StepCostModel`` (the planner weighs
draft tokens against it, padding picks cheaper token counts from it, and
each real step refines it). ``calibrate_step_cost`` measures one on the real
device, once per model object (``calibrated_step_cost``), within a time
budget (``EngineConfig.calibration_budget_s``); tests and benches hand the
engine a model of their own instead.

Load only ever adds time to a pass, so what is kept is what load cannot
inflate from below: the minimum of repeated timings, or a low quantile of
many real steps, and a stored cost is only ever lowered by such evidence.
Readiness never waits on a busy machine: a start with a complete stored
calibration serves from it at once, without a forward pass; one cut short is
probed and completed only when the probe finds the machine no busier; a start
without one measures for at most the budget, coarse token counts first, so a
calibration cut short still spans every step size.

The service keeps the calibration in a folder (``load_or_calibrate``),
keyed by what decides the costs: the model's shape and dtype, the device,
the CPU, the thread count, torch's version and the cache's shape. One JSON
file per key, ``step-cost-<sha256 of the key, 20 hex>.json``, format 1::

    {"key": {..., "format": 1},            # calibration_key(); another key is another file
     "points": {"1": 0.0617, ...},         # seconds per pass by tokens fed (positive)
     "per_context_token": 1.2e-7,          # seconds per cached token read by attention
     "up_to": 128,                         # linear layers as W @ x^T up to this many tokens
     "complete": true}                     # every count measured (false: the budget cut it
                                           # short; absent in older files: true)

It is written whole (by rename), at a calibration and whenever a probe or
real steps show the machine faster than stored (``StoredCalibration.lowered``).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import os
import platform
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from verifier_service.core.keyed_file import KeyedFile
from verifier_service.core.kv_cache import SlotKVCache
from verifier_service.core.linear_kernels import MEASURED_UP_TO, LinearKernels
from verifier_service.core.packed_linear import output_kernel
from verifier_service.core.weights import weights_form

log = logging.getLogger(__name__)


class CostProbe(Protocol):
    """What measuring needs of an engine, all public (``SpeculativeEngine`` is one): its
    model, settings, cache and linear-layer forms, and a packed pass run outside any step."""

    model: PreTrainedModel
    cache: SlotKVCache
    kernels: LinearKernels | None
    device: torch.device
    context_length: int

    @property
    def config(self) -> _BudgetedConfig: ...

    @property
    def slot_count(self) -> int: ...

    @property
    def passes(self) -> str:
        """How its passes are shaped (batch-invariant or free): a pass's cost depends on it."""

    @property
    def reads_per_token(self) -> bool:
        """Whether each token of a row reads the row's cached tokens (else each row once)."""

    def run_pass(self, decode_rows: list[tuple[int, list[int]]], segments: list, keep: list[int]) -> torch.Tensor: ...


class _BudgetedConfig(Protocol):
    @property
    def calibration_budget_s(self) -> float: ...


Clock = Callable[[], float]

# Token counts whose forward-pass cost is measured at start-up: every count up
# to 32, a full batch of one or two tokens a row (CPU kernels change cost in
# steps there, so padding can pay, and a count between two measured ones can
# cost what the higher one does: int4 weights are read once per four rows, and
# 17 tokens cost 22% more than 16, where the line from 16 to 20 said 5%), then a
# sparser grid up to a prefill chunk plus a batch of drafts.
CALIBRATION_TOKENS = (*range(1, 33), 48, 64, 96, 128, 192, 256, 384)
# Each count is timed this often and the fastest kept: load only adds time, so
# the minimum is what a busy machine cannot inflate from below.
CALIBRATION_REPEATS = 2
# Passes over the counts a calibration may make (within its budget): the
# second finds bursts of load in the first, a third rarely changes anything.
CALIBRATION_PASSES = 3
# Cached tokens per slot when timing attention's reads of the cache.
CALIBRATION_COLUMNS = 1024

# A stored calibration's layout (the module docstring); a file of another is measured again.
STORED_FORMAT = 1
# Token counts the start-up probe of a calibration cut short times (best of PROBE_REPEATS
# each), within PROBE_BUDGET_S: a few passes, ~1 s idle and a few seconds busy on the real model.
PROBE_TOKENS = (1, 4, 16)
PROBE_REPEATS = 3
PROBE_BUDGET_S = 5.0
# What a start with a calibration cut short spends measuring the counts left
# out (it cannot tell a quiet machine from one less busy than the first start
# was, so readiness waits on it only this long; later starts go on from there).
COMPLETION_BUDGET_S = 5.0
# Stored costs are lowered only when the evidence is at least this much
# faster: best-of-three timings on an idle machine vary by ~5-10%, and a
# smaller margin would rewrite the file at nearly every start.
LOWER_MARGIN = 0.15
# Real steps: the last STEP_WINDOW ratios (step time / stored cost) per token
# count are kept; a count with at least STEP_SAMPLES of them is evidence, and
# its STEP_QUANTILE-th quantile the ratio it shows (a tenth: steps that
# happened to run while the machine was quiet). Checked every CHECK_EVERY steps.
STEP_WINDOW = 100
STEP_SAMPLES = 50
STEP_QUANTILE = 0.1
CHECK_EVERY = 256

_calibrations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibrated_step_cost(engine: CostProbe, folder: Path | None = None) -> StepCostModel:
    """The step-cost model of ``engine``'s model on this machine, measured once per model
    object within ``engine.config.calibration_budget_s`` (and kept in ``folder`` across
    processes, when given: ``load_or_calibrate``)."""
    cached = _calibrations.get(engine.model)
    if cached is None:
        if folder is None:
            cached = calibrate_step_cost(engine, budget_s=engine.config.calibration_budget_s)
        else:
            cached = load_or_calibrate(engine, folder)
        _calibrations[engine.model] = cached
    return cached


def calibration_key(engine: CostProbe) -> dict:
    """What decides the step costs: a stored calibration is reused only under the same."""
    model = engine.model
    return {
        "format": STORED_FORMAT,
        "model": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(next(model.parameters()).dtype),
        "weights": weights_form(model),
        "output": output_kernel(model),
        "passes": engine.passes,
        "cache_reads": "per token" if engine.reads_per_token else "per row",
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else str(engine.device),
        "cpu": cpu_name(),
        "kernels": cpu_kernels(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "slots": engine.slot_count,
        "capacity": engine.cache.capacity,
        "tokens": list(CALIBRATION_TOKENS),
    }


def cpu_kernels() -> str:
    """The instruction sets torch's kernels use here: ATen's (``ATEN_CPU_CAPABILITY`` may hold
    it back) and oneDNN's ceiling (``ONEDNN_MAX_CPU_ISA``). One CPU name covers several, so
    what is measured under one is not taken under another."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "all"
    return f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN {onednn}"


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class StoredCalibration:
    """One calibration file's content (the module docstring's format)."""

    points: dict[int, float]  # seconds per pass by tokens fed
    per_context_token: float
    up_to: int  # linear layers as W @ x^T up to this many tokens (linear_kernels)
    complete: bool  # every count of CALIBRATION_TOKENS that fits was measured

    def lowered(self, ratios: dict[int, float]) -> StoredCalibration | None:
        """These costs lowered by robust timings of some token counts, each given as its ratio
        to the stored cost (a minimum of repeats, or a low quantile of real steps); None: keep them.

        Load only adds time, so a ratio above 1 says nothing about the machine, and one
        below is a bound on the count's cost. Every cost, the context term too, is scaled
        by the largest ratio (the count that improved least bounds them all, and the shape
        that padding reads is kept), and a stored count with a lower ratio of its own by
        that. Only ratios under 1 - LOWER_MARGIN count: best-of-three timings on an idle
        machine vary by ~5-10%.
        points {1: 0.4, 4: 0.5, 8: 1.0}, ratios {1: 0.25, 4: 0.5} -> {1: 0.1, 4: 0.25, 8: 0.5};
        ratios {1: 0.25, 4: 1.2} -> {1: 0.1, 4: 0.5, 8: 1.0} (4 tokens is slower: a busy machine).
        """
        below = 1 - LOWER_MARGIN
        factor = max(ratios.values()) if ratios and max(ratios.values()) <= below else 1.0
        own = {count: ratio for count, ratio in ratios.items() if ratio <= below and count in self.points}
        if factor == 1.0 and not own:
            return None
        points = {count: seconds * min(factor, own.get(count, 1.0)) for count, seconds in self.points.items()}
        return replace(self, points=points, per_context_token=self.per_context_token * factor)


class CalibrationFile:
    """Where one key's calibration is kept. Reading or writing it never fails a start:
    an unreadable file is no file, an unwritable one a warning."""

    def __init__(self, folder: Path, key: dict) -> None:
        self.file = KeyedFile(folder, "step-cost", key)
        self.key, self.path = key, self.file.path

    def read(self) -> StoredCalibration | None:
        try:
            record = self.file.read()
            if record is None:
                return None
            points = {int(count): float(seconds) for count, seconds in record["points"].items()}
            if not points or not all(count >= 1 and seconds > 0 for count, seconds in points.items()):
                raise ValueError("no positive step times")
            complete = record.get("complete", True)
            if not isinstance(complete, bool):
                raise TypeError(f"complete is {complete!r}, not true or false")
            return StoredCalibration(points, float(record["per_context_token"]), int(record["up_to"]), complete)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("stored step cost %s is unreadable (%s: %s); calibrating again", self.path, type(error).__name__, error)
            return None

    def write(self, stored: StoredCalibration) -> bool:
        record = {
            "points": stored.points,
            "per_context_token": stored.per_context_token,
            "up_to": stored.up_to,
            "complete": stored.complete,
        }
        try:
            self.file.write(record)  # whole or not at all, even beside another starting verifier
            return True
        except OSError as error:
            log.warning("could not store the step cost in %s (%s); the next start calibrates again", self.path, error)
            return False


def load_or_calibrate(engine: CostProbe, folder: Path, clock: Clock = time.monotonic) -> StepCostModel:
    """The calibration stored in ``folder`` for this key, served at once; else a new one,
    measured within ``engine.config.calibration_budget_s`` and stored for the next start.

    A complete stored one is served without a forward pass: a start on a busy machine
    must not wait on timings that load would only spoil. The model returned lowers the
    file whenever real steps show the machine faster (``KeptStepCostModel``), which is
    also how costs measured under load come down. A calibration cut short by its budget
    is probed (a few passes, within PROBE_BUDGET_S) and completed, COMPLETION_BUDGET_S
    at a time, by the starts that find the machine no busier than when it was measured;
    a probe faster by more than LOWER_MARGIN lowers its costs (``StoredCalibration.lowered``).
    """
    file = CalibrationFile(folder, calibration_key(engine))
    stored = file.read()
    if stored is None:
        log.info(
            "measuring what a step of each token count costs here, once (kept for later starts in %s): "
            "%.0f s at most (--calibration-budget-seconds)",
            folder,
            engine.config.calibration_budget_s,
        )
        model = calibrate_step_cost(engine, budget_s=engine.config.calibration_budget_s, clock=clock)
        fits = _fitting_tokens(engine, CALIBRATION_TOKENS)
        up_to = engine.kernels.up_to if engine.kernels is not None else 0
        stored = StoredCalibration(model.points(), model.per_context_token, up_to, set(fits) <= set(model.points()))
        file.write(stored)
        return KeptStepCostModel(stored, file)
    if engine.kernels is not None:
        engine.kernels.up_to = stored.up_to
    if stored.complete:
        log.info("step cost from %s, served at once; real steps lower it when they show the machine faster", file.path)
        return KeptStepCostModel(stored, file)
    probed = _probe(engine, stored.points, clock)
    busier = any(probed[count] > stored.points[count] * (1 + LOWER_MARGIN) for count in probed)
    lowered = stored.lowered({count: seconds / stored.points[count] for count, seconds in probed.items()})
    shown = "; ".join(f"{count} tokens: {1000 * probed[count]:.1f} ms now, {1000 * stored.points[count]:.1f} ms stored" for count in probed)
    if lowered is not None:
        log.info("stored step cost %s lowered: the machine is faster now (%s)", file.path, shown)
        stored = lowered
        file.write(stored)
    elif busier:
        log.info("step cost from %s kept; the machine is busier than when it was measured (%s); real steps refine it", file.path, shown)
    else:
        log.info("step cost from %s (%s)", file.path, shown or "not probed")
    if busier:
        log.info("stored step cost %s was cut short by its time budget; counts not measured are interpolated", file.path)
    else:
        stored = _completed(engine, stored, clock)
        file.write(stored)
    return KeptStepCostModel(stored, file)


def _completed(engine: CostProbe, stored: StoredCalibration, clock: Clock) -> StoredCalibration:
    """A calibration cut short by its budget, with as many of the counts it left out as
    COMPLETION_BUDGET_S allows measured now (the machine is no busier than when it was measured)."""
    fits = _fitting_tokens(engine, CALIBRATION_TOKENS)
    missing = [count for count in fits if count not in stored.points]
    log.info("measuring the %d step-cost counts a calibration cut short left out", len(missing))
    if not missing:
        return replace(stored, complete=True)
    budget_s = min(engine.config.calibration_budget_s, COMPLETION_BUDGET_S)
    measured = calibrate_step_cost(engine, missing, budget_s, clock, choose_forms=False)
    points = {**stored.points, **measured.points()}
    per_context_token = stored.per_context_token or measured.per_context_token
    return replace(stored, points=points, per_context_token=per_context_token, complete=set(fits) <= set(points))


def _probe(engine: CostProbe, stored: dict[int, float], clock: Clock) -> dict[int, float]:
    """Best-of-PROBE_REPEATS seconds now of the PROBE_TOKENS counts stored, as many as PROBE_BUDGET_S allows."""
    slots = engine.slot_count
    probed: dict[int, float] = {}
    started = clock()
    with torch.inference_mode():
        for count in PROBE_TOKENS:
            if count not in stored or clock() - started >= PROBE_BUDGET_S:
                continue
            probed[count] = _best_time(engine, PROBE_REPEATS, _spread(count, slots, cached=1), [], list(range(count)))
    return probed


def measuring_order(tokens: Sequence[int]) -> list[int]:
    """``tokens`` with the powers of two and the largest first, then the rest ascending: a
    calibration cut short by its budget still spans every step size, coarsely.

    (1, 2, 3, 4, 5, 6, 12) -> [1, 2, 4, 12, 3, 5, 6].
    """
    coarse = [count for count in sorted(tokens) if count & (count - 1) == 0 or count == max(tokens)]
    return coarse + [count for count in sorted(tokens) if count not in coarse]


def _fitting_tokens(engine: CostProbe, tokens: Sequence[int]) -> list[int]:
    """The counts a decode-shaped pass over the slots can carry (one cached column each)."""
    limit = min(engine.cache.capacity, engine.context_length) - 1
    return [count for count in tokens if count <= limit * engine.slot_count]


def calibrate_step_cost(
    engine: CostProbe,
    tokens: Sequence[int] = CALIBRATION_TOKENS,
    budget_s: float | None = None,
    clock: Clock = time.monotonic,
    choose_forms: bool = True,
) -> StepCostModel:
    """Seconds per packed forward pass at each token count, and per cached token read, on the real device.

    Each pass is decode-shaped, as the steps it prices: the tokens spread
    over as many slots as there are (up to one each), over one cached
    column, then over ``CALIBRATION_COLUMNS`` for the cache-read term. The
    slots hold zeros; no sequence is touched.

    Counts are measured in ``measuring_order``, the cache-read term right
    after the coarse ones, in up to CALIBRATION_PASSES passes, each count's
    minimum over them kept: load comes in bursts, and a later pass misses the
    burst an earlier one hit. Another pass follows only while the last one
    lowered some count by LOWER_MARGIN (on an idle machine the second agrees
    and ends it), and all stop once ``budget_s`` (None: no limit) has passed;
    the first count is always measured. ``choose_forms`` False times each
    count with the linear layers' form already chosen (completing a stored
    calibration) instead of timing both and choosing.
    """
    limit = min(engine.cache.capacity, engine.context_length) - 1
    slots = engine.slot_count
    fits = _fitting_tokens(engine, tokens)
    started = clock()

    def in_budget() -> bool:
        return budget_s is None or clock() - started < budget_s

    timings = _Timings(choose_forms and engine.kernels is not None)
    with torch.inference_mode():
        for _ in range(CALIBRATION_PASSES):
            lowered = False
            for count in measuring_order(fits):
                if timings.any() and not in_budget():
                    log.info("step-cost calibration stopped by its %.0f s budget (%d of %d counts)", budget_s, timings.count(), len(fits))
                    return timings.model(engine)
                lowered |= timings.measure(engine, count, slots)
                if count == max(fits) and in_budget():  # the last of measuring_order's coarse counts
                    timings.measure_context(engine, slots, limit)
            if not lowered:
                break
    return timings.model(engine)


class _Timings:
    """A calibration's best times so far: per count, with one form of the linear layers or
    both (``forms``, for ``linear_kernels.choose``), and of the cache-read step."""

    def __init__(self, choose_forms: bool) -> None:
        self.choose_forms = choose_forms
        self.points: dict[int, float] = {}
        self.forms: dict[int, tuple[float, float]] = {}  # count -> (as F.linear, as W @ x^T)
        self.context: tuple[int, int, float] | None = None  # (count, cached tokens read, seconds) as F.linear

    def any(self) -> bool:
        return bool(self.points or self.forms)

    def count(self) -> int:
        return len(self.points) + len(self.forms)

    def measure(self, engine: CostProbe, count: int, slots: int) -> bool:
        """Time ``count`` tokens again; whether its best time fell by LOWER_MARGIN (or is its first)."""
        rows = _spread(count, slots, cached=1)
        if not self.choose_forms or engine.kernels is None or count > MEASURED_UP_TO:
            seconds = _best_time(engine, CALIBRATION_REPEATS, rows, [], list(range(count)))
            before = self.points.get(count, float("inf"))
            self.points[count] = min(before, seconds)
            return seconds < before * (1 - LOWER_MARGIN)
        timed = []
        for form in (False, True):  # both forms of the linear layers (see linear_kernels); choose() keeps one
            with engine.kernels.forcing(form):
                timed.append(_best_time(engine, CALIBRATION_REPEATS, rows, [], list(range(count))))
        linear, transposed = self.forms.get(count, (float("inf"), float("inf")))
        self.forms[count] = (min(linear, timed[0]), min(transposed, timed[1]))
        return timed[0] < linear * (1 - LOWER_MARGIN) or timed[1] < transposed * (1 - LOWER_MARGIN)

    def measure_context(self, engine: CostProbe, slots: int, limit: int) -> None:
        """The steps of the largest count measured up to 2 per slot, over full slots (as F.linear)."""
        columns = min(limit - 2, CALIBRATION_COLUMNS)
        candidates = [count for count in (*self.points, *self.forms) if count <= 2 * slots]
        if not candidates or columns < 64:
            return
        count = max(candidates)
        rows = _spread(count, slots, cached=columns)
        with engine.kernels.forcing(False) if engine.kernels is not None else contextlib.nullcontext():
            seconds = _best_time(engine, CALIBRATION_REPEATS, rows, [], list(range(count)))
        if self.context is None or seconds < self.context[2]:
            self.context = (count, (count if engine.reads_per_token else len(rows)) * columns, seconds)

    def model(self, engine: CostProbe) -> StepCostModel:
        """The step costs under the forms ``choose`` keeps, and the cache-read term: the
        full-slot step less its tokens' own cost (both as F.linear), per cached token read."""
        points = dict(self.points)
        if self.choose_forms and engine.kernels is not None:
            engine.kernels.choose(self.forms)
            for count, (linear, transposed) in self.forms.items():
                points[count] = transposed if engine.kernels.transposed(count) else linear
        per_context_token = 0.0
        if self.context is not None:
            count, reads, seconds = self.context
            own = self.forms[count][0] if count in self.forms else self.points[count]
            per_context_token = max(0.0, (seconds - own) / reads)
        log.info(
            "step cost (tokens -> ms): %s; %.2f us per cached token read; linear layers as W @ x^T %s tokens",
            {k: round(1000 * v, 1) for k, v in sorted(points.items())},
            1e6 * per_context_token,
            f"up to {engine.kernels.up_to}" if engine.kernels is not None else "no",
        )
        return StepCostModel(points, per_context_token)


def time_pass(engine: CostProbe, tokens: int, rows: int, cached: int = 1) -> float:
    """Seconds one decode-shaped pass of ``tokens`` spread over ``rows`` slots takes, each row
    reading ``cached`` columns."""
    return _best_time(engine, 1, _spread(tokens, rows, cached=cached), [], list(range(tokens)))


def _spread(tokens: int, slots: int, cached: int) -> list[tuple[int, list[int]]]:
    """Decode rows carrying ``tokens`` between them, as evenly as ``slots`` allow: (10, 4) -> widths 3, 3, 2, 2."""
    rows = min(tokens, slots)
    return [(cached, [0] * (tokens // rows + (row < tokens % rows))) for row in range(rows)]


def _best_time(engine: CostProbe, repeats: int, decode_rows, segments, keep) -> float:
    cuda = engine.device.type == "cuda"
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine.run_pass(decode_rows, segments, keep)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


class StepCostModel:
    """Seconds per forward pass: ``tokens`` fed, plus ``context`` cached tokens read by attention.

    cost = g(tokens) + per_context_token * context, with g piecewise linear
    through measured points and extrapolated past them, and the context term
    measured once (attention reads the cache: a step over 16 sequences of 700
    tokens spends ~100 ms of a CPU's ~300 there). ``observe`` folds real step
    times into the points around the step's token count, so a start-up
    calibration follows the machine.

    ``cheapest(tokens)`` is the cost of the cheapest measured count at or
    above ``tokens``: CPU GEMMs can be slower at 2 or 3 rows than at 4, and
    padding a step up to such a count is then free. Nothing here assumes
    which counts those are; they are measured.
    """

    # Weight of a new step time against a point's running value.
    OBSERVE_WEIGHT = 0.1
    # Pad to a cheaper count only when it saves at least this fraction...
    PAD_MARGIN = 0.05
    # ...and adds at most this many tokens (beyond it, costs grow with tokens anyway).
    PAD_LIMIT = 8

    def __init__(self, points: dict[int, float], per_context_token: float = 0.0) -> None:
        if not points or any(tokens < 1 or seconds <= 0 for tokens, seconds in points.items()):
            raise ValueError(f"need at least one (tokens >= 1, seconds > 0) point, got {points}")
        self.tokens = sorted(points)
        self.seconds = [points[tokens] for tokens in self.tokens]
        self.per_context_token = per_context_token

    @classmethod
    def linear(cls, fixed_s: float, per_token_s: float) -> StepCostModel:
        return cls({1: fixed_s + per_token_s, 1024: fixed_s + 1024 * per_token_s})

    def points(self) -> dict[int, float]:
        return dict(zip(self.tokens, self.seconds))

    def cost(self, tokens: int, context: int = 0) -> float:
        return self._g(tokens) + self.per_context_token * context

    def _g(self, tokens: int) -> float:
        index = bisect.bisect_left(self.tokens, tokens)
        if index < len(self.tokens) and self.tokens[index] == tokens:
            return self.seconds[index]
        if len(self.tokens) == 1:
            return self.seconds[0] * max(1.0, tokens / self.tokens[0])
        low = min(max(index - 1, 0), len(self.tokens) - 2)  # extrapolate with the nearest segment
        t0, t1, s0, s1 = self.tokens[low], self.tokens[low + 1], self.seconds[low], self.seconds[low + 1]
        return max(s0 + (s1 - s0) * (tokens - t0) / (t1 - t0), 1e-6)

    def cheapest(self, tokens: int, context: int = 0) -> float:
        """The cost of a step of ``tokens``, padded to a measured count where that is cheaper."""
        return self.cost(tokens + self.padding(tokens), context)

    def padding(self, tokens: int) -> int:
        """Tokens to add so the step runs at a measurably cheaper count (0: none).

        Points {1: 1.0, 2: 1.6, 3: 1.7, 4: 1.3}: padding(2) -> 2, padding(1) -> 0.
        """
        best, best_cost = tokens, self._g(tokens) * (1 - self.PAD_MARGIN)
        start = bisect.bisect_right(self.tokens, tokens)
        for index in range(start, len(self.tokens)):
            if self.tokens[index] > tokens + self.PAD_LIMIT:
                break
            if self.seconds[index] < best_cost:
                best, best_cost = self.tokens[index], self.seconds[index]
        return best - tokens

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A real step: move the points around ``tokens`` towards its time less the context term."""
        compute = max(seconds - self.per_context_token * context, 1e-6)
        index = bisect.bisect_left(self.tokens, tokens)
        if index < len(self.tokens) and self.tokens[index] == tokens:
            neighbours = [(index, 1.0)]
        elif 0 < index < len(self.tokens):  # between two points: each moves by its share
            t0, t1 = self.tokens[index - 1], self.tokens[index]
            share = (tokens - t0) / (t1 - t0)
            neighbours = [(index - 1, 1.0 - share), (index, share)]
        else:
            return  # outside the measured range: extrapolation stays as calibrated
        error = compute - self._g(tokens)
        for point, share in neighbours:
            self.seconds[point] = max(self.seconds[point] + self.OBSERVE_WEIGHT * share * error, 1e-6)


class KeptStepCostModel(StepCostModel):
    """A ``StepCostModel`` kept in a ``CalibrationFile``: real steps refine it in this process
    as any, and lower the file's costs when, over many steps, the machine shows itself faster
    than stored (``StoredCalibration.lowered`` by each count's low quantile). Busy steps never reach the
    file: they only raise quantiles, which lower nothing."""

    def __init__(self, stored: StoredCalibration, file: CalibrationFile) -> None:
        super().__init__(stored.points, stored.per_context_token)
        self.stored = stored  # what the file holds
        self._stored_cost = StepCostModel(stored.points, stored.per_context_token)
        self.file = file
        self._ratios: dict[int, deque[float]] = {}  # tokens -> recent step seconds / stored cost
        self._steps = 0

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        super().observe(tokens, context, seconds)
        if tokens > max(self.stored.points):
            return  # priced by extrapolation: no evidence about a stored point
        ratio = seconds / self._stored_cost.cost(tokens, context)
        self._ratios.setdefault(tokens, deque(maxlen=STEP_WINDOW)).append(ratio)
        self._steps += 1
        if self._steps % CHECK_EVERY == 0:
            self.write_back()

    def write_back(self) -> bool:
        """Lower the file's costs by what the recent real steps robustly show (``StoredCalibration.lowered``);
        whether they did."""
        quantiles = {tokens: low_quantile(ratios, STEP_QUANTILE) for tokens, ratios in self._ratios.items() if len(ratios) >= STEP_SAMPLES}
        lowered = self.stored.lowered(quantiles)
        if lowered is None:
            return False
        self.stored = lowered
        self._stored_cost = StepCostModel(lowered.points, lowered.per_context_token)
        self._ratios.clear()  # they were ratios to the costs just replaced
        if self.file.write(lowered):
            log.info("stored step cost %s lowered from real steps (low quantiles: %s)", self.file.path, quantiles)
        return True


def low_quantile(values: Sequence[float], quantile: float) -> float:
    """The value ``quantile`` of the way up ``values`` sorted (nearest rank, from below).

    ([5, 1, 4, 2, 3], 0.25) -> 2 (index 1 of [1, 2, 3, 4, 5]); (..., 0.0) -> 1.
    """
    ordered = sorted(values)
    return ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]
