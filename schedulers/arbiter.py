"""Which workload gets the device's lanes: LLM steps or vision batches. Pure Python.

A device has `lanes` that can run at once: the cores of a CPU, or 1 on a GPU, where work
takes turns. A vision batch runs on one lane (a single-threaded worker per core on a CPU);
an LLM step runs on the loop thread.

  1. Vision workers serve due batches on their own, on up to `vision_lanes()` lanes: on a
     multi-lane device every lane, so a frame never waits for an LLM step to end; on one
     lane only while the LLM is idle.
  2. The LLM steps whenever it has work, side by side with vision on a multi-lane device
     (the Runtime gives the step every core; a vision batch running beside it shares a core
     with one of its threads, which measured cheaper than re-sizing the LLM's thread pool
     from step to step: see runtime/runtime.py), and on one lane (a GPU) while vision does
     not hold the lane. Except:
  3. a due vision batch that one more LLM step first would make miss its deadline,
         deadline - now - cost(batch) < cost(next LLM step),
     holds the LLM step (VISION): on one lane the batch runs in between, on several the
     vision workers get the cores to themselves until it has run. Unless vision has already
     held the LLM off for `max_vision_share` of the recent time (decayed over
     `share_window_s`): LLM steps are never starved. Requests without a deadline count as
     due `vision_target_latency_ms` after arrival, so vision is not starved either.

Costs come from `LinearCost` models: an LLM step costs a + b*requests + c*tokens (one model
per lane count it ran on), a vision batch a + b*batch_size. They start from the Runtime's
start-up profile and follow what the device really does through `record()` (exponentially
weighted least squares), so a machine that slows down is seen within a few dozen turns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLM = "llm"
VISION = "vision"
WAIT = "wait"


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass(slots=True)
class ArbiterConfig:
    max_vision_share: float = 0.5  # of recent busy time, while the LLM has work; in (0, 1]
    share_window_s: float = 2.0  # time constant of the busy-time decay
    vision_target_latency_ms: float = 100.0  # the deadline of a vision request that set none

    def __post_init__(self) -> None:
        if isinstance(self.max_vision_share, bool) or not 0 < self.max_vision_share <= 1:
            raise ValueError(f"max_vision_share must be in (0, 1], got {self.max_vision_share!r}")
        _check_positive("share_window_s", self.share_window_s)
        _check_positive("vision_target_latency_ms", self.vision_target_latency_ms)


@dataclass(slots=True)
class LLMState:
    """What the loop knows of the LLM before planning its next step."""

    ready: bool
    num_reqs: int = 0  # requests the next step would hold
    num_tokens: int = 0  # tokens it would compute (one per decode, plus prefill chunks)


@dataclass(slots=True)
class VisionState:
    """The vision queue as the loop sees it."""

    due_size: int  # requests a batch released now would hold (0: none due)
    oldest_deadline: float | None = None  # earliest effective deadline among queued requests
    next_due_s: float | None = None  # seconds until a batch falls due; None: queue empty


@dataclass(slots=True)
class Turn:
    kind: str  # LLM, VISION or WAIT
    reason: str
    wait_s: float | None = None  # for WAIT: how long at most (None: until woken)
    lanes: int = 0  # for LLM: how many lanes (threads) the step gets


class LinearCost:
    """seconds = w . (1, *features), fitted by exponentially weighted least squares.

    `decay` < 1 forgets old samples (weight decay**age), so the model tracks the device.
    Until it has seen as many distinct samples as it has weights, `predict` falls back to
    the mean cost seen so far (or `default_s`)."""

    def __init__(self, num_features: int, decay: float = 0.97, default_s: float = 0.0) -> None:
        self.k = num_features + 1
        self.decay = decay
        self.default_s = default_s
        self._xx = [[0.0] * self.k for _ in range(self.k)]
        self._xy = [0.0] * self.k
        self._weights: list[float] | None = None
        self._sum_y = 0.0
        self._n = 0.0

    def observe(self, features: tuple[float, ...], seconds: float) -> None:
        x = (1.0, *map(float, features))
        d = self.decay
        for i in range(self.k):
            row = self._xx[i]
            for j in range(self.k):
                row[j] = row[j] * d + x[i] * x[j]
            self._xy[i] = self._xy[i] * d + x[i] * seconds
        self._sum_y = self._sum_y * d + seconds
        self._n = self._n * d + 1.0
        self._weights = None

    def predict(self, features: tuple[float, ...]) -> float:
        if self._n == 0:
            return self.default_s
        w = self._weights or self._solve()
        if w is None:
            return self._sum_y / self._n
        y = w[0] + sum(wi * float(f) for wi, f in zip(w[1:], features))
        # A fit may extrapolate below zero at the edges; a step always costs something.
        return max(y, 0.1 * self._sum_y / self._n)

    def _solve(self) -> list[float] | None:
        """Solve (X'X + ridge) w = X'y by Gaussian elimination; None if singular."""
        k = self.k
        ridge = 1e-9 * max(1.0, self._xx[0][0])
        a = [[self._xx[i][j] + (ridge if i == j else 0.0) for j in range(k)] + [self._xy[i]] for i in range(k)]
        for col in range(k):
            pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-12:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(k):
                if r != col:
                    f = a[r][col] / a[col][col]
                    for c in range(col, k + 1):
                        a[r][c] -= f * a[col][c]
        self._weights = [a[i][k] / a[i][i] for i in range(k)]
        return self._weights


class Arbiter:
    def __init__(self, config: ArbiterConfig | None = None, lanes: int = 1) -> None:
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be an integer >= 1, got {lanes!r}")
        self.config = config or ArbiterConfig()
        self.lanes = lanes
        self.llm_costs: dict[int, LinearCost] = {}  # by lanes (threads) the step ran with
        self.vision_cost = LinearCost(1, default_s=0.05)
        self._busy = {LLM: 0.0, VISION: 0.0}
        self._busy_at = 0.0  # the time the decayed busy totals refer to
        self.counts = {LLM: 0, VISION: 0}
        self.reasons: dict[str, int] = {}

    def llm_cost(self, lanes: int) -> LinearCost:
        model = self.llm_costs.get(lanes)
        if model is None:
            model = self.llm_costs[lanes] = LinearCost(2, default_s=0.05)
        return model

    def predict_llm(self, s: LLMState, lanes: int) -> float:
        model = self.llm_costs.get(lanes)
        if model is None or model._n == 0:  # never ran with these lanes: scale the nearest model
            known = [k for k, m in self.llm_costs.items() if m._n > 0]
            if not known:
                return LinearCost(2, default_s=0.05).predict(())
            nearest = min(known, key=lambda k: abs(k - lanes))
            return self.llm_costs[nearest].predict((s.num_reqs, s.num_tokens)) * nearest / lanes
        return model.predict((s.num_reqs, s.num_tokens))

    def predict_vision(self, batch_size: int) -> float:
        return self.vision_cost.predict((batch_size,))

    def vision_share(self, now: float) -> float:
        """The recent share of time in which vision held every lane while the LLM waited."""
        self._decay_to(now)
        total = self._busy[LLM] + self._busy[VISION]
        return self._busy[VISION] / total if total > 0 else 0.0

    def vision_lanes(self, llm_ready: bool) -> int:
        """Lanes vision workers may fill on their own (rule 1)."""
        return self.lanes if self.lanes > 1 or not llm_ready else 0

    def choose(self, now: float, llm: LLMState | None, vision: VisionState | None, busy_lanes: int = 0) -> Turn:
        """The loop's choice (rules 2 and 3). busy_lanes: lanes running vision batches now.
        VISION: hold the LLM step until the due batch has a lane and has run."""
        llm_ready = llm is not None and llm.ready
        if not llm_ready:
            return Turn(WAIT, "nothing for the LLM")  # vision serves itself (rule 1)
        if self.lanes == 1 and busy_lanes:
            return Turn(WAIT, "vision holds the lane")
        if vision is not None and vision.due_size > 0:
            deadline = vision.oldest_deadline
            urgent = deadline is not None and (
                deadline - now - self.predict_vision(vision.due_size) < self.predict_llm(llm, self.lanes)
            )
            if urgent and self.vision_share(now) < self.config.max_vision_share:
                return self._turn(VISION, "vision deadline")
            if urgent:
                self.reasons["vision used its share"] = self.reasons.get("vision used its share", 0) + 1
        return self._turn(LLM, "LLM step", lanes=self.lanes)

    def record(self, kind: str, start: float, end: float, features: tuple[float, ...], lanes: int = 1) -> None:
        """One LLM step (features (requests, tokens), on `lanes` threads) or one vision batch
        (features (batch size,)) ran from start to end. An LLM step counts as busy time."""
        if kind == LLM:
            self.add_busy(LLM, start, end)
            self.llm_cost(lanes).observe(features, end - start)
        else:
            self.vision_cost.observe(features, end - start)

    def add_busy(self, kind: str, start: float, end: float) -> None:
        """Wall time of an LLM step, or time in which vision held the LLM's last lane."""
        self._decay_to(end)
        self._busy[kind] += end - start

    def _decay_to(self, now: float) -> None:
        if now > self._busy_at:
            f = math.exp(-(now - self._busy_at) / self.config.share_window_s)
            self._busy[LLM] *= f
            self._busy[VISION] *= f
            self._busy_at = now

    def _turn(self, kind: str, reason: str, lanes: int = 0) -> Turn:
        self.counts[kind] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return Turn(kind, reason, lanes=lanes)
