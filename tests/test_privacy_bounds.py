"""The edges of differential privacy's settings and state: refusals that reach the
user as one message, a clipping norm that stays finite, positive and within its public
bounds (also against clients that steer it), a checkpoint's C_t checked on load, and
u_bar's smoothing only where there is noise to damp."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from inprocess import InProcessGrid, run_server
from test_privacy_adaptive import bit_reply
from test_strategies import FakeGrid, f32, record

from fedspc_app import client_app
from fedspc_app.core import dp_mechanism as mechanism
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError, FedSPCError
from strategies import PersonalizedFedAvg, Privacy
from strategies.dp_release import CLIPPING_NORM_STATE, PrivateRelease, ReleaseError

W = "w"
ADAPTIVE = {"dp-clipping-norm": 1.0, "local-steps": 2, "dp-noise-multiplier": 1.0,
            "dp-clipping-quantile": 0.5, "num-clients": 100}


def test_a_count_noise_too_small_for_the_federation_found_at_the_start_is_a_refusal(
        tmp_path):
    """num-clients unset: K, and so the default σ_b = q·K/20, is known only when the run
    starts; σ_b ≤ σ/2 then stops the run with the one message of every refusal."""
    config = {"method": "fedavg", "num-rounds": 1, "local-steps": 1, "checkpoint": False,
              "output-dir": str(tmp_path), "run-name": "refused", "dp-clipping-norm": 0.5,
              "dp-noise-multiplier": 0.5, "dp-clipping-quantile": 0.5}
    error = run_server(InProcessGrid(client_app.app, 3, config), config)
    assert error is not None and error.startswith("fedspc: run-config "
                                                  "'dp-clipped-count-stddev'")
    assert "σ_b must exceed σ/2" in error
    assert not (tmp_path / "refused" / "metrics.json").exists()


# ------------------------------------------------------------ η_C and C's arithmetic
@pytest.mark.parametrize("rate", [1.5, 1000.0, math.inf, math.nan, 0.0, -0.1])
def test_a_clipping_step_beyond_one_is_refused(rate):
    with pytest.raises(ConfigError, match="'dp-clipping-lr' must be in \\(0, 1\\]"):
        parse_run_config({**ADAPTIVE, "dp-clipping-lr": rate})
    assert parse_run_config({**ADAPTIVE, "dp-clipping-lr": 1.0}).dp_clipping_lr == 1.0


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize("rate", [1000.0, 2000.0, 1e6])
def test_the_next_clipping_norm_stays_finite_and_positive_at_any_step(rate, fraction):
    """Without bounds (a Privacy built by hand: config refuses η_C > 1) a huge step
    neither overflows nor reaches 0 or inf."""
    norm = 1.0
    for _ in range(5):
        norm = mechanism.next_clipping_norm(norm, fraction, 0.5, rate)
        assert math.isfinite(norm) and norm > 0
    # Within the bounds it is the geometric update, bit for bit.
    assert mechanism.next_clipping_norm(2.0, 0.8, 0.5, 0.2, 0.1, 20.0) == 2.0 * math.exp(
        -0.2 * 0.3)


def steered(gamma: float, attackers: int, attack: str, rounds: int = 200,
            **bounds) -> list[float]:
    """C_t over the rounds of the server's release (server clipping, q·K = K = 50,
    σ = 1) when ``attackers`` clients set their bit: a huge update reads as a 0
    (C grows), a zero update as a 1 (C shrinks); the others' norms are about 1."""
    rng = np.random.default_rng(0)
    honest = np.exp(rng.normal(0.0, 0.3, size=50))
    release = PrivateRelease(Privacy(1.0, 1.0, steps=1, clip_on_server=True,
                                     clipping_quantile=gamma, clipping_lr=0.2, **bounds),
                             50.0)
    broadcast, norms = {W: np.zeros(4, np.float32)}, []
    for server_round in range(1, rounds + 1):
        updates = []
        for k in range(50):
            size = (1e6 if attack == "up" else 0.0) if k < attackers else honest[k]
            direction = rng.normal(size=4)
            updates.append({W: (size * direction / np.linalg.norm(direction)
                                ).astype(np.float32)})
        release.release(server_round, 99, broadcast, updates, [W])
        norms.append(release.clipping_norm)
    return norms


@pytest.mark.parametrize("gamma,attackers,attack", [(0.9, 15, "up"), (0.5, 30, "up"),
                                                    (0.5, 30, "down"), (0.1, 10, "down")])
def test_clients_that_steer_the_clipping_norm_stay_within_its_bounds(gamma, attackers,
                                                                      attack):
    """A share of the draw above 1 − γ (up) or γ (down) moves C geometrically: within
    [C_1/10, 10 C_1] by default, without end with the bounds off."""
    bounded = steered(gamma, attackers, attack)
    assert all(0.1 <= norm <= 10.0 for norm in bounded)
    assert (max(bounded) if attack == "up" else min(bounded)) == (10.0 if attack == "up"
                                                                  else 0.1)
    free = steered(gamma, attackers, attack, min_clipping_factor=0.0,
                   max_clipping_factor=math.inf)
    assert (max(free) > 10.0) if attack == "up" else (min(free) < 0.1)


