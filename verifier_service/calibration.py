"""What a forward pass costs on this machine: ``StepCostModel``, and measuring it at start-up.

The engine prices every step with a ``StepCostModel`` (the planner weighs
draft tokens against it, padding picks cheaper token counts from it, and
each real step refines it). ``calibrate_step_cost`` measures one on the real
device, once per model object (``calibrated_step_cost``); tests and benches
hand the engine a model of their own instead.

A calibration takes tens of seconds (minutes on a busy machine), so the
service keeps it in a folder (``load_or_calibrate``), keyed by what decides
the costs: the model's shape and dtype, the device, the CPU, the thread
count, torch's version and the cache's shape. A later start times a short
probe and keeps the stored model only when the probe agrees with it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verifier_service.linear_kernels import MEASURED_UP_TO

if TYPE_CHECKING:
    from verifier_service.engine import SpeculativeEngine

log = logging.getLogger(__name__)

# Token counts whose forward-pass cost is measured at start-up: every count
# up to 16 (where CPU GEMM kernels change, so padding can pay), then a
# sparser grid up to a prefill chunk plus a batch of drafts.
CALIBRATION_TOKENS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128, 192, 256, 384)
# Counts up to here are timed twice (best of two): they decide padding.
CALIBRATION_REPEAT_BELOW = 64
# Cached tokens per slot when timing attention's reads of the cache.
CALIBRATION_COLUMNS = 1024

# A stored calibration's layout; a file of another is measured again.
STORED_FORMAT = 1
# Token counts the start-up probe times (best of PROBE_REPEATS each)...
PROBE_TOKENS = (1, 4, 16)
PROBE_REPEATS = 3
# ...and how far (as a factor, either way) each may be from the stored cost for
# it to stand: a machine busier or idler than at calibration differs by less,
# another machine or a changed setting (threads, power) by more.
PROBE_TOLERANCE = 2.0

_calibrations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibrated_step_cost(engine: SpeculativeEngine, folder: Path | None = None) -> StepCostModel:
    """The step-cost model of ``engine``'s model on this machine, measured once per model
    object (and kept in ``folder`` across processes, when given: ``load_or_calibrate``)."""
    cached = _calibrations.get(engine.model)
    if cached is None:
        cached = calibrate_step_cost(engine) if folder is None else load_or_calibrate(engine, folder)
        _calibrations[engine.model] = cached
    return cached


def calibration_key(engine: SpeculativeEngine) -> dict:
    """What decides the step costs: a stored calibration is reused only under the same."""
    model = engine.model
    return {
        "format": STORED_FORMAT,
        "model": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(next(model.parameters()).dtype),
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else str(engine.device),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "slots": len(engine._slots),
        "capacity": engine.cache.capacity,
        "tokens": list(CALIBRATION_TOKENS),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_or_calibrate(engine: SpeculativeEngine, folder: Path) -> StepCostModel:
    """The calibration stored in ``folder`` for this key when a short probe agrees with it
    (within ``PROBE_TOLERANCE``), else a new one, stored for the next start. A file that
    cannot be read or written costs a calibration, never the start."""
    key = calibration_key(engine)
    path = folder / f"step-cost-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    stored = _read_stored(path, key)
    if stored is not None:
        model, up_to = stored
        if engine.kernels is not None:
            engine.kernels.up_to = up_to
        disagreements = _probe(engine, model)
        if not disagreements:
            log.info("step cost from %s (the probe agrees within %gx)", path, PROBE_TOLERANCE)
            return model
        log.info("stored step cost %s is off (%s); calibrating again", path, "; ".join(disagreements))
    model = calibrate_step_cost(engine)
    record = {
        "key": key,
        "points": model.points(),
        "per_context_token": model.per_context_token,
        "up_to": engine.kernels.up_to if engine.kernels is not None else 0,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)  # whole or not at all, even beside another starting verifier
    except OSError as error:
        log.warning("could not store the step cost in %s (%s); the next start calibrates again", path, error)
    return model


def _read_stored(path: Path, key: dict) -> tuple[StepCostModel, int] | None:
    try:
        record = json.loads(path.read_text())
        if record["key"] != key:
            return None
        points = {int(count): float(seconds) for count, seconds in record["points"].items()}
        if not points or not all(seconds > 0 for seconds in points.values()):
            raise ValueError("no positive step times")
        return StepCostModel(points, float(record["per_context_token"])), int(record["up_to"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("stored step cost %s is unreadable (%s: %s); calibrating again", path, type(error).__name__, error)
        return None


def _probe(engine: SpeculativeEngine, model: StepCostModel) -> list[str]:
    """The probe counts whose time now is off the stored one by more than PROBE_TOLERANCE."""
    slots = len(engine._slots)
    off = []
    with torch.inference_mode():
        stored = model.points()
        for count in PROBE_TOKENS:
            if count not in stored:
                continue
            seconds = _best_time(engine, PROBE_REPEATS, _spread(count, slots, cached=1), [], list(range(count)))
            if not 1 / PROBE_TOLERANCE <= seconds / stored[count] <= PROBE_TOLERANCE:
                off.append(f"{count} tokens: {1000 * seconds:.1f} ms now, {1000 * stored[count]:.1f} ms stored")
    return off


def calibrate_step_cost(engine: SpeculativeEngine, tokens: Sequence[int] = CALIBRATION_TOKENS) -> StepCostModel:
    """Seconds per packed forward pass at each token count, and per cached token read, on the real device.

    Each pass is decode-shaped, as the steps it prices: the tokens spread
    over as many slots as there are (up to one each), over one cached
    column, then over ``CALIBRATION_COLUMNS`` for the cache-read term. The
    slots hold zeros; no sequence is touched.
    """
    limit = min(engine.cache.capacity, engine.context_length) - 1
    slots = len(engine._slots)
    points, forms = {}, {}
    with torch.inference_mode():
        for count in tokens:
            if count > limit * slots:
                break
            repeats = 2 if count < CALIBRATION_REPEAT_BELOW else 1
            rows = _spread(count, slots, cached=1)
            if engine.kernels is None or count > MEASURED_UP_TO:
                points[count] = _best_time(engine, repeats, rows, [], list(range(count)))
                continue
            # Both forms of the linear layers (see linear_kernels), the faster kept.
            timed = {}
            for form in (False, True):
                with engine.kernels.forcing(form):
                    timed[form] = _best_time(engine, repeats, rows, [], list(range(count)))
            forms[count] = (timed[False], timed[True])
        if engine.kernels is not None:
            engine.kernels.choose(forms)
            for count, (linear, transposed) in forms.items():  # the step costs under the forms chosen
                points[count] = transposed if engine.kernels.transposed(count) else linear
        # The same steps over full slots, less their tokens' own cost: what attention's cache reads cost.
        count, columns = min(2 * slots, max(points)), min(limit - 2, CALIBRATION_COLUMNS)
        per_context_token = 0.0
        if count in points and columns >= 64:
            rows = _spread(count, slots, cached=columns)
            seconds = _best_time(engine, 2, rows, [], list(range(count)))
            per_context_token = max(0.0, (seconds - points[count]) / (len(rows) * columns))
    log.info(
        "step cost (tokens -> ms): %s; %.2f us per cached token read; linear layers as W @ x^T %s tokens",
        {k: round(1000 * v, 1) for k, v in points.items()},
        1e6 * per_context_token,
        f"up to {engine.kernels.up_to}" if engine.kernels is not None else "no",
    )
    return StepCostModel(points, per_context_token)


def _spread(tokens: int, slots: int, cached: int) -> list[tuple[int, list[int]]]:
    """Decode rows carrying ``tokens`` between them, as evenly as ``slots`` allow: (10, 4) -> widths 3, 3, 2, 2."""
    rows = min(tokens, slots)
    return [(cached, [0] * (tokens // rows + (row < tokens % rows))) for row in range(rows)]


def _best_time(engine: SpeculativeEngine, repeats: int, decode_rows, segments, keep) -> float:
    cuda = engine.device.type == "cuda"
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine._forward(decode_rows, segments, keep)
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
