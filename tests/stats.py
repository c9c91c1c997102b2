"""Statistics the sampling tests share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def two_sample_p(a: Mapping[Any, int], b: Mapping[Any, int], pool_below: int = 10) -> float:
    """Two-sample chi-square p-value of two count tables (category -> count); categories with
    fewer than ``pool_below`` samples in both together are pooled into one cell (dropped when
    that cell is smaller still), so no expected count is tiny."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= pool_below]
    rows = [[a.get(k, 0) for k in big], [b.get(k, 0) for k in big]]
    rest = [sum(a.values()) - sum(rows[0]), sum(b.values()) - sum(rows[1])]
    if sum(rest) >= pool_below:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    return float(chi2_contingency(rows)[1])
