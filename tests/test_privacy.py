"""Client-level differential privacy of the shared block: clipping, noise, u_bar from
the privatized aggregate, the privacy account, and fixed local steps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from inprocess import InProcessGrid, run_server
from test_strategies import FakeGrid, arrays_of, f32, record, reply

from fedspc_app import client_app
from fedspc_app.core import dp_mechanism as mechanism
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.dp_mechanism import add_noise, clip_update, noise_std, update_norm
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE
from fedspc_app.core.records import from_record
from fedspc_app.runs import dp_account
from fedspc_app.training.loop import train_epochs
from strategies import PersonalizedFedAvg, Privacy

W, B = "w", "b"


# ------------------------------------------------------------ clipping and noise
def test_clipping_by_hand_and_an_update_within_the_norm_is_left_alone():
    start = {W: f32(1.0, 1.0), B: f32(5.0)}
    final = {W: f32(4.0, 5.0), B: f32(7.0)}  # update of W: (3, 4), norm 5
    clipped = clip_update(final, start, [W], 1.0)
    np.testing.assert_allclose(clipped[W], [1.6, 1.8], rtol=1e-6)
    assert clipped[B] is final[B]  # not a clipped key
    assert update_norm(clipped, start, [W]) == pytest.approx(1.0, rel=1e-6)
    for norm in (5.0, math.inf):
        assert clip_update(final, start, [W], norm)[W].tobytes() == final[W].tobytes()


def noise_of(secret, server_round):
    return mechanism.secret_generator(secret, server_round, mechanism.NOISE)


def test_the_noise_has_the_calibrated_standard_deviation():
    std = noise_std(2.0, 0.5, 4)  # sigma C / (q K)
    assert std == pytest.approx(0.25)
    zeros = {W: np.zeros(200_000, dtype=np.float32)}
    secret = mechanism.new_secret()
    noised = add_noise(zeros, [W], std, noise_of(secret, 1))[W]
    assert noised.std() == pytest.approx(0.25, rel=0.01) and abs(noised.mean()) < 0.005
    again = add_noise(zeros, [W], std, noise_of(secret, 1))[W]
    assert again.tobytes() == noised.tobytes()  # the same secret: a resumed run's
    other = add_noise(zeros, [W], std, noise_of(secret, 2))[W]
    assert abs(np.corrcoef(other, noised)[0, 1]) < 0.01  # another round: fresh noise
    assert add_noise(zeros, [W], 0.0, noise_of(secret, 1))[W] is zeros[W]


@pytest.mark.usefixtures("task_identity")
def test_server_clipping_bounds_every_update_the_aggregate_sees():
    broadcast = {W: f32(0.0, 0.0), B: f32(0.0)}
    server = PersonalizedFedAvg(shared_keys=[W, B], num_partitions=3, drift_keys=[W, B],
                                privacy=Privacy(1.0, 0.0, steps=4, clip_on_server=True))
    server.configure_train(1, record(broadcast), ConfigRecord(), FakeGrid([1, 2, 3]))
    updates = [{W: f32(3.0, 4.0), B: f32(0.0)}, {W: f32(0.3, 0.4), B: f32(0.0)},
               {W: f32(0.0, 0.0), B: f32(-10.0)}]
    arrays, metrics = server.aggregate_train(1, [
        reply(u, node=n, **{"num-examples": 5}) for n, u in enumerate(updates, 1)])
    # Clipped to norm 1: (0.6, 0.8, 0), (0.3, 0.4, 0), (0, 0, -1); their mean.
    out = arrays_of(arrays)
    np.testing.assert_allclose(out[W], [0.3, 0.4], rtol=1e-6)
    np.testing.assert_allclose(out[B], [-1 / 3], rtol=1e-6)
    # Only the released aggregate's norm: no per-client figure.
    assert "update-norm" in metrics and "client-update-norms" not in metrics
    assert "drift-dispersion" not in metrics


@pytest.mark.parametrize("overrides,message", [
    ({}, "'local-steps' > 0"),
    ({"local-steps": 2, "aggregation": "weighted"}, "'aggregation' = 'mean'"),
    ({"local-steps": 2, "aggregation": "median"}, "'aggregation' = 'mean'"),
    ({"local-steps": 2, "fedspc-upload": "explicit"}, "'fedspc-upload' = 'derived'"),
    ({"local-steps": 2, "dp-clipping-norm": math.inf, "dp-noise-multiplier": 1.0},
     "finite 'dp-clipping-norm'"),
])
def test_what_differential_privacy_cannot_honour_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({"dp-clipping-norm": 1.0, **overrides})
    with pytest.raises(ConfigError, match="need 'dp-clipping-norm' > 0"):
        parse_run_config({"dp-noise-multiplier": 1.0})


# ------------------------------------------------------------------- accounting
def classic_epsilon(sigma: float, rounds: int, delta: float) -> float:
    """The Gaussian mechanism composed ``rounds`` times, by hand: RDP of order a is
    rounds * a / (2 sigma^2), turned into (epsilon, delta) by the conversion of Balle
    et al. (2020), minimised over the integer orders 2..256."""
    best = math.inf
    for a in range(2, 257):
        rdp = rounds * a / (2 * sigma ** 2)
        eps = rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize("sigma,rounds", [(1.0, 1), (2.0, 20), (0.8, 5)])
def test_the_account_of_full_participation_is_the_gaussian_mechanisms(sigma, rounds):
    assert dp_account.epsilon(sigma, 1.0, rounds, 1e-5) == pytest.approx(
        classic_epsilon(sigma, rounds, 1e-5), rel=1e-9)


def test_sampling_amplifies_and_a_target_allows_the_rounds_that_stay_under_it():
    full, sampled = (dp_account.epsilon(1.0, q, 20, 1e-5) for q in (1.0, 0.3))
    assert sampled < full and dp_account.epsilon(0.0, 1.0, 1, 1e-5) == math.inf
    allowed = dp_account.rounds_within(5.0, 1.0, 0.3, 1e-5, 1000)
    assert dp_account.epsilon(1.0, 0.3, allowed, 1e-5) <= 5.0
    assert dp_account.epsilon(1.0, 0.3, allowed + 1, 1e-5) > 5.0
    assert dp_account.rounds_within(1e6, 1.0, 0.3, 1e-5, 7) == 7


# ------------------------------------------------------------------ local steps
def test_local_steps_take_exactly_that_many_steps_passing_over_the_data_again():
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))] * 2  # 2 batches a pass

    def batches():
        return iter(data)

    result = train_epochs(model, batches, epochs=1, trainable=["weight", "bias"],
                          learning_rate=0.1, max_steps=5)
    assert result.steps == 5 and result.examples == 20
    assert train_epochs(model, batches, epochs=1, trainable=["weight"],
                        learning_rate=0.1).steps == 2


# ------------------------------------------------------------ in real runs
K = 3


def run(tmp, name, **overrides):
    config = {"method": "fedavg", "num-rounds": 2, "batch-size": 32, "alpha": 1.0,
              "local-steps": 3, "checkpoint": False, "output-dir": str(tmp),
              "run-name": name, **overrides}
    grid = InProcessGrid(client_app.app, K, config)
    error = run_server(grid, config)
    assert error is None, error
    return grid, json.loads((tmp / name / "metrics.json").read_text())["rounds"]


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_no_noise_and_no_clipping_reproduce_the_run_without_privacy_bit_for_bit(tmp_path,
                                                                                method):
    _, plain = run(tmp_path, "plain", method=method)
    _, private = run(tmp_path, "private", method=method, **{
        "dp-clipping-norm": math.inf, "dp-noise-multiplier": 0.0})
    for a, b in zip(plain, private):  # (no train loss is written under privacy)
        for key in ("accuracy", "loss", "weighted-accuracy"):
            assert a[key] == b[key], key


def test_u_bar_releases_the_noised_aggregate_not_the_clean_mean(tmp_path):
    """The leak test: with u_bar^0 = 0 and every client sampled, -E eta u_bar^1 is the
    round's aggregate update. Without privacy that is the clients' clean mean update;
    with it, the noised one the model received, and not the clean mean."""
    eta, steps = 0.02, 3

    def round_one(name, **dp):
        grid, _ = run(tmp_path, name, method="fedrep", fedspc=True, **dp)
        trains = [m for m in grid.sent if m.metadata.message_type == "train"]
        first = [m for m in trains if m.content.config_records["config"]["server-round"] == 1]
        second = [m for m in trains if m.content.config_records["config"]["server-round"] == 2]
        theta0 = from_record(first[0].content.array_records[ARRAYS])
        theta1 = from_record(second[0].content.array_records[ARRAYS])
        u_bar1 = from_record(second[0].content.array_records[GLOBAL_REFERENCE])
        replies = [r for r in grid.replies if r.metadata.message_type == "train"][:K]
        clean = {k: np.mean([from_record(r.content.array_records[ARRAYS])[k] - theta0[k]
                             for r in replies], axis=0) for k in u_bar1}
        released = {k: -steps * eta * u_bar1[k] for k in u_bar1}
        return released, {k: theta1[k] - theta0[k] for k in u_bar1}, clean

    released, step, clean = round_one("open")
    for key in released:
        np.testing.assert_allclose(released[key], clean[key], rtol=1e-4, atol=1e-7)
    released, step, clean = round_one("private", **{
        "dp-clipping-norm": 10.0, "dp-noise-multiplier": 0.5})
    for key in released:
        np.testing.assert_allclose(released[key], step[key], rtol=1e-4, atol=1e-6)
    gap = max(float(np.abs(released[k] - clean[k]).max()) for k in released)
    assert gap > 1e-3  # the clean mean is not what u_bar gives away


def test_the_account_is_reported_each_round_and_a_target_ends_the_run_early(tmp_path):
    # sigma 0.1 over 3 clients: a large epsilon, and noise the CNN can learn through.
    dp = {"dp-clipping-norm": 0.5, "dp-noise-multiplier": 0.1, "num-rounds": 3}
    _, rounds = run(tmp_path, "eps", **dp)
    assert [r["dp-epsilon"] for r in rounds] == [
        pytest.approx(dp_account.epsilon(0.1, 1.0, t, 1e-5)) for t in (1, 2, 3)]
    assert all(not r.get("failed") for r in rounds)
    target = (dp_account.epsilon(0.1, 1.0, 2, 1e-5) + dp_account.epsilon(0.1, 1.0, 3, 1e-5)) / 2
    _, rounds = run(tmp_path, "budget", **dp, **{"dp-target-epsilon": target})
    summary = json.loads((tmp_path / "budget" / "summary.json").read_text())
    assert len(rounds) == 2 and summary["complete"] and summary["rounds"] == 2
    assert "dp-target-epsilon" in summary["stopped-by"]
    assert summary["dp-epsilon"] == pytest.approx(rounds[-1]["dp-epsilon"])
    config = json.loads((tmp_path / "budget" / "config.json").read_text())
    assert config["privacy"]["rounds"] == 2


def test_under_privacy_the_shared_buffers_stay_with_each_client():
    from fedspc_app.core.methods import get_method
    from fedspc_app.data.run_data import KNOWN_SHAPES
    from fedspc_app.models.run_model import make_model
    from fedspc_app.models.split import parameter_split

    config = parse_run_config({"model": "resnet18", "model-width": 0.25,
                               "dataset": "cifar10"})
    model = make_model(config, KNOWN_SHAPES["cifar10"])
    plain = parameter_split(model, get_method("fedrep"))
    private = parameter_split(model, get_method("fedrep"), local_buffers=True)
    buffers = {key for key in plain.shared if key not in plain.parameters}
    assert buffers and any("running_var" in key for key in buffers)
    assert set(private.shared) == set(plain.shared) - buffers
    assert set(private.personal) == set(plain.personal) | buffers
    assert private.corrected == plain.corrected  # the released parameters are the same
