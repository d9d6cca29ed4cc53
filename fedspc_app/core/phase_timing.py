"""How a padded training phase (``dp-phase-seconds`` = T) leaves room after its reply
deadline (docs/privacy.md, timing).

A drawn client that never replies holds its phase until ``round-timeout``, counted
from the phase's start; then the server has still to notice the deadline (it pulls
the replies every :data:`REPLY_POLL_SECONDS`, the last pull cut short at the
deadline) and to check and sum the replies that came, a time that grows with the
model and with how many replies came. Whatever of that does not fit in T makes the
phase overrun exactly in the rounds that drew such a client. ``round-timeout`` must
therefore leave a reserve below T: a tenth of T (the aggregation is a part of the
phase T is chosen to hold, and grows with it), at least :data:`MIN_RESERVE_SECONDS`
(the poll and a small model's aggregation, whatever T).
"""

from __future__ import annotations

from fedspc_app.core.errors import ConfigError

REPLY_POLL_SECONDS = 0.1
"""How often the server pulls a phase's replies (strategies.rounds.exchange)."""
RESERVE_SHARE = 10  # a tenth of T
MIN_RESERVE_SECONDS = 0.5


def phase_reserve(phase_seconds: float) -> float:
    """The seconds ``round-timeout`` must stay below ``dp-phase-seconds``."""
    return max(phase_seconds / RESERVE_SHARE, MIN_RESERVE_SECONDS)


def check_round_timeout(phase_seconds: float, round_timeout: float) -> None:
    """Refuse a ``round-timeout`` that leaves less than :func:`phase_reserve` of a
    padded phase (``phase_seconds`` > 0) for the aggregation after the deadline."""
    if phase_seconds <= 0:
        return
    reserve = phase_reserve(phase_seconds)
    if phase_seconds <= reserve:
        raise ConfigError(
            f"run-config 'dp-phase-seconds' = {phase_seconds:g} must be above "
            f"{MIN_RESERVE_SECONDS:g}: a padded phase keeps that reserve below it for the "
            "aggregation after the reply deadline ('round-timeout'), and T must hold the "
            "training too")
    if round_timeout > phase_seconds - reserve:
        raise ConfigError(
            f"run-config 'round-timeout' = {round_timeout:g} must be at most "
            f"{phase_seconds - reserve:g}: 'dp-phase-seconds' = {phase_seconds:g} less a "
            f"reserve of {reserve:g} s (a tenth of it, at least {MIN_RESERVE_SECONDS:g} s) "
            "for the aggregation after the reply deadline; a drawn client that never "
            "replies would otherwise make its rounds' training phases outlast the padding")
