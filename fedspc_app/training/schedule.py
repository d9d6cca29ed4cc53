"""The clients' learning rate over rounds: ``lr-schedule = constant | exponential |
cosine | step``.

The server computes each round's η with PyTorch's own schedulers, stepped once per
round (``ExponentialLR`` with ``gamma = lr-decay``; ``CosineAnnealingLR`` over the run's
rounds down to ``lr-min``; ``StepLR`` with ``step_size = lr-step-rounds`` and
``gamma = lr-decay``), and sends it with the round's training messages, so every
client of a round trains with the same η and FedSPC, SCAFFOLD, FedProx and Ditto use
that η wherever Algorithm 1 or the method does. A resumed run continues the schedule:
η is a function of the round and the run-config.
"""

from __future__ import annotations

import functools

import torch

from fedspc_app.core.config import RunConfig

SCHEDULES = ("constant", "exponential", "cosine", "step")


def round_learning_rates(config: RunConfig) -> tuple[float, ...]:
    """η of rounds 1 … num-rounds (index round − 1)."""
    return _rates(config.lr_schedule, config.learning_rate, config.num_rounds,
                  config.lr_decay, config.lr_min, config.lr_step_rounds)


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
            optimizer, T_max=max(rounds - 1, 1), eta_min=minimum)
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
