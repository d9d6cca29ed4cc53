"""The run-config's differential-privacy settings (dp-*): their ranges, and the
settings privacy cannot honour. :func:`fedspc_app.core.config.validate` calls these
checks; they take the :class:`~fedspc_app.core.config.RunConfig` it checks."""

from __future__ import annotations

import math
from typing import Any

from fedspc_app.core.errors import ConfigError
from fedspc_app.core.phase_timing import check_round_timeout
from fedspc_app.core.ranges import at_least, choice

DP_EVALUATE = ("every-round", "final")  # which rounds evaluate the clients under privacy
COUNT_STDDEV_SHARE = 1 / 20  # adaptive clipping's σ_b unless set: q·K/20 (Andrew et al.)
MAX_CLIPPING_LR = 1.0  # η_C: a round moves the clipping norm by at most a factor e
MAX_REFERENCE_SMOOTHING = 0.99  # β of u_bar's smoothing (float32 u_bar; the lag)
DP_REFERENCES = ("increment", "level")  # what u_bar is derived from under privacy
CENTRE_RULES = ("client-centre", "server-centre")  # the server tracks every u_k


def check_adaptive(config: Any, corrects: bool) -> None:
    """Adaptive clipping and u_bar's smoothing: their ranges, and that they need
    differential privacy (``corrects``: the method keeps u_bar)."""
    quantile, count_std = config.dp_clipping_quantile, config.dp_clipped_count_stddev
    if not (quantile == 0.0 or 0.0 < quantile < 1.0):
        raise ConfigError("run-config 'dp-clipping-quantile' must be 0 (a fixed "
                          f"dp-clipping-norm) or in (0, 1), got {quantile!r}")
    # η_C ≤ 1: one round moves C by at most a factor e^{η_C max(γ, 1 − γ)} ≤ e; a
    # larger step follows one round's noised count by orders of magnitude (and from
    # about 700 overflows a float), no longer tracking a quantile.
    if not 0.0 < config.dp_clipping_lr <= MAX_CLIPPING_LR:
        raise ConfigError(f"run-config 'dp-clipping-lr' must be in (0, {MAX_CLIPPING_LR:g}], "
                          f"got {config.dp_clipping_lr!r}")
    at_least("dp-clipped-count-stddev", count_std, 0.0)
    low, high = config.dp_clipping_norm_min_factor, config.dp_clipping_norm_max_factor
    if not 0.0 <= low <= 1.0 or not high >= 1.0:  # (NaN fails both)
        raise ConfigError("run-config 'dp-clipping-norm-min-factor' must be in [0, 1] and "
                          "'dp-clipping-norm-max-factor' >= 1 (inf: no bound), got "
                          f"{low!r} and {high!r}")
    # β ≤ 0.99: a lag of 99 rounds at q = 1 already; closer to 1, u_bar's float32 loses
    # each round's (1 − β)-sized step (from β ≈ 0.99999 it no longer moves).
    if not 0.0 <= config.dp_reference_smoothing <= MAX_REFERENCE_SMOOTHING:
        raise ConfigError("run-config 'dp-reference-smoothing' must be in "
                          f"[0, {MAX_REFERENCE_SMOOTHING:g}], got "
                          f"{config.dp_reference_smoothing!r}")
    if quantile == 0.0 and count_std > 0:
        raise ConfigError("run-config 'dp-clipped-count-stddev' is the noise of adaptive "
                          "clipping: it needs 'dp-clipping-quantile' > 0")
    if quantile > 0 and not (config.dp and math.isfinite(config.dp_clipping_norm)):
        raise ConfigError("run-config 'dp-clipping-quantile' > 0 (adaptive clipping) needs "
                          "differential privacy with a finite 'dp-clipping-norm', where "
                          "the clipping norm starts")
    sigma = config.dp_noise_multiplier
    training = config.num_clients - config.held_out_clients
    expected = min(config.fraction_train, 1.0) * training if training > 0 else 0.0
    count_std = count_std or COUNT_STDDEV_SHARE * expected
    if quantile > 0 and sigma > 0 and count_std > 0 and sigma >= 2 * count_std:
        raise ConfigError(
            f"run-config 'dp-clipped-count-stddev' σ_b = {count_std:g} "
            + ("(q·K/20) " if not config.dp_clipped_count_stddev else "")
            + f"is too small for 'dp-noise-multiplier' σ = {sigma:g}: the update's "
            "multiplier (σ^-2 - (2σ_b)^-2)^(-1/2) needs σ_b > σ/2")
    choice("dp-reference", config.dp_reference, DP_REFERENCES)
    if config.dp_reference == "level" and not (config.dp and corrects and not config.momentum):
        raise ConfigError("run-config 'dp-reference' = 'level' needs differential privacy, "
                          "FedSPC (or a method with control variates) and 'momentum' = 0 "
                          "(momentum moves the block by more than E·η per unit of correction)")
    if config.dp_reference_smoothing > 0 and not (config.dp and corrects and sigma > 0):
        raise ConfigError(
            "run-config 'dp-reference-smoothing' > 0 needs differential privacy and "
            "FedSPC (fedspc = true, or a method with control variates) with noise "
            "('dp-noise-multiplier' > 0): it damps the noise u_bar takes from the "
            "privatized aggregate; without noise u_bar has none to damp")


