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

Adaptive clipping (Andrew et al., 2021): the clipping norm C_t follows a target quantile
γ of the clients' update norms. Each client's bit b_k = 1[‖Δ_k‖ ≤ C_t] is summed
centred, Σ (b_k − 1/2), so that one client moves the count by at most 1/2; Gaussian
noise of standard deviation σ_b makes it a second Gaussian query of the same clients
(:func:`noised_fraction`), and C_{t+1} = C_t · exp(−η_C (b̃ − γ))
(:func:`next_clipping_norm`). The update's noise multiplier σ_Δ is chosen so that the
two together are one Gaussian mechanism of multiplier σ (:func:`split_noise`): the
round's account is the fixed-C run's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.supercore.differential_privacy import (
    compute_adaptive_noise_params,
    compute_stdv,
    get_norm,
)

from fedspc_app.core.privacy_config import COUNT_STDDEV_SHARE  # σ_b = qK/20 unless set
from fedspc_app.core.records import ArrayDict


def update_norm(final: Mapping[str, np.ndarray], initial: Mapping[str, np.ndarray],
                keys: Iterable[str]) -> float:
    """The L2 norm of ``final - initial`` over ``keys`` (Flower's ``get_norm``)."""
    return get_norm([np.subtract(final[k], initial[k], dtype=np.float64) for k in keys])


def clip_update(final: Mapping[str, np.ndarray], initial: Mapping[str, np.ndarray],
                keys: Iterable[str], clipping_norm: float) -> ArrayDict:
    """``final`` with its update from ``initial`` over ``keys`` scaled down to L2 norm at
    most ``clipping_norm`` (as Flower's ``compute_clip_model_update`` scales it); an
    update within the norm leaves ``final`` exactly as it is.

    The norm that counts is the one the server measures, of what is sent: ``final``
    minus ``initial`` in float64 (:func:`update_norm`). Rounding ``initial`` plus the
    scaled update back to float32 can leave that above ``clipping_norm`` when the norm
    is small against the parameters, so the update is shrunk until it is within; if no
    float32 step is (``clipping_norm`` below the parameters' resolution), the update
    is dropped (``final = initial``). Either way whether a reply passes the server's
    check depends on nothing private."""
    keys = list(keys)
    out = dict(final)
    norm = update_norm(final, initial, keys) if keys else 0.0
    if norm <= clipping_norm:
        return out
    steps = {key: np.subtract(final[key], initial[key], dtype=np.float64) for key in keys}
    dtypes = {key: np.asarray(final[key]).dtype for key in keys}
    scale = clipping_norm / norm
    for attempt in range(_SHRINK_ATTEMPTS):
        candidate = {key: (np.asarray(initial[key], dtype=np.float64) + scale * steps[key])
                     .astype(dtypes[key]) for key in keys}
        norm = update_norm(candidate, initial, keys)
        if norm <= clipping_norm:
            out.update(candidate)
            return out
        # Over by rounding: shrink by the excess and a margin that grows each attempt.
        scale *= clipping_norm / norm * (1.0 - min(0.5, 1e-6 * 4.0 ** attempt))
    out.update({key: np.asarray(initial[key]).astype(dtypes[key]) for key in keys})
    return out


_SHRINK_ATTEMPTS = 16  # rounds of shrinking before a clipped update is dropped


# What a generator drawn from the secret is for (SeedSequence spawn keys): the
# update's noise, the draw of the clients, the noise of the clipped count.
NOISE, SAMPLE, COUNT = 0, 1, 2


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


# ------------------------------------------------------------ adaptive clipping
def split_noise(noise_multiplier: float, expected_clients: float,
                count_stddev: float = 0.0) -> tuple[float, float]:
    """(σ_b, σ_Δ): the count's noise standard deviation and the update's noise
    multiplier of adaptive clipping, with σ_Δ = (σ^−2 − (2σ_b)^−2)^(−1/2) (Andrew et al.,
    2021, Thm. 1), so that the update (sensitivity C, noise σ_Δ·C) and the centred count
    (sensitivity 1/2, noise σ_b) together are one Gaussian mechanism of multiplier σ.
    ``count_stddev`` 0 means qK/20 under noise (``expected_clients`` = qK), none
    without. Flower's ``compute_adaptive_noise_params``; raises ``ValueError`` when
    σ ≥ 2σ_b (no σ_Δ exists)."""
    if noise_multiplier > 0 and not noise_multiplier < 2 * (
            count_stddev or COUNT_STDDEV_SHARE * expected_clients):
        raise ValueError(
            f"the clipped count's noise σ_b = "
            f"{count_stddev or COUNT_STDDEV_SHARE * expected_clients:g} leaves nothing for "
            f"the update at σ = {noise_multiplier:g}: σ_b must exceed σ/2")
    count, update = compute_adaptive_noise_params(
        noise_multiplier, expected_clients, count_stddev if count_stddev > 0 else None)
    return float(count), float(update)


def noised_fraction(bits: Iterable[int], expected_clients: float, count_stddev: float,
                    rng: np.random.Generator) -> float:
    """b̃ = 1/2 + (Σ_k (b_k − 1/2) + N(0, σ_b²)) / (qK), clamped to [0, 1]: the noised
    fraction of the clients whose update was within the clipping norm. Centred, one
    client moves the sum by at most 1/2 (drawn or not, replied or not); divided by
    the public qK like the update. Without noise and with qK clients summed it is
    their true fraction. The clamp is post-processing: one round moves C by at most a
    factor e^{±η_C}."""
    centred = math.fsum(float(bit) - 0.5 for bit in bits)
    noise = float(rng.normal(0.0, count_stddev)) if count_stddev > 0 else 0.0
    return min(1.0, max(0.0, 0.5 + (centred + noise) / expected_clients))


# Where C_{t+1} is kept whatever the step: finite and positive.
SMALLEST_NORM, LARGEST_NORM = sys.float_info.min, sys.float_info.max


def next_clipping_norm(clipping_norm: float, fraction: float, quantile: float,
                       learning_rate: float, low: float = 0.0,
                       high: float = math.inf) -> float:
    """C_{t+1} = C_t · exp(−η_C (b̃ − γ)), the geometric update of Andrew et al.: more
    than γ of the updates within C shrinks it, fewer grows it; then clamped to the
    public bounds [``low``, ``high``] and, whatever they are, to a finite positive
    float (post-processing of the release: no privacy cost). The exponent is clamped
    where ``math.exp`` would overflow, which only a step far beyond the configurable
    η_C ≤ 1 reaches."""
    exponent = min(max(-learning_rate * (fraction - quantile), -700.0), 700.0)
    norm = min(max(clipping_norm * math.exp(exponent), low), high)
    return min(max(norm, SMALLEST_NORM), LARGEST_NORM)


def smooth(previous: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray],
           factor: float) -> dict[str, np.ndarray]:
    """β·previous + (1 − β)·new key by key (float64 arithmetic, float32 results):
    the exponential average of u_bar over rounds (``dp-reference-smoothing``)."""
    return {key: (factor * np.asarray(previous[key], np.float64)
                  + (1.0 - factor) * np.asarray(value, np.float64)).astype(np.float32)
            for key, value in new.items()}
