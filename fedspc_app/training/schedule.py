"""The clients' learning rate over rounds: ``lr-schedule = constant | exponential |
cosine | step``.

The server computes each round's η with PyTorch's own schedulers, stepped once per
round (``ExponentialLR`` with ``gamma = lr-decay``; ``CosineAnnealingLR`` with ``T_max`` = the run's rounds, from η
towards ``lr-min``, which it would reach one round after the last, so the last round
still trains; ``StepLR`` with ``step_size = lr-step-rounds`` and
``gamma = lr-decay``), and sends it with the round's training messages, so every
client of a round trains with the same η and FedSPC, SCAFFOLD, FedProx and Ditto use
that η wherever Algorithm 1 or the method does. A resumed run continues the schedule:
η is a function of the round and the run-config.

Every round trains: a schedule whose η in some round is not a number that η and 1/η
are float32 numbers for (an exponential decay towards 0, say: FedSPC divides each
update by E·η) is refused with the round named, and a client refuses a round's η
that is not one, rather than train at another η than the server divides by.
"""

from __future__ import annotations

import functools

import torch

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.ranges import learning_rate_range_text, usable_learning_rate

SCHEDULES = ("constant", "exponential", "cosine", "step")


def round_learning_rates(config: RunConfig) -> tuple[float, ...]:
    """η of rounds 1 … num-rounds (index round − 1), each positive and finite."""
    rates = _rates(config.lr_schedule, config.learning_rate, config.num_rounds,
                  config.lr_decay, config.lr_min, config.lr_step_rounds)
    for server_round, rate in enumerate(rates, start=1):
        if not usable_learning_rate(rate):
            raise ConfigError(f"lr-schedule '{config.lr_schedule}' gives round {server_round} "
                              f"a learning rate of {rate!r}; every round that trains needs "
                              f"{learning_rate_range_text()} (raise lr-decay, lr-min or "
                              "learning-rate)")
    return rates


@functools.lru_cache(maxsize=64)
def _rates(schedule: str, base: float, rounds: int, decay: float, minimum: float,
           step_rounds: int) -> tuple[float, ...]:
    if schedule == "constant":
        return (float(base),) * rounds
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=base)
    if schedule == "exponential":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=decay)
    elif schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(rounds, 1), eta_min=minimum)
    elif schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_rounds,
                                                    gamma=decay)
    else:
        raise ValueError(f"lr-schedule must be one of {SCHEDULES}, got {schedule!r}")
    rates = []
    for _ in range(rounds):
        rates.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()  # (no gradient: a no-op; keeps the scheduler's order check quiet)
        scheduler.step()
    return tuple(rates)
