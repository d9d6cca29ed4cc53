"""The privacy account of a run with client-level differential privacy: ε after each
round for the run's δ, and how many rounds a target ε allows.

Each round releases the shared block's aggregate with Gaussian noise of standard
deviation σ·C on the sum of the clipped client updates (noise multiplier σ), over a
sample of the clients. The account is Google's ``dp_accounting`` RDP accountant: a
Gaussian event per round, Poisson-sampled with q = ``fraction-train`` when q < 1 (the
sampler draws a fixed count each round; Poisson sampling at the same rate is the
standard approximation), composed over the rounds. Every round counts, a failed one
too (no aggregate is released then, so the account is conservative). The account
is a function of the round number and the run's settings, which a checkpoint fixes,
so a resumed run continues it.
"""

from __future__ import annotations

import functools
import math

ORDERS = tuple(range(2, 257))  # integer Rényi orders (fractional ones only add warnings)


@functools.lru_cache(maxsize=4096)
def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` rounds (``inf`` without noise, 0 before the first round)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    import dp_accounting  # the server's side only

    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        event = dp_accounting.PoissonSampledDpEvent(sample_rate, event)
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    accountant.compose(event, int(rounds))
    return float(accountant.get_epsilon(delta))


def rounds_within(target: float, noise_multiplier: float, sample_rate: float,
                  delta: float, limit: int) -> int:
    """The most rounds (at most ``limit``) whose ε stays at or below ``target``."""
    if epsilon(noise_multiplier, sample_rate, limit, delta) <= target:
        return limit
    low, high = 0, limit  # epsilon(low) <= target < epsilon(high)
    while high - low > 1:
        middle = (low + high) // 2
        if epsilon(noise_multiplier, sample_rate, middle, delta) <= target:
            low = middle
        else:
            high = middle
    return low
