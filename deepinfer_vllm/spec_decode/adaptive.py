"""Confidence-scheduled verification: how many drafts each request verifies (docs/architecture.md,
"Adaptive verification"; docs/design-notes.md, "Adaptive verification").

Each request's slot ``i`` has an acceptance probability ``c_i`` (the confidence head, or the
online estimator below when the checkpoint has none). Survivals ``S_i = prod_{j<=i} c_j``
are non-increasing along a request. The step's draft budget ``B`` maximises

    (num_requests + sum of the B largest survivals) / (draft_cost(num_requests) + verify_cost(num_requests + B))

and the ``B`` slots with the largest survivals are verified; ties go to the lower request
row, then the lower slot, so every request verifies a prefix of its drafts.

Costs come from a table profiled at start-up (median step times of the target forward per
token count; the draft step per request count) and are refreshed online with the median of
the latest measurements of each size; sizes between table entries are interpolated linearly,
beyond the last one extrapolated from the last two.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque

import torch

__all__ = ["CostTable", "OnlineAcceptance", "choose_draft_counts", "survivals"]


def survivals(confidences: torch.Tensor) -> torch.Tensor:
    """``S[r, i] = prod_{j<=i} c[r, j]`` in fp64."""
    return torch.cumprod(confidences.double().clamp(0.0, 1.0), dim=1)


def choose_draft_counts(
    surv: torch.Tensor, verify_cost, draft_cost: float
) -> tuple[list[int], int]:
    """Per-request numbers of drafts to verify, and the budget ``B`` (their sum).

    ``surv``: ``[R, k]`` survivals; ``verify_cost(n)``: seconds of a target step over ``n``
    tokens; ``draft_cost``: seconds of the draft step for these ``R`` requests.
    """
    R, k = surv.shape
    if R == 0:
        return [], 0
    flat = surv.reshape(-1)
    # Stable descending order: ties keep the (row, slot) order.
    order = torch.sort(-flat, stable=True).indices
    gains = flat[order]
    best_b, best_rate = 0, R / (draft_cost + verify_cost(R))
    expected = float(R)
    for b in range(1, R * k + 1):
        expected += float(gains[b - 1])
        rate = expected / (draft_cost + verify_cost(R + b))
        if rate > best_rate:
            best_b, best_rate = b, rate
    counts = [0] * R
    for idx in order[:best_b].tolist():
        counts[idx // k] += 1
    return counts, best_b


class CostTable:
    """Median seconds per size, from a start-up profile and online measurements."""

    def __init__(self, window: int = 9):
        self._samples: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))

    def observe(self, size: int, seconds: float) -> None:
        self._samples[int(size)].append(float(seconds))

    def __bool__(self) -> bool:
        return bool(self._samples)

    def table(self) -> list[tuple[int, float]]:
        return sorted((n, sorted(s)[len(s) // 2]) for n, s in self._samples.items() if s)

    def __call__(self, size: int) -> float:
        rows = self.table()
        if not rows:
            raise RuntimeError("cost table is empty")
        sizes = [n for n, _ in rows]
        if len(rows) == 1:
            return rows[0][1] * max(size, 1) / max(rows[0][0], 1)
        i = bisect.bisect_left(sizes, size)
        if i < len(rows) and sizes[i] == size:
            return rows[i][1]
        lo, hi = (i - 1, i) if 0 < i < len(rows) else ((0, 1) if i == 0 else (len(rows) - 2, len(rows) - 1))
        (n0, t0), (n1, t1) = rows[lo], rows[hi]
        return max(t0 + (t1 - t0) * (size - n0) / (n1 - n0), 1e-9)


class OnlineAcceptance:
    """Acceptance predictor for checkpoints without a confidence head (docs/architecture.md, "Adaptive verification").

    ``P(accept slot i) = sigmoid(omega * f + beta_i)`` with ``f = logit(max_v q_i(v))`` clamped to
    +-40, one shared slope (init 0.5) and per-slot intercepts (init -0.2), refitted every
    ``refit_every`` observations-steps by damped Newton (IRLS) with ridge 1e-3 and damping
    ``n / (n + 50)``. Labels: accepted slots 1, the first rejected slot 0.
    """

    def __init__(self, k: int, refit_every: int = 100, history: int = 5000):
        self.k = k
        self.theta = torch.tensor([0.5] + [-0.2] * k, dtype=torch.float64)
        self.refit_every = refit_every
        self._obs: deque = deque(maxlen=history)
        self._steps = 0

    @staticmethod
    def feature(max_prob: torch.Tensor) -> torch.Tensor:
        p = max_prob.double().clamp(1e-300, 1.0)
        return (torch.log(p) - torch.log1p(-p.clamp(max=1.0 - 1e-16))).clamp(-40.0, 40.0)

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """``[R, k]`` features -> acceptance probabilities."""
        k = features.shape[1]
        return torch.sigmoid(self.theta[0] * features.double() + self.theta[1 : 1 + k])

    def observe(self, features: list[float], slots: list[int], labels: list[int]) -> None:
        for f, i, y in zip(features, slots, labels):
            self._obs.append((f, i, y))
        self._steps += 1
        if self._steps % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        n = len(self._obs)
        if n == 0:
            return
        f = torch.tensor([o[0] for o in self._obs], dtype=torch.float64)
        slot = torch.tensor([o[1] for o in self._obs])
        y = torch.tensor([o[2] for o in self._obs], dtype=torch.float64)
        X = torch.zeros(n, 1 + self.k, dtype=torch.float64)
        X[:, 0] = f
        X[torch.arange(n), 1 + slot] = 1.0
        p = torch.sigmoid(X @ self.theta)
        w = p * (1 - p)
        ridge = 1e-3
        H = X.t() @ (X * w.unsqueeze(1)) + ridge * torch.eye(1 + self.k, dtype=torch.float64)
        g = X.t() @ (y - p) - ridge * self.theta
        step = torch.linalg.solve(H, g)
        if torch.isfinite(step).all():
            self.theta = self.theta + (n / (n + 50.0)) * step