def test_honest_clients_and_an_attack_below_the_threshold_are_not_bounded():
    """f/(qK) = 10/50 ≤ 1 − γ = 0.5: C stays near the honest median, the bounds unused;
    the run equals the one without bounds."""
    assert steered(0.5, 10, "up", rounds=50) == steered(
        0.5, 10, "up", rounds=50, min_clipping_factor=0.0, max_clipping_factor=math.inf)


@pytest.mark.parametrize("low,high", [(-0.1, 10.0), (1.5, 10.0), (0.1, 0.5),
                                      (math.nan, 10.0), (0.1, math.nan)])
def test_bounds_out_of_range_are_refused(low, high):
    with pytest.raises(ConfigError, match="'dp-clipping-norm-min-factor' must be in"):
        parse_run_config({**ADAPTIVE, "dp-clipping-norm-min-factor": low,
                          "dp-clipping-norm-max-factor": high})
    config = parse_run_config({**ADAPTIVE, "dp-clipping-norm-min-factor": 0.0,
                               "dp-clipping-norm-max-factor": math.inf})
    assert (config.dp_clipping_norm_min_factor, config.dp_clipping_norm_max_factor) == (
        0.0, math.inf)


# ------------------------------------------------------------ the checkpoint's C_t
def adaptive(clip_on_server: bool = True) -> PersonalizedFedAvg:
    return PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W],
                              privacy=Privacy(1.0, 1.0, steps=2, clip_on_server=clip_on_server,
                                              clipping_quantile=0.5, count_stddev=2.0))


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("edited", [math.nan, -1.0, 0.0, math.inf, -math.inf, "abc",
                                    "2.0", True, None, "missing", 1e308, 0.01])
def test_a_checkpoint_clipping_norm_that_is_not_finite_and_positive_is_refused(edited):
    server = adaptive()
    state = server.state_dict()
    if edited == "missing":
        del state[CLIPPING_NORM_STATE]
    else:
        state[CLIPPING_NORM_STATE] = edited
    before = (list(server.accepted_rounds), server.secret, server.release.clipping_norm)
    state["accepted-rounds"] = [1, 1, 1, 1]
    with pytest.raises(FedSPCError, match="clipping norm"):
        server.load_state_dict(state, 1)
    # Nothing half-loaded.
    assert (list(server.accepted_rounds), server.secret,
            server.release.clipping_norm) == before
    state[CLIPPING_NORM_STATE] = 0.5
    server.load_state_dict(state, 1)
    assert server.release.clipping_norm == 0.5


@pytest.mark.usefixtures("task_identity")
def test_a_release_without_noise_under_sigma_fails_the_round_and_releases_nothing():
    server = adaptive()
    server.release.clipping_norm = 5e-324  # σ·C/(qK) underflows to 0
    server.configure_train(2, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    arrays, metrics = server.aggregate_train(
        2, [bit_reply(n, f32(0.3, 0.4), None) for n in (1, 2, 3, 4)])
    assert arrays is None and metrics is None
    assert server.report.failed and "noise" in server.report.reasons[-1]
    assert server.accepted_rounds == [0, 0, 0, 0] and server.release.clipping_norm == 5e-324
    release = PrivateRelease(Privacy(1.0, 1.0, steps=1), 4.0)
    release.update_multiplier = 5e-324
    with pytest.raises(ReleaseError, match="without noise"):
        release.release(1, 7, {W: f32(0.0, 0.0)}, [{W: f32(0.1, 0.1)}], [W])


@pytest.mark.usefixtures("task_identity")
def test_a_release_that_is_not_finite_fails_the_round():
    server = adaptive()
    server.release.clipping_norm = 1e300  # finite, but the float32 release overflows
    server.configure_train(2, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    arrays, _ = server.aggregate_train(
        2, [bit_reply(n, f32(0.3, 0.4), None) for n in (1, 2, 3, 4)])
    assert arrays is None and "not finite" in server.report.reasons[-1]


# ------------------------------------------------------------ u_bar's smoothing
@pytest.mark.parametrize("overrides,message", [
    ({"dp-noise-multiplier": 0.0}, "with noise"),
    ({"dp-noise-multiplier": 0.0, "dp-clipping-norm": math.inf}, "with noise"),
    ({"dp-reference-smoothing": 0.995}, "must be in \\[0, 0.99\\]"),
    ({"dp-reference-smoothing": 1 - 1e-17}, "must be in"),
    ({"dp-reference-smoothing": math.nan}, "must be in"),
])
def test_smoothing_without_noise_or_too_close_to_one_is_refused(overrides, message):
    config = {"fedspc": True, "local-steps": 2, "dp-clipping-norm": 1.0,
              "dp-noise-multiplier": 1.0, "dp-reference-smoothing": 0.9, **overrides}
    with pytest.raises(ConfigError, match=message):
        parse_run_config(config)


def test_the_largest_smoothing_still_moves_u_bar_in_float32():
    """At β = 0.99 a step of 1e-4 of u_bar's size survives the float32 u_bar."""
    previous, new = {W: np.array([1.0], np.float32)}, {W: np.array([1.0 + 1e-4], np.float32)}
    assert mechanism.smooth(previous, new, 0.99)[W][0] > np.float32(1.0)
    assert parse_run_config({"fedspc": True, "local-steps": 2, "dp-clipping-norm": 1.0,
                             "dp-noise-multiplier": 1.0,
                             "dp-reference-smoothing": 0.99}).dp_reference_smoothing == 0.99
