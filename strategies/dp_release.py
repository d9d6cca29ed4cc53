"""The server's side of client-level differential privacy: what one round releases.

:class:`Privacy` holds the settings; :class:`PrivateRelease` forms each round's release
from the accepted replies (:mod:`fedspc_app.core.dp_mechanism` holds the mechanism's
arithmetic). The release is the broadcast plus the sum of the clipped updates with
Gaussian noise, divided by the public expected number of clients q·K. With adaptive
clipping (``clipping_quantile`` = γ > 0) the clipping norm C_t is state: each round also
releases the noised fraction b̃ of the clients whose update was within C_t, and
C_{t+1} = C_t · exp(−η_C (b̃ − γ)); the update's noise multiplier is then σ_Δ, so that
the round is still one Gaussian mechanism of multiplier σ. C_t is a release of the
mechanism: the clients receive it with each round (they clip to it), the metrics
publish it, and a checkpoint keeps it.

Flower's own adaptive-clipping strategies (``DifferentialPrivacy*AdaptiveClipping``)
are not used: they sum the bit "was clipped" uncentred (sensitivity 1 where their noise
split assumes 1/2), divide it by the number of replies (here private, and not the
account's q·K), and draw the noise from numpy's global generator, not from the server's
secret. Flower's noise split (``compute_adaptive_noise_params``), its clipping and its
noise standard deviation are used (:mod:`fedspc_app.core.dp_mechanism`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedspc_app.core.dp_mechanism import (
    COUNT,
    NOISE,
    add_noise,
    clip_update,
    next_clipping_norm,
    noise_std,
    noised_fraction,
    secret_generator,
    split_noise,
    update_norm,
)
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.records import ArrayDict
from strategies.aggregation import mean_arrays

CLIPPING_NORM_STATE = "dp-clipping-norm"  # the checkpoint's key of C_t (adaptive)


@dataclass(frozen=True)
class Privacy:
    """Client-level differential privacy of the shared block
    (:mod:`fedspc_app.core.dp_mechanism`).

    Parameters
    ----------
    clipping_norm : float
        C, the L2 bound of each client's update of the shared trainable parameters
        (with adaptive clipping: C_1, where the norm starts).
    noise_multiplier : float
        σ: the sum of the accepted clipped updates gets Gaussian noise of standard
        deviation σ·C on every coordinate, and is divided by the expected number of
        clients q·K (q = ``fraction_train``, K the training clients): σ·C/(q·K) on the
        estimate. Under add/remove of one client the sum moves by at most C. With
        adaptive clipping σ is the round's total: the update gets σ_Δ·C_t.
    steps : int
        E, the shared steps every client takes (``expected_shared_steps``: the same
        for every client, public), so that FedSPC's u_bar is computed from the
        privatized aggregate alone.
    clip_on_server : bool (default: False)
        Clip on the server (a trusted server) instead of trusting the clients' clipping.
    clipping_quantile : float (default: 0.0)
        γ in (0, 1): adaptive clipping towards the γ-quantile of the update norms;
        0: a fixed C.
    clipping_lr : float (default: 0.2)
        η_C, the geometric update's step.
    count_stddev : float (default: 0.0)
        σ_b, the noise on the count of updates within C; 0: q·K/20 (none without noise).
    reference_smoothing : float (default: 0.0)
        β in [0, 1): FedSPC's u_bar is β u_bar^{t-1} + (1 − β) (Algorithm 1's u_bar^t
        from the release); 0: Algorithm 1's.
    min_clipping_factor, max_clipping_factor : float (default: 0.1, 10.0)
        Adaptive clipping keeps C_t within [min·C_1, max·C_1], public bounds (0, inf:
        none), so that clients who set their bits cannot push C_t without end.
    """

    clipping_norm: float
    noise_multiplier: float
    steps: int
    clip_on_server: bool = False
    clipping_quantile: float = 0.0
    clipping_lr: float = 0.2
    count_stddev: float = 0.0
    reference_smoothing: float = 0.0
    min_clipping_factor: float = 0.1
    max_clipping_factor: float = 10.0

    @property
    def adaptive(self) -> bool:
        """Whether the clipping norm follows a quantile of the update norms."""
        return self.clipping_quantile > 0

    @property
    def clipping_bounds(self) -> tuple[float, float]:
        """[low, high] of C_t under adaptive clipping: the factors times C_1."""
        return (self.min_clipping_factor * self.clipping_norm,
                self.max_clipping_factor * self.clipping_norm)


class ReleaseError(FedSPCError):
    """A round's release would not be the mechanism's (no noise where σ > 0, a value
    that is not finite, or nothing moved): the round fails and releases nothing."""


def unmoved(released: ArrayDict, broadcast: ArrayDict, keys: Sequence[str],
            cause: str) -> None:
    """Raise :class:`ReleaseError` when a noised release left most entries of ``keys``
    as broadcast (float32 rounding swallowed the update and the noise: a C or a
    server learning rate too small; at any usable C the noise moves every entry). The
    clients' models would then change only in the rounds they were drawn, which their
    evaluation would show; a few entries that start at 0 would still move."""
    total = sum(int(np.size(broadcast[key])) for key in keys)
    moved = sum(int(np.count_nonzero(released[key] != broadcast[key])) for key in keys)
    if total and 2 * moved < total:
        raise ReleaseError(f"the release at {cause} leaves {total - moved} of the shared "
                           f"block's {total} released entries exactly as they were (too "
                           "small for float32): the clients' evaluation would tell which "
                           "of them trained")


class PrivateRelease:
    """One run's releases: the noised sum over q·K, and under adaptive clipping the
    clipping norm C_t it carries from round to round.

    Parameters
    ----------
    privacy : Privacy
        The settings.
    expected_clients : float
        q·K, the public expected number of clients a round draws.
    """

    def __init__(self, privacy: Privacy, expected_clients: float) -> None:
        self.privacy = privacy
        self.expected = expected_clients
        self.clipping_norm = privacy.clipping_norm  # C_t: the norm of the next round
        self.round_clipping_norm = privacy.clipping_norm  # the last round's C_t
        self.unclipped_fraction: float | None = None  # the last round's b̃
        if privacy.adaptive:
            self.count_stddev, self.update_multiplier = split_noise(
                privacy.noise_multiplier, expected_clients, privacy.count_stddev)
        else:
            self.count_stddev, self.update_multiplier = 0.0, privacy.noise_multiplier

    @property
    def noise_std(self) -> float:
        """The noise on each coordinate of the next release, σ_Δ·C_t/(q·K)."""
        return noise_std(self.update_multiplier, self.clipping_norm, self.expected)

    def bits(self, updates: Sequence[ArrayDict], broadcast: ArrayDict,
             keys: Sequence[str], reported: Sequence[int | None]) -> list[int]:
        """b_k = 1[‖Δ_k‖ ≤ C_t] of each accepted update: the client's own under
        client clipping (``reported``, checked by the reply schema), the server's from
        the unclipped update under server clipping."""
        if self.privacy.clip_on_server:
            return [int(update_norm(u, broadcast, keys) <= self.clipping_norm)
                    for u in updates]
        return [int(bit) for bit in reported]

    def release(self, server_round: int, secret: int, broadcast: ArrayDict,
                updates: Sequence[ArrayDict], keys: Sequence[str],
                reported: Sequence[int | None] = ()) -> ArrayDict:
        """The broadcast plus (Σ clip(Δ_k) + N(0, σ_Δ²C_t²))/(q·K) over ``keys``; under
        adaptive clipping also b̃ and C_{t+1} from the clients' bits (``reported``)."""
        privacy, norm = self.privacy, self.clipping_norm
        if privacy.adaptive:
            bits = self.bits(updates, broadcast, keys, reported)
        if privacy.clip_on_server:
            updates = [clip_update(u, broadcast, keys, norm) for u in updates]
        std = noise_std(self.update_multiplier, norm, self.expected)
        if self.update_multiplier > 0 and not std > 0:  # add_noise would add none
            raise ReleaseError(f"the noise's standard deviation is {std!r} at clipping "
                               f"norm {norm!r}: nothing is released without noise")
        released = add_noise(sum_estimate(broadcast, updates, keys, self.expected), keys,
                             std, secret_generator(secret, server_round, NOISE))
        if not all(np.isfinite(released[key]).all() for key in keys):
            raise ReleaseError(f"the release at clipping norm {norm!r} is not finite: "
                               "nothing is released")
        if self.update_multiplier > 0:
            unmoved(released, broadcast, keys, f"clipping norm {norm!r}")
        self.round_clipping_norm = norm
        if privacy.adaptive:
            self.unclipped_fraction = noised_fraction(
                bits, self.expected, self.count_stddev,
                secret_generator(secret, server_round, COUNT))
            self.clipping_norm = next_clipping_norm(norm, self.unclipped_fraction,
                                                    privacy.clipping_quantile,
                                                    privacy.clipping_lr,
                                                    *privacy.clipping_bounds)
        return released

    def metrics(self) -> dict[str, float]:
        """What a round publishes of the adaptive clipping: the C_t it clipped to
        and b̃ (releases of the mechanism); nothing under a fixed C."""
        if not self.privacy.adaptive or self.unclipped_fraction is None:
            return {}
        return {"dp-clipping-norm": self.round_clipping_norm,
                "dp-unclipped-fraction": self.unclipped_fraction}

    def state_dict(self) -> dict[str, float]:
        """C_{t+1} for a checkpoint (adaptive clipping only)."""
        return {CLIPPING_NORM_STATE: self.clipping_norm} if self.privacy.adaptive else {}

    def load_state_dict(self, state: dict) -> None:
        """C_t from a checkpoint, refused (:class:`FedSPCError`, nothing changed) when
        adaptive clipping is on and it is missing, not a finite positive number (a
        negative C would release the clean sum, a non-finite one no usable model) or
        outside the run's bounds."""
        if not self.privacy.adaptive:
            return
        if CLIPPING_NORM_STATE not in state:
            raise FedSPCError(f"the checkpoint holds no clipping norm "
                              f"('{CLIPPING_NORM_STATE}'), and adaptive clipping needs "
                              "the one it reached")
        value = state[CLIPPING_NORM_STATE]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise FedSPCError(f"the checkpoint's clipping norm ('{CLIPPING_NORM_STATE}') "
                              f"is {value!r}, not a finite positive number")
        low, high = self.privacy.clipping_bounds
        if not low <= value <= high:
            raise FedSPCError(f"the checkpoint's clipping norm ('{CLIPPING_NORM_STATE}') "
                              f"is {value!r}, outside this run's bounds [{low:g}, {high:g}]")
        self.clipping_norm = float(value)


def sum_estimate(broadcast: ArrayDict, updates: Sequence[ArrayDict], keys: Sequence[str],
                 expected: float) -> ArrayDict:
    """broadcast + Σ_k (update_k − broadcast) / ``expected`` over ``keys`` (the mean, bit
    for bit, when ``expected`` is the number of updates; other shared entries: their
    mean)."""
    if updates and len(updates) == expected:
        return mean_arrays(updates, [1.0] * len(updates))
    out = mean_arrays(updates, [1.0] * len(updates)) if updates else dict(broadcast)
    for key in keys:
        start = np.asarray(broadcast[key], dtype=np.float64)
        total = sum((np.asarray(u[key], dtype=np.float64) - start for u in updates),
                    np.zeros_like(start))
        out[key] = (start + total / expected).astype(broadcast[key].dtype)
    return out
