"""Non-negative least squares on a few columns, exact: the fits of measured costs (the
engine's step time, `kv/step_time.py`; an instance's prefill, decode and delivery profile,
`disagg/costs.py`) have three to five terms that are each a cost, never negative, and the
observations arrive one at a time. Pure: no I/O, no clock. Nothing raises: a system that cannot
be solved (too few or dependent observations) answers None.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], ys: Sequence[float]
) -> list[float] | None:
    """The c >= 0 minimizing sum((row . c - y)^2), unweighted; None where no subset of the
    columns can be solved."""
    eq = NormalEquations(len(rows[0]))
    for row, y in zip(rows, ys, strict=True):
        eq.add(tuple(row), y, weight=1.0)
    c = eq.solve_nonnegative()
    return None if c is None else list(c)


class NormalEquations:
    """Weighted least squares as sums over the observations: the c minimizing
    sum((w (x . c - y))^2) solves A c = b with A = sum(w^2 x x') and b = sum(w^2 y x)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.a = [[0.0] * n for _ in range(n)]
        self.b = [0.0] * n

    def add(
        self, x: tuple[float, ...], y: float, sign: float = 1.0, weight: float | None = None
    ) -> None:
        """Add (sign -1: drop) the observation x -> y, its residual weighted by `weight`
        (default 1 / y: relative error)."""
        w = 1.0 / y if weight is None else weight
        for i in range(self.n):
            self.b[i] += sign * x[i] * w * w * y
            wi = sign * x[i] * w * w
            row = self.a[i]
            for j in range(self.n):
                row[j] += wi * x[j]

    def solve_nonnegative(self, hint: tuple[float, ...] | None = None) -> tuple[float, ...] | None:
        """The c >= 0 minimizing the sum. `hint`: the last answer, whose support (non-zero
        terms) is tried first and kept where it still meets the optimality conditions (the
        usual case, one small solve per step). Else every support set is tried: few
        features, so that is an exact active-set answer. None when nothing can be solved."""
        n = self.n
        supports = [tuple(i for i in range(n) if hint[i] > 0)] if hint is not None else []
        for support in supports + [tuple(range(n))]:
            c = self._on(support)
            if c is not None and self._optimal(c, support):
                return c
        best: tuple[float, tuple[float, ...]] | None = None
        for size in range(1, n):
            for support in itertools.combinations(range(n), size):
                c = self._on(support)
                if c is None:
                    continue
                # The objective up to a constant: c'Ac - 2 b'c.
                obj = sum(c[i] * self.a[i][j] * c[j] for i in range(n) for j in range(n))
                obj -= 2 * sum(ci * bi for ci, bi in zip(c, self.b, strict=True))
                if best is None or obj < best[0]:
                    best = (obj, c)
        return None if best is None else best[1]

    def _on(self, support: tuple[int, ...]) -> tuple[float, ...] | None:
        """The unconstrained optimum with only `support`'s terms; None if singular or any
        term would be negative."""
        if not support:
            return None
        a, b = self.a, self.b
        sub = _solve([[a[i][j] for j in support] for i in support], [b[i] for i in support])
        if sub is None or min(sub) < 0:
            return None
        c = [0.0] * self.n
        for i, v in zip(support, sub, strict=True):
            c[i] = v
        return tuple(c)

    def _optimal(self, c: tuple[float, ...], support: tuple[int, ...]) -> bool:
        """The optimality conditions of the terms held at zero: raising one must not help."""
        for i in range(self.n):
            if i not in support:
                grad = sum(self.a[i][j] * c[j] for j in range(self.n)) - self.b[i]
                if grad < -1e-12 * (abs(self.b[i]) or 1.0):
                    return False
        return True


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if (nearly) singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out
