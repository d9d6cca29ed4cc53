"""Lying clients, for tests and experiments on robust aggregation (not a method).

With run-config ``attack`` set, the clients of partitions ``0 … attack-clients − 1``
train honestly (their own state stays what honest training gives) and then rewrite
what they send: a finite, plausible reply that keeps their true train loss, so the
reply checks and the divergence guard let it through.

* ``scale``: theta_s + s * Delta theta (s = ``attack-scale``; -5 or 50, say);
* ``sign-flip``: theta_s - Delta theta;
* ``noise``: theta_s + Gaussian noise with the norm of Delta theta;
* ``small-steps``: the honest parameters, reporting one shared step: FedSPC's
  reference change -u_bar - Delta theta / (E eta) is then E times too large;
* ``bias``: theta_s + Delta theta + s * d, d one unit direction that stays the same
  every round (drawn from ``seed`` and the partition id): a lie of norm s, small
  beside the update if s is, that always leans the same way.

Only the shared trainable parameters are rewritten (buffers such as BatchNorm
statistics travel as trained).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedspc_app.core.config import RunConfig
from fedspc_app.core.correction import reference_change, shared_update
from fedspc_app.core.protocol import SHARED_STEPS
from fedspc_app.core.records import ArrayDict


def is_attacker(config: RunConfig, partition_id: int) -> bool:
    return config.attack != "none" and partition_id < config.attack_clients


def attacked_reply(config: RunConfig, partition_id: int, server_round: int,
                   received: Mapping[str, np.ndarray], shared: ArrayDict,
                   metrics: dict, keys: Sequence[str]) -> tuple[ArrayDict, dict]:
    """The shared arrays and metrics an attacking client sends instead of ``shared``
    and ``metrics`` (its honest ones); ``keys``: the shared trainable parameters."""
    update = shared_update(shared, received, keys)
    out = dict(shared)
    metrics = dict(metrics)
    if config.attack == "small-steps":
        metrics[SHARED_STEPS] = 1
        return out, metrics
    if config.attack == "noise":
        rng = np.random.default_rng([config.seed, partition_id, server_round])
        noise = {k: rng.standard_normal(update[k].shape) for k in keys}
        norm = np.sqrt(sum(float(np.sum(update[k].astype(np.float64) ** 2)) for k in keys))
        noise_norm = np.sqrt(sum(float(np.sum(v ** 2)) for v in noise.values())) or 1.0
        lie = {k: noise[k] * (norm / noise_norm) for k in keys}
    elif config.attack == "bias":
        lie = biased(update, keys, config.attack_scale,
                     np.random.default_rng([config.seed, partition_id]))
    else:
        factor = -1.0 if config.attack == "sign-flip" else config.attack_scale
        lie = {k: update[k].astype(np.float64) * factor for k in keys}
    for key in keys:
        out[key] = (received[key].astype(np.float64) + lie[key]).astype(shared[key].dtype)
    return out, metrics


def biased(update: ArrayDict, keys: Sequence[str], scale: float,
           rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``update + scale * d`` over ``keys`` (float64), d a unit direction drawn from
    ``rng`` (the same generator state gives the same d every round)."""
    direction = {k: rng.standard_normal(update[k].shape) for k in keys}
    length = np.sqrt(sum(float(np.sum(v ** 2)) for v in direction.values())) or 1.0
    return {k: update[k].astype(np.float64) + direction[k] * (scale / length)
            for k in keys}


def attacked_reference_change(config: RunConfig, received: Mapping[str, np.ndarray],
                              shared: ArrayDict, global_reference: Mapping[str, np.ndarray],
                              steps: int) -> ArrayDict:
    """The reference change an attacker uploads (``fedspc-upload = "explicit"``): the
    one its sent arrays and reported steps imply, as the server would derive it."""
    update = shared_update(shared, received, global_reference.keys())
    return reference_change(update, global_reference, steps=steps,
                            learning_rate=config.learning_rate)