def check_privacy(config: Any) -> None:
    """The settings of differential privacy, and what it cannot honour."""
    if not config.dp_clipping_norm >= 0.0:  # inf allowed: no clipping (for tests)
        raise ConfigError("run-config 'dp-clipping-norm' must be >= 0 (inf: no clipping), "
                          f"got {config.dp_clipping_norm!r}")
    at_least("dp-noise-multiplier", config.dp_noise_multiplier, 0.0)
    at_least("dp-target-epsilon", config.dp_target_epsilon, 0.0)
    if not 0.0 < config.dp_delta < 1.0:
        raise ConfigError(f"run-config 'dp-delta' must be in (0, 1), got {config.dp_delta!r}")
    at_least("dp-phase-seconds", config.dp_phase_seconds, 0.0)
    choice("dp-evaluate", config.dp_evaluate, DP_EVALUATE)
    if not config.dp:
        if config.dp_noise_multiplier or config.dp_target_epsilon:
            raise ConfigError("run-config 'dp-noise-multiplier' and 'dp-target-epsilon' need "
                              "'dp-clipping-norm' > 0 (differential privacy is off without it)")
        if config.dp_phase_seconds > 0 or config.dp_evaluate != "every-round":
            raise ConfigError("run-config 'dp-phase-seconds' > 0 and 'dp-evaluate' = "
                              "'final' hide which clients a round drew, a secret only under "
                              "differential privacy: they need 'dp-clipping-norm' > 0")
        return
    check_round_timeout(config.dp_phase_seconds, config.round_timeout)
    refusals = []
    if config.local_steps == 0:
        refusals.append("'local-steps' > 0 (every client the same number of steps, so "
                        "that u_bar is computed from the privatized aggregate alone)")
    if config.aggregation != "mean":
        refusals.append(f"'aggregation' = 'mean' (the noise is calibrated for an "
                        f"unweighted mean; got {config.aggregation!r})")
    if config.fedspc_upload != "derived":
        refusals.append("'fedspc-upload' = 'derived' (an uploaded reference change would "
                        "leave the server unclipped and unnoised)")
    if config.fedspc_reference in CENTRE_RULES:
        refusals.append("'fedspc-reference' = 'increment' or 'auto' (u_bar is computed "
                        "from the privatized aggregate; no client's own change is released)")
    if config.dp_noise_multiplier > 0 and math.isinf(config.dp_clipping_norm):
        refusals.append("a finite 'dp-clipping-norm' when 'dp-noise-multiplier' > 0 "
                        "(the noise is sigma times it)")
    if refusals:
        raise ConfigError("differential privacy (dp-clipping-norm > 0) needs "
                          + "; ".join(refusals))
