"""Client-level differential privacy of the shared block: clipping one client's update
and the Gaussian noise of the aggregate (McMahan et al., 2018), with Flower's helpers.

Both sides clip with :func:`clip_update` (the client before it stages u_k, so that
u_k follows the update the server sees; or the server, for a trusted server). The
server releases the sum of the clipped updates with Gaussian noise of standard
deviation σ·C, divided by the expected number of clients q·K (a public constant), so
the noise on each coordinate of the estimate is σ·C/(q·K) (Flower's ``compute_stdv``).
Only the shared trainable parameters are clipped and noised: under differential
privacy shared buffers (BatchNorm statistics) stay with each client, as FedBN keeps them.

The noise and, under privacy, the draw of each round's clients come from a secret the
server draws once per run from the operating system's entropy (:func:`new_secret`)
and keeps only in its checkpoint: nothing in the run-config, the results folder or any
message predicts them.
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


# What a generator drawn from the secret is for (SeedSequence spawn keys).
NOISE, SAMPLE = 0, 1


def new_secret() -> int:
    """128 bits from the operating system's entropy (numpy's ``SeedSequence()``)."""
    return int(np.random.SeedSequence().entropy)


def secret_generator(secret: int, server_round: int, purpose: int) -> np.random.Generator:
    """The generator of ``purpose`` (:data:`NOISE` or :data:`SAMPLE`) in
    ``server_round``, a function of the secret: a resumed run draws the same."""
    return np.random.default_rng(np.random.SeedSequence(secret,
                                                        spawn_key=(server_round, purpose)))


def noise_std(noise_multiplier: float, clipping_norm: float, clients: float) -> float:
    """σ·C/n, the noise on each coordinate of a sum of clipped updates divided by
    ``clients`` = n (0 without noise, whatever C: σ = 0 with C = inf is no privacy,
    for tests)."""
    if noise_multiplier == 0:
        return 0.0
    return compute_stdv(noise_multiplier, clipping_norm, clients)


def add_noise(arrays: Mapping[str, np.ndarray], keys: Iterable[str], std: float,
              rng: np.random.Generator) -> ArrayDict:
    """``arrays`` with Gaussian noise of standard deviation ``std`` added to ``keys``,
    drawn from ``rng`` (:func:`secret_generator`); ``std = 0`` adds nothing."""
    out = dict(arrays)
    if std <= 0:
        return out
    for key in keys:
        value = np.asarray(arrays[key])
        out[key] = (value + rng.normal(0.0, std, size=value.shape)).astype(value.dtype)
    return out
