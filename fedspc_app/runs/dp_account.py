"""The privacy account of a run with client-level differential privacy: ε after each
round for the run's δ, and how many rounds a target ε allows.

What is accounted is exactly what the server does (:mod:`strategies.personalized`,
:mod:`strategies.sampling`). Each round draws every training client independently
with probability q = ``fraction-train`` from the server's secret (Poisson sampling;
q = 1: every client, no amplification) and releases the sum of their clipped updates
with Gaussian noise of standard deviation σ·C (noise multiplier σ), divided by the
public q·K. Neighbouring federations differ by adding or removing one client (all of
its data); the sum then moves by at most C. So a round is dp_accounting's
``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` (a ``GaussianDpEvent`` at q = 1),
composed over the rounds, under ``ADD_OR_REMOVE_ONE``, by the RDP accountant (the
default) or the PLD accountant (tighter). Every round counts, a failed one too (it
releases nothing, so the account is conservative there). The account is a function of
the round number and the run's settings, which a checkpoint fixes, so a resumed run
continues it.
"""

from __future__ import annotations

import functools
import math

ORDERS = tuple(range(2, 257))  # integer Rényi orders (fractional ones only add warnings)
ACCOUNTANTS = ("rdp", "pld")
ADJACENCY = "add or remove one client (all of its data)"


def round_event(noise_multiplier: float, sample_rate: float):
    """One round as a dp_accounting event."""
    import dp_accounting  # the server's side only

    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        event = dp_accounting.PoissonSampledDpEvent(sample_rate, event)
    return event


def make_accountant(accountant: str):
    """dp_accounting's RDP or PLD accountant under add/remove-one adjacency."""
    import dp_accounting

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant(orders=list(ORDERS),
                                                neighboring_relation=relation)
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


@functools.lru_cache(maxsize=4096)
def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float,
            accountant: str = "rdp") -> float:
    """ε after ``rounds`` rounds (``inf`` without noise, 0 before the first round)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    account = make_accountant(accountant)
    account.compose(round_event(noise_multiplier, sample_rate), int(rounds))
    return float(account.get_epsilon(delta))


def rounds_within(target: float, noise_multiplier: float, sample_rate: float,
                  delta: float, limit: int, accountant: str = "rdp") -> int:
    """The most rounds (at most ``limit``) whose ε stays at or below ``target``."""

    def spent(rounds: int) -> float:
        return epsilon(noise_multiplier, sample_rate, rounds, delta, accountant)

    if spent(limit) <= target:
        return limit
    low, high = 0, limit  # spent(low) <= target < spent(high)
    while high - low > 1:
        middle = (low + high) // 2
        if spent(middle) <= target:
            low = middle
        else:
            high = middle
    return low
