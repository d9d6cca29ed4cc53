"""Client-level differential privacy of the shared block: clipping one client's update
and the Gaussian noise of the aggregate (McMahan et al., 2018), with Flower's helpers.

Both sides clip with :func:`clip_update` (the client before it stages u_k, so that
u_k follows the update the server sees; or the server, for a trusted server), and the
server adds noise of standard deviation σ·C/m (Flower's ``compute_stdv``) to each
coordinate of the unweighted mean of m clipped updates. Only the shared trainable
parameters are clipped and noised: under differential privacy shared buffers
(BatchNorm statistics) stay with each client, as FedBN keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from flwr.supercore.differential_privacy import (
    compute_clip_model_update,
    compute_stdv,
    get_norm,
)

from fedspc_app.core.records import ArrayDict


def update_norm(final: Mapping[str, np.ndarray], initial: Mapping[str, np.ndarray],
                keys: Iterable[str]) -> float:
    """The L2 norm of ``final - initial`` over ``keys`` (Flower's ``get_norm``)."""
    return get_norm([np.subtract(final[k], initial[k], dtype=np.float64) for k in keys])


def clip_update(final: Mapping[str, np.ndarray], initial: Mapping[str, np.ndarray],
                keys: Iterable[str], clipping_norm: float) -> ArrayDict:
    """``final`` with its update from ``initial`` over ``keys`` scaled down to L2 norm at
    most ``clipping_norm`` (Flower's ``compute_clip_model_update``); an update within the
    norm leaves ``final`` exactly as it is."""
    keys = list(keys)
    out = dict(final)
    if not keys or update_norm(final, initial, keys) <= clipping_norm:
        return out
    clipped = [np.asarray(final[k]).copy() for k in keys]
    compute_clip_model_update(clipped, [np.asarray(initial[k]) for k in keys], clipping_norm)
    for key, value in zip(keys, clipped):
        out[key] = value.astype(np.asarray(final[key]).dtype, copy=False)
    return out


def noise_std(noise_multiplier: float, clipping_norm: float, clients: int) -> float:
    """σ·C/m, the noise on each coordinate of the mean of ``clients`` clipped updates
    (0 without noise, whatever C: σ = 0 with C = inf is no privacy, for tests)."""
    if noise_multiplier == 0:
        return 0.0
    return compute_stdv(noise_multiplier, clipping_norm, clients)


def add_noise(arrays: Mapping[str, np.ndarray], keys: Iterable[str], std: float,
              seed: Iterable[int]) -> ArrayDict:
    """``arrays`` with Gaussian noise of standard deviation ``std`` added to ``keys``,
    drawn from a generator seeded by ``seed`` (the run seed and the round: a resumed
    run draws the same noise); ``std = 0`` adds nothing."""
    out = dict(arrays)
    if std <= 0:
        return out
    rng = np.random.default_rng(list(seed))
    for key in keys:
        value = np.asarray(arrays[key])
        out[key] = (value + rng.normal(0.0, std, size=value.shape)).astype(value.dtype)
    return out
