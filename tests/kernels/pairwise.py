"""All-pairs covering sets for kernel-test parametrizations.

Under TRITON_INTERPRET every case costs interpreter time, so a test over several independent
parameters takes a pairwise covering set instead of their full product: every value of every
parameter, and every pair of values of any two parameters, occurs in at least one case.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def pairwise(*axes: Sequence) -> list[tuple]:
    """Cases (one value per axis, in axis order) covering every pair of values of any two axes.

    Greedy and deterministic: from the full product, in order, repeatedly take the case that
    covers the most pairs not yet covered (the first such case on ties) until none is left.
    """
    if len(axes) < 2:
        return [tuple(c) for c in itertools.product(*axes)]
    product = list(itertools.product(*axes))
    idx_product = list(itertools.product(*(range(len(a)) for a in axes)))
    uncovered = {(i, vi, j, vj) for i, j in itertools.combinations(range(len(axes)), 2)
                 for vi in range(len(axes[i])) for vj in range(len(axes[j]))}
    cases: list[tuple] = []
    while uncovered:
        best, best_gain = 0, -1
        for k, c in enumerate(idx_product):
            gain = sum((i, c[i], j, c[j]) in uncovered for i, j in itertools.combinations(range(len(c)), 2))
            if gain > best_gain:
                best, best_gain = k, gain
        c = idx_product[best]
        uncovered -= {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}
        cases.append(product[best])
    return cases


def case_id(case: tuple) -> str:
    """A readable pytest id: torch dtypes without their ``torch.`` prefix, values joined by '-'."""
    return "-".join(str(v).removeprefix("torch.") for v in case)
