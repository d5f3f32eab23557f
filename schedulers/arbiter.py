"""Which workload gets the device next: an LLM step or a vision batch. Pure Python, no model.

The Runtime's loop asks `choose()` at every turn and reports what ran with `record()`. The
policy, in order:

  1. Only one workload has work ready: it runs. Nothing ready: wait until the next vision
     batch falls due (or until something arrives).
  2. Both ready, and vision has taken `max_vision_share` or more of the recent busy time
     (decayed over `share_window_s`): the LLM step runs. LLM steps are never starved.
  3. Both ready: the vision batch runs now if one more LLM step first would make it miss its
     deadline, i.e. if  deadline - now - cost(vision batch) < cost(next LLM step).
     Requests without a deadline of their own count as due `vision_target_latency_ms` after
     arrival, so vision is never starved either.
  4. Otherwise the LLM step runs: the vision batch has slack, and waiting lets it grow.

Costs come from `LinearCost` models: an LLM step costs a + b*requests + c*tokens, a vision
batch a + b*batch_size. They start from the Runtime's start-up profile and follow
what the device really does through `record()` (exponentially weighted least squares), so a
machine that slows down under load is seen within a few dozen turns.
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
    def __init__(self, config: ArbiterConfig | None = None) -> None:
        self.config = config or ArbiterConfig()
        self.llm_cost = LinearCost(2, default_s=0.05)
        self.vision_cost = LinearCost(1, default_s=0.05)
        self._busy = {LLM: 0.0, VISION: 0.0}
        self._busy_at = 0.0  # the time the decayed busy totals refer to
        self.counts = {LLM: 0, VISION: 0}
        self.reasons: dict[str, int] = {}

    def predict_llm(self, s: LLMState) -> float:
        return self.llm_cost.predict((s.num_reqs, s.num_tokens))

    def predict_vision(self, batch_size: int) -> float:
        return self.vision_cost.predict((batch_size,))

    def vision_share(self, now: float) -> float:
        self._decay_to(now)
        total = self._busy[LLM] + self._busy[VISION]
        return self._busy[VISION] / total if total > 0 else 0.0

    def choose(self, now: float, llm: LLMState | None, vision: VisionState | None) -> Turn:
        llm_ready = llm is not None and llm.ready
        vision_due = vision is not None and vision.due_size > 0
        if not vision_due:
            if llm_ready:
                return self._turn(LLM, "only the LLM is ready")
            wait = None if vision is None else vision.next_due_s
            return Turn(WAIT, "nothing ready", wait)
        if not llm_ready:
            return self._turn(VISION, "only vision is ready")
        if self.vision_share(now) >= self.config.max_vision_share:
            return self._turn(LLM, "vision used its share")
        deadline = vision.oldest_deadline
        if deadline is not None:
            slack = deadline - now - self.predict_vision(vision.due_size)
            if slack < self.predict_llm(llm):
                return self._turn(VISION, "vision deadline")
        return self._turn(LLM, "vision has slack")

    def record(self, kind: str, start: float, end: float, features: tuple[float, ...]) -> None:
        """One LLM step or one vision batch ran from start to end; features are its cost
        features ((requests, tokens) or (batch size,)). Counts as busy time too."""
        self.add_busy(kind, start, end)
        (self.llm_cost if kind == LLM else self.vision_cost).observe(features, end - start)

    def add_busy(self, kind: str, start: float, end: float) -> None:
        """Wall time the device spent on `kind` (vision batches that ran side by side on
        several workers count once, as the interval they covered)."""
        self._decay_to(end)
        self._busy[kind] += end - start

    def _decay_to(self, now: float) -> None:
        if now > self._busy_at:
            f = math.exp(-(now - self._busy_at) / self.config.share_window_s)
            self._busy[LLM] *= f
            self._busy[VISION] *= f
            self._busy_at = now

    def _turn(self, kind: str, reason: str) -> Turn:
        self.counts[kind] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return Turn(kind, reason)
