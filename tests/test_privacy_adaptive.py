"""Adaptive clipping (the clipping norm follows a quantile of the update norms through
a noised count) and the smoothing of FedSPC's u_bar under differential privacy: their
arithmetic by hand, the noise split and its account, the refusals, the reply bit, and
a resumed run that continues both."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from test_faults import broadcast
from test_privacy import run
from test_privacy_secret import crash_and_resume, secrets_from
from test_replies import metrics_of
from test_strategies import FakeGrid, arrays_of, f32, from_node, record, reply

from fedspc_app.core import dp_mechanism as mechanism
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import get_method
from fedspc_app.core.protocol import ARRAYS, CLIPPING_NORM, WITHIN_CLIPPING_NORM
from fedspc_app.core.records import from_record
from fedspc_app.models.split import ParameterSplit
from fedspc_app.runs import dp_account
from fedspc_app.server_app import build_strategy
from strategies import FedSPC, PersonalizedFedAvg, Privacy
from strategies.dp_release import CLIPPING_NORM_STATE, PrivateRelease

W = "w"
ADAPTIVE = {"clipping_quantile": 0.5, "clipping_lr": 0.2}


# ------------------------------------------------------------------ the arithmetic
def test_the_geometric_update_by_hand():
    # More than γ of the updates within C: C shrinks; fewer: it grows; at γ: it stays.
    assert mechanism.next_clipping_norm(2.0, 0.8, 0.5, 0.2) == pytest.approx(
        2.0 * math.exp(-0.06), rel=1e-15)
    assert mechanism.next_clipping_norm(2.0, 0.1, 0.5, 0.2) == pytest.approx(
        2.0 * math.exp(0.08), rel=1e-15)
    assert mechanism.next_clipping_norm(2.0, 0.5, 0.5, 0.2) == 2.0


def test_the_noise_split_is_andrew_et_als():
    # σ = 1, qK = 50: σ_b = qK/20 = 2.5 and σ_Δ = (1 − 1/25)^(−1/2).
    count, update = mechanism.split_noise(1.0, 50.0)
    assert count == 2.5 and update == pytest.approx((1 - 1 / 25) ** -0.5, rel=1e-12)
    count, update = mechanism.split_noise(0.8, 10.0, count_stddev=1.0)
    assert count == 1.0 and update == pytest.approx((0.8 ** -2 - 2.0 ** -2) ** -0.5)
    # Update and centred count (sensitivity 1/2) together: one multiplier σ.
    assert (update ** -2 + (2 * count) ** -2) ** -0.5 == pytest.approx(0.8, rel=1e-12)
    assert mechanism.split_noise(0.0, 10.0) == (0.0, 0.0)  # no noise, no privacy
    with pytest.raises(ValueError, match="σ_b must exceed σ/2"):
        mechanism.split_noise(1.0, 10.0)  # σ_b = 0.5 = σ/2: no σ_Δ exists
    with pytest.raises(ValueError, match="σ_b must exceed σ/2"):
        mechanism.split_noise(1.0, 500.0, count_stddev=0.4)


def test_the_noised_fraction_without_noise_is_the_true_fraction():
    rng = np.random.default_rng(0)
    assert mechanism.noised_fraction([1, 0, 1, 1], 4.0, 0.0, rng) == 0.75
    assert mechanism.noised_fraction([], 4.0, 0.0, rng) == 0.5 - 0.0  # nobody: 1/2
    # Three of qK = 4 counted (one dropped): 1/2 + (Σ (b − 1/2))/(qK), the missing
    # client counting 0, between its two bits' ± 1/2 / 4.
    assert mechanism.noised_fraction([1, 1, 0], 4.0, 0.0, rng) == 0.625
    # Noised: the standard deviation σ_b/(qK) around the fraction, clamped to [0, 1].
    draws = [mechanism.noised_fraction([1, 0] * 10, 20.0, 2.0, np.random.default_rng(s))
             for s in range(4000)]
    assert np.std(draws) == pytest.approx(0.1, rel=0.05)
    assert np.mean(draws) == pytest.approx(0.5, abs=0.01)
    assert mechanism.noised_fraction([1], 0.01, 5.0, rng) in (0.0, 1.0)


def updates_of_norms(norms) -> list[dict]:
    return [{W: f32(0.6 * n, 0.8 * n)} for n in norms]


def test_the_clipping_norm_converges_to_the_target_quantile():
    """200 rounds of the server's own release (server-side clipping computes the bits),
    no noise, 40 clients whose update norms never change: C ends at the γ-quantile of
    the norms, from far above and from far below (beyond the default bounds of C_t,
    switched off here)."""
    norms = np.exp(np.random.default_rng(3).normal(0.0, 1.0, size=40))
    updates, broadcast = updates_of_norms(norms), {W: f32(0.0, 0.0)}
    for quantile, start in ((0.3, 100.0), (0.8, 0.001)):
        release = PrivateRelease(Privacy(start, 0.0, steps=1, clip_on_server=True,
                                         clipping_quantile=quantile,
                                         min_clipping_factor=0.0,
                                         max_clipping_factor=math.inf), 40.0)
        for server_round in range(1, 301):
            release.release(server_round, 1, broadcast, updates, [W])
        within = float(np.mean(norms <= release.clipping_norm))
        assert within == pytest.approx(quantile, abs=1 / 40 + 1e-9)
        assert np.quantile(norms, quantile - 0.05) <= release.clipping_norm <= np.quantile(
            norms, quantile + 0.05)


def test_the_release_under_adaptive_clipping_uses_sigma_delta_and_c_t():
    release = PrivateRelease(Privacy(1.0, 1.0, steps=1, clip_on_server=True,
                                     clipping_quantile=0.5, count_stddev=2.0), 4.0)
    assert release.update_multiplier == pytest.approx((1 - 1 / 16) ** -0.5)
    broadcast = {W: np.zeros(200_000, dtype=np.float32)}
    out = release.release(1, 77, broadcast, [], [W])  # an empty draw: noise alone
    assert out[W].std() == pytest.approx(release.update_multiplier * 1.0 / 4, rel=0.01)
    assert release.metrics()["dp-clipping-norm"] == 1.0  # what this round clipped to
    assert release.clipping_norm == pytest.approx(
        math.exp(-0.2 * (release.unclipped_fraction - 0.5)))
    # The same secret and round: the same noise and the same count (a resumed run's).
    again = PrivateRelease(release.privacy, 4.0)
    assert again.release(1, 77, broadcast, [], [W])[W].tobytes() == out[W].tobytes()
    assert again.clipping_norm == release.clipping_norm


# -------------------------------------------------------------------- the account
def test_the_split_mechanism_costs_what_one_gaussian_of_sigma_costs():
    """One client adds (an update of norm ≤ C, a centred bit ±1/2) against the noise
    (σ_Δ C per coordinate, σ_b on the count): in units of the noise its largest move
    is 1/σ, so a round is one Gaussian mechanism of multiplier σ on the drawn clients
    (at q < 1: dp_accounting's PoissonSampledDpEvent(q, GaussianDpEvent(σ)), the
    fixed-C account). At q = 1 dp_accounting's RDP accountant composing the two
    queries (the update at σ_Δ, the count at 2σ_b) gives exactly that ε."""
    import dp_accounting

    sigma, rounds, clip = 0.9, 30, 0.7
    count, update = mechanism.split_noise(sigma, 10.0, count_stddev=1.0)
    assert math.hypot(clip / (update * clip), 0.5 / count) == pytest.approx(1 / sigma)
    account = dp_accounting.rdp.RdpAccountant(orders=list(dp_account.ORDERS))
    account.compose(dp_accounting.GaussianDpEvent(update), rounds)
    account.compose(dp_accounting.GaussianDpEvent(2 * count), rounds)
    assert account.get_epsilon(1e-5) == pytest.approx(
        dp_account.epsilon(sigma, 1.0, rounds, 1e-5), rel=1e-9)


# ------------------------------------------------------------------ the refusals
DP = {"dp-clipping-norm": 1.0, "local-steps": 2}


@pytest.mark.parametrize("overrides,message", [
    ({**DP, "dp-clipping-quantile": 1.0}, "'dp-clipping-quantile' must be 0"),
    ({**DP, "dp-clipping-quantile": -0.2}, "'dp-clipping-quantile' must be 0"),
    ({"dp-clipping-quantile": 0.5}, "needs differential privacy"),
    ({**DP, "dp-clipping-norm": math.inf, "dp-clipping-quantile": 0.5},
     "needs differential privacy with a finite"),
    ({**DP, "dp-clipping-quantile": 0.5, "dp-clipping-lr": 0.0}, "'dp-clipping-lr'"),
    ({**DP, "dp-clipped-count-stddev": 1.0}, "needs 'dp-clipping-quantile' > 0"),
    ({**DP, "dp-clipping-quantile": 0.5, "dp-noise-multiplier": 1.0,
      "dp-clipped-count-stddev": 0.5}, "σ_b = 0.5 is too small"),
    # The default σ_b = qK/20: 10 clients all drawn give 0.5, too small for σ = 1.
    ({**DP, "dp-clipping-quantile": 0.5, "dp-noise-multiplier": 1.0, "num-clients": 10},
     r"σ_b = 0.5 \(q·K/20\) is too small"),
    ({**DP, "dp-reference-smoothing": 1.0}, "'dp-reference-smoothing' must be in"),
    ({"fedspc": True, "dp-reference-smoothing": 0.5}, "needs differential privacy and"),
    ({**DP, "dp-reference-smoothing": 0.5}, "needs differential privacy and FedSPC"),
])
def test_what_adaptive_clipping_and_smoothing_cannot_honour_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(overrides)


def test_the_settings_that_work_pass():
    parse_run_config({**DP, "dp-clipping-quantile": 0.5, "dp-noise-multiplier": 1.0,
                      "num-clients": 100})  # σ_b = 5
    noised = {**DP, "dp-noise-multiplier": 1.0}
    parse_run_config({**noised, "method": "scaffold", "dp-reference-smoothing": 0.9})
    parse_run_config({**noised, "fedspc": True, "dp-reference-smoothing": 0.5})


def test_a_federation_too_small_for_the_default_count_noise_is_refused_at_the_start():
    """K is known only when the run starts (num-clients = 0): the strategy refuses."""
    config = parse_run_config({**DP, "dp-clipping-quantile": 0.5,
                               "dp-noise-multiplier": 1.0})
    split = ParameterSplit(body=("w",), head=(), shared=("w",), personal=(),
                           parameters=frozenset({"w"}))
    with pytest.raises(ConfigError, match="'dp-clipped-count-stddev'.*σ_b must exceed"):
        build_strategy(config, get_method("fedavg"), split, 10)
    strategy = build_strategy(config, get_method("fedavg"), split, 100)
    assert strategy.release.count_stddev == 5.0


# ------------------------------------------------------------------- the reply bit
def adaptive_server(clip_on_server=False, clients=4, **kwargs) -> PersonalizedFedAvg:
    server = PersonalizedFedAvg(shared_keys=[W], num_partitions=clients, drift_keys=[W],
                                privacy=Privacy(1.0, 0.0, steps=2,
                                                clip_on_server=clip_on_server,
                                                **ADAPTIVE, **kwargs))
    config = ConfigRecord()
    server.configure_train(1, record({W: f32(0.0, 0.0)}), config,
                           FakeGrid(range(1, clients + 1)))
    assert config[CLIPPING_NORM] == 1.0  # the clients clip to C_t
    return server


def bit_reply(node: int, update, bit) -> object:
    from flwr.app import Message, MessageType, RecordDict

    metrics = {"partition-id": node - 1, "num-examples": 5}
    if bit is not None:
        metrics[WITHIN_CLIPPING_NORM] = bit
    content = RecordDict({"arrays": record({W: update}), "metrics": metrics_of(metrics)})
    return from_node(Message(content=content, dst_node_id=0,
                             message_type=MessageType.TRAIN), node)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("bit,reason", [
    (None, f"missing {WITHIN_CLIPPING_NORM}"),
    (2, "must be an integer (not a bool) in [0, 1], got 2"),
    (-1, "got -1"), (True, "got True"), (0.5, "got 0.5"), ([1], "a list of 1 values"),
    ("1", "got '1'"),
])
def test_a_reply_without_a_valid_bit_is_dropped_with_a_reason(bit, reason):
    server = adaptive_server()
    bad = bit_reply(1, f32(0.3, 0.4), bit)
    assert reason in server.check_reply(bad)
    good = [bit_reply(n, f32(0.3, 0.4), 1) for n in (2, 3, 4)]
    arrays, metrics = server.aggregate_train(1, [bad, *good])
    assert server.report.accepted == 3 and arrays is not None
    # Three bits of 1 over qK = 4: b̃ = 1/2 + 1.5/4; C moves by exp(−0.2 (b̃ − 1/2)).
    assert metrics["dp-unclipped-fraction"] == 0.875
    assert server.release.clipping_norm == pytest.approx(math.exp(-0.2 * 0.375))


@pytest.mark.usefixtures("task_identity")
def test_under_server_clipping_the_server_computes_the_bits_itself():
    server = adaptive_server(clip_on_server=True)
    assert server.check_reply(bit_reply(1, f32(3.0, 4.0), None)) is None  # not read
    updates = [f32(3.0, 4.0), f32(0.3, 0.4), f32(0.0, 0.1), f32(6.0, 8.0)]  # norms 5, .5, .1, 10
    arrays, metrics = server.aggregate_train(1, [bit_reply(n, u, 1) for n, u in
                                                 enumerate(updates, 1)])
    assert metrics["dp-unclipped-fraction"] == 0.5  # two of four within C = 1
    np.testing.assert_allclose(arrays_of(arrays)[W], [(0.6 + 0.3 + 0.0 + 0.6) / 4,
                                                      (0.8 + 0.4 + 0.1 + 0.8) / 4], rtol=1e-6)
    assert server.release.clipping_norm == 1.0


@pytest.mark.usefixtures("task_identity")
def test_a_fixed_clipping_norm_sends_no_norm_and_reads_no_bit():
    server = PersonalizedFedAvg(shared_keys=[W], num_partitions=2, drift_keys=[W],
                                privacy=Privacy(1.0, 0.0, steps=2))
    config = ConfigRecord()
    server.configure_train(1, record({W: f32(0.0, 0.0)}), config, FakeGrid([1, 2]))
    assert CLIPPING_NORM not in config
    assert server.check_reply(reply({W: f32(0.3, 0.4)}, node=1, **{"num-examples": 5})) is None
    assert CLIPPING_NORM_STATE not in server.state_dict()


@pytest.mark.usefixtures("task_identity")
def test_the_checkpoint_keeps_c_t():
    server = adaptive_server()
    server.aggregate_train(1, [bit_reply(n, f32(0.3, 0.4), 1) for n in (1, 2, 3, 4)])
    state = json.loads(json.dumps(server.state_dict()))  # as checkpoint.json holds it
    resumed = adaptive_server()
    resumed.load_state_dict(state, 1)
    assert resumed.release.clipping_norm == server.release.clipping_norm != 1.0
    config = ConfigRecord()
    resumed.configure_train(2, record({W: f32(0.0, 0.0)}), config, FakeGrid([1, 2, 3, 4]))
    assert config[CLIPPING_NORM] == server.release.clipping_norm


# ---------------------------------------------------------------- smoothing u_bar
def smoothed_server(beta: float, clients: int = 4) -> FedSPC:
    server = FedSPC(corrected_keys=[W], learning_rate=0.5, shared_keys=[W],
                    num_partitions=clients, drift_keys=[W],
                    privacy=Privacy(10.0, 0.0, steps=2, reference_smoothing=beta))
    server.global_reference = {W: f32(1.0, -1.0)}
    server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid(range(1, clients + 1)))
    return server


@pytest.mark.usefixtures("task_identity")
def test_smoothing_by_hand():
    """q = 1, E η = 1: Algorithm 1's u_bar from the release is −Δ̃/(E η); smoothed at
    β = 0.25 it is 0.25 u_bar_old + 0.75 of that."""
    updates = [f32(0.4, 0.0), f32(0.0, 0.8), f32(0.4, 0.4), f32(0.0, 0.0)]
    replies = [reply({W: u}, node=n, **{"num-examples": 5, "shared-steps": 2})
               for n, u in enumerate(updates, 1)]
    plain, smoothed = smoothed_server(0.0), smoothed_server(0.25)
    plain.aggregate_train(1, replies)
    smoothed.aggregate_train(1, replies)
    new = -np.array([0.8 / 4, 1.2 / 4])  # −Δ̃/(E η) with E η = 1
    np.testing.assert_allclose(plain.global_reference[W], new, rtol=1e-6)
    np.testing.assert_allclose(smoothed.global_reference[W],
                               0.25 * np.array([1.0, -1.0]) + 0.75 * new, rtol=1e-6)
    assert smoothed.global_reference[W].dtype == np.float32
    # The checkpoint holds the smoothed u_bar; a resumed strategy broadcasts it.
    resumed = smoothed_server(0.25)
    resumed.load_state_dict(smoothed.state_dict(), 1, global_reference=smoothed.state_arrays())
    assert resumed.global_reference[W].tobytes() == smoothed.global_reference[W].tobytes()


@pytest.mark.parametrize("q", [1.0, 0.3])
@pytest.mark.parametrize("beta", [0.5, 0.8])
def test_smoothing_scales_the_stationary_noise_variance_as_derived(q, beta):
    """u_bar_t = β u_bar_{t−1} + (1 − β)((1 − q) u_bar_{t−1} + q x_t) on i.i.d. noise
    x_t: the stationary variance is (1−β)(2−q)/(2−(1−β)q) times Algorithm 1's
    (β = 0), (1−β)/(1+β) at q = 1 (docs/privacy.md). The x_t of dp-reference = "level"
    are such fresh estimates; the increment's contain u_bar and walk instead
    (tests/test_privacy_level.py)."""
    noise = np.random.default_rng(58).normal(size=(30_000, 32))

    def stationary_variance(b: float) -> float:
        u, kept = np.zeros(32), []
        for t, x in enumerate(noise):
            u = mechanism.smooth({W: u}, {W: (1 - q) * u + q * x}, b)[W].astype(np.float64)
            if t >= 1000:
                kept.append(u)
        return float(np.var(np.array(kept)))

    factor = stationary_variance(beta) / stationary_variance(0.0)
    expected = (1 - beta) * (2 - q) / (2 - (1 - beta) * q)
    assert factor == pytest.approx(expected, rel=0.05)
    if q == 1.0:
        assert expected == pytest.approx((1 - beta) / (1 + beta))


# -------------------------------------------------------------------- real runs
@pytest.mark.usefixtures("task_identity")
def test_a_run_with_adaptive_clipping_reports_c_t_and_the_fixed_c_account(tmp_path):
    dp = {"dp-clipping-norm": 0.05, "dp-noise-multiplier": 0.2, "num-rounds": 3,
          "dp-clipping-quantile": 0.5, "dp-clipping-lr": 0.5}
    grid, rounds = run(tmp_path, "adaptive", **dp)
    norms = [r["dp-clipping-norm"] for r in rounds]
    fractions = [r["dp-unclipped-fraction"] for r in rounds]
    assert norms[0] == 0.05
    for t in range(2):  # C_{t+1} = C_t exp(−η_C (b̃_t − γ))
        assert norms[t + 1] == pytest.approx(norms[t] * math.exp(-0.5 * (fractions[t] - 0.5)))
    sent = [m.content.config_records["config"][CLIPPING_NORM] for m in grid.sent
            if m.metadata.message_type == "train"]
    assert sorted(set(sent)) == sorted(set(norms))
    # Each client clipped to the round's C_t, and its bit says whether it had to.
    replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(replies) == 3 * 3
    for server_round, norm in enumerate(norms, 1):
        start = broadcast(grid, server_round)
        for message in replies[3 * (server_round - 1):3 * server_round]:
            final = from_record(message.content.array_records[ARRAYS])
            moved = mechanism.update_norm(final, start, list(start))
            bit = message.content.metric_records["metrics"][WITHIN_CLIPPING_NORM]
            assert moved <= norm * (1 + 1e-5)
            assert bit == 1 or moved == pytest.approx(norm, rel=1e-4)
    # The account is the fixed-C run's of multiplier σ (the noise was split).
    assert [r["dp-epsilon"] for r in rounds] == [
        pytest.approx(dp_account.epsilon(0.2, 1.0, t, 1e-5), rel=1e-12) for t in (1, 2, 3)]
    privacy = json.loads((tmp_path / "adaptive" / "config.json").read_text())["privacy"]
    adaptive = privacy["adaptive-clipping"]
    assert adaptive["count-stddev"] == pytest.approx(0.15)  # qK/20 with qK = 3
    assert adaptive["update-noise-multiplier"] == pytest.approx((25 - 1 / 0.09) ** -0.5)


@pytest.mark.usefixtures("task_identity")
def test_a_resumed_run_continues_c_t_and_the_smoothed_u_bar(tmp_path, monkeypatch):
    """Crashed in round 2's evaluation (after its checkpoint), the resumed run ends as
    the uninterrupted one: the same C_t, b̃ and u_bar norms."""
    secrets_from(monkeypatch, [4242, 4242, 2 ** 90])
    expected, resumed = crash_and_resume(tmp_path, {
        "local_steps": 3, "dp_clipping_norm": 0.05, "dp_noise_multiplier": 0.1,
        "dp_clipping_quantile": 0.5, "dp_clipping_lr": 0.5, "dp_reference_smoothing": 0.5})
    for key in ("dp-clipping-norm", "dp-unclipped-fraction", "accuracy"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in expected], key
    assert len({r["dp-clipping-norm"] for r in expected}) == 3  # C moved every round
    assert [r.get("global-reference-norm") for r in resumed] == pytest.approx(
        [r.get("global-reference-norm") for r in expected], rel=1e-4)
