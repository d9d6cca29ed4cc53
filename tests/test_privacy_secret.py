"""Differential privacy against someone who reads the run-config and the results: the
noise and the training draws come from a secret of the server, the account is
dp_accounting's for what the server actually does, and runs without privacy draw as
they always did."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType
from test_faults import Crash, Crashing
from test_faults import run as fault_run
from test_privacy import run
from test_strategies import FakeGrid, arrays_of, f32, from_node, record, reply

from fedspc_app.core import dp_mechanism as mechanism
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import Method, Phase, get_method
from fedspc_app.core.protocol import ARRAYS
from fedspc_app.core.records import from_record
from fedspc_app.models.split import ParameterSplit
from fedspc_app.runs import dp_account
from fedspc_app.server_app import build_strategy, private_steps
from strategies import FedSPC, PersonalizedFedAvg, Privacy
from strategies.personalized import DP_SECRET, PRIVATE_DROPPED
from strategies.sampling import PartitionSampler

W = "w"
SIGMA, CLIP = 0.5, 10.0  # a large C: the CNN's clipped updates are their own


# ------------------------------------------------------------- the attacker's tries
def public_integers(tree) -> set[int]:
    """Every integer (and integral float) in a JSON tree: what a reader of config.json
    could seed a generator with."""
    if isinstance(tree, dict):
        return set().union(*map(public_integers, tree.values()), set())
    if isinstance(tree, list):
        return set().union(*map(public_integers, tree), set())
    if isinstance(tree, bool):
        return {int(tree)}
    if isinstance(tree, int):
        return {tree} if tree >= 0 else set()
    if isinstance(tree, float) and tree.is_integer() and 0 <= tree < 2 ** 63:
        return {int(tree)}
    return set()


def guessed_noise(seeds: set[int], server_round: int, size: int):
    """Standard normal draws of every generator an attacker would seed from the
    public integers and the round (the noise divided by its public std)."""
    for seed in sorted(seeds):
        for entropy in ([seed, server_round], [server_round, seed], seed, server_round,
                        seed + server_round, [seed, server_round, 0]):
            yield np.random.default_rng(entropy).normal(size=size)
        yield np.random.RandomState(seed).normal(size=size)
        yield np.random.RandomState(seed + server_round).normal(size=size)
        for purpose in (mechanism.NOISE, mechanism.SAMPLE):  # this code, seed for secret
            yield mechanism.secret_generator(seed, server_round, purpose).normal(size=size)


def recovered_by_attack(noise: np.ndarray, seeds: set[int], server_round: int,
                        size: int = 2000) -> bool:
    """Whether one of the guesses is the start of ``noise`` (its correlation with it
    is near 1; an unrelated draw's is near 0, within 4/sqrt(size) or so)."""
    start = noise.ravel().astype(np.float64)[:size]
    return any(abs(np.corrcoef(start, guess)[0, 1]) > 0.5
               for guess in guessed_noise(seeds, server_round, start.size))


def round_one_noise(grid, num_clients: int) -> dict[str, np.ndarray]:
    """The noise the server added in round 1: the shared block it sent for round 1's
    evaluation minus the mean of the clipped replies (every client drawn, q = 1)."""
    sent = [m for m in grid.sent if m.content.config_records["config"]["server-round"] == 1]
    theta1 = from_record(next(m for m in sent
                              if m.metadata.message_type == MessageType.EVALUATE)
                         .content.array_records[ARRAYS])
    replies = [from_record(r.content.array_records[ARRAYS]) for r in grid.replies
               if r.metadata.message_type == MessageType.TRAIN][:num_clients]
    assert len(replies) == num_clients
    return {k: theta1[k].astype(np.float64)
            - np.mean([r[k].astype(np.float64) for r in replies], axis=0) for k in theta1}


def test_the_attack_recovers_noise_seeded_from_the_run_config():
    """The attack has teeth: noise drawn as before (default_rng([seed, round])) is
    found from config.json's integers."""
    zeros = {W: np.zeros(5000, dtype=np.float32)}
    old = mechanism.add_noise(zeros, [W], 0.3, np.random.default_rng([0, 1]))[W]
    assert recovered_by_attack(old / 0.3, {0, 3, 7}, 1)
    fresh = mechanism.add_noise(zeros, [W], 0.3, mechanism.secret_generator(
        mechanism.new_secret(), 1, mechanism.NOISE))[W]
    assert not recovered_by_attack(fresh / 0.3, {0, 3, 7}, 1)


def test_the_noise_is_secret_and_differs_between_runs_of_one_seed(tmp_path):
    dp = {"num-rounds": 1, "dp-clipping-norm": CLIP, "dp-noise-multiplier": SIGMA,
          "checkpoint": True}
    noises, secrets = [], []
    for name in ("one", "two"):
        grid, _ = run(tmp_path, name, **dp)
        folder = tmp_path / name
        config = json.loads((folder / "config.json").read_text())
        std = config["privacy"]["noise-std"]
        assert std == pytest.approx(SIGMA * CLIP / 3)
        noise = round_one_noise(grid, 3)
        flat = np.concatenate([v.ravel() for v in noise.values()])
        assert flat.std() == pytest.approx(std, rel=0.05)  # the noise is there ...
        public = public_integers(config) | public_integers(
            json.loads((folder / "metrics.json").read_text()))
        assert 0 in public  # the run seed
        # ... and no guess draws it (key by key in the published order of the release,
        # as a generator would).
        released = config["privacy"]["shared-keys-released"]
        assert set(released) == set(noise)
        in_order = np.concatenate([noise[key].ravel() for key in released])
        assert not recovered_by_attack(in_order / std, public, 1)
        noises.append(flat)
        secret = json.loads((folder / "checkpoint.json").read_text())["strategy"][DP_SECRET]
        secrets.append(secret)
        # The secret is in the checkpoint only: not in any other file, nor any message.
        for path in folder.rglob("*"):
            if path.is_file() and not path.name.startswith("checkpoint"):
                text = path.read_bytes().decode("latin-1")
                assert secret not in text and str(int(secret, 16)) not in text, path
        for message in grid.sent:
            for records in (message.content.config_records, message.content.metric_records):
                assert not any(secret in str(dict(r)) or str(int(secret, 16)) in str(dict(r))
                               for r in records.values())
    assert secrets[0] != secrets[1]
    assert abs(np.corrcoef(*noises)[0, 1]) < 0.05  # the same seed, unrelated noise


def secrets_from(monkeypatch, values):
    """Let the server's secrets be ``values``, one a run, in order."""
    supply = iter(values)
    monkeypatch.setattr("strategies.personalized.new_secret", lambda: next(supply))


def crash_and_resume(tmp_path: Path, overrides: dict) -> tuple[list, list]:
    """The rounds of a run of ``overrides`` (checkpointed), and of the same run crashed
    in round 2's evaluation (after its checkpoint) and resumed."""
    overrides = {"checkpoint": True, **overrides}

    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = 10
        return grid

    _, expected, _ = fault_run(tmp_path / "a", **overrides)
    with pytest.raises(Crash):
        fault_run(tmp_path / "b", grid_type=crashing, **overrides)
    _, resumed, error = fault_run(tmp_path / "b", resume=True, **overrides)
    assert error is None
    return expected, resumed


def test_a_resumed_run_draws_the_noise_of_the_uninterrupted_one(tmp_path, monkeypatch):
    """Crashed in round 2's evaluation (after its checkpoint), the resumed run takes the
    secret from the checkpoint: it ends as the uninterrupted run of that secret does,
    although a fresh secret would be 2**100 for it."""
    secrets_from(monkeypatch, [12345, 12345, 2 ** 100])
    expected, resumed = crash_and_resume(tmp_path, {
        "method": "fedrep", "fedspc": True, "local_steps": 3, "dp_clipping_norm": 0.5,
        "dp_noise_multiplier": 0.1, "fraction_train": 0.67})
    assert [r.get("train-clients") for r in resumed] == [
        r.get("train-clients") for r in expected]  # the same secret draws
    assert [r.get("accuracy") for r in resumed] == [r.get("accuracy") for r in expected]
    assert [r.get("global-reference-norm") for r in resumed] == pytest.approx(
        [r.get("global-reference-norm") for r in expected], rel=1e-4)
    assert [r["dp-epsilon"] for r in resumed] == [r["dp-epsilon"] for r in expected]


# ------------------------------------------------------------------ the draws
def test_without_privacy_the_draws_are_the_seeded_ones_of_before():
    sampler = PartitionSampler(10, seed=0)
    assert [sampler.draw(r, 0.3, "train") for r in (1, 2, 3)] == [
        [2, 3, 7], [0, 2, 6], [0, 5, 7]]
    assert PartitionSampler(10, seed=7).draw(4, 0.5, "evaluate") == [1, 4, 5, 6, 7]
    assert sampler.draw(5, 1.0, "train") == list(range(10))


def test_under_privacy_the_draw_is_poisson_at_the_accounted_rate_and_not_the_seeds():
    rate, clients, rounds = 0.3, 10, 3000
    # Fixed secrets (a draw of new_secret() each, written down): the statistics below
    # hold at about 4 standard errors, which a random secret would miss now and then.
    sampler = PartitionSampler(clients, seed=0)
    sampler.secret = 0x8F3A_51C2_9D07_E6B4_2C81_7F5E_A903_D46B
    draws = [sampler.draw(r, rate, MessageType.TRAIN) for r in range(1, rounds + 1)]
    drawn = np.zeros((rounds, clients))
    for row, draw in zip(drawn, draws):
        row[draw] = 1
    # Each client independently at q: its frequency, and no pairing between clients.
    spread = 4 * np.sqrt(rate * (1 - rate) / rounds)
    assert np.all(np.abs(drawn.mean(axis=0) - rate) < spread)
    pairs = np.corrcoef(drawn.T)[np.triu_indices(clients, 1)]
    assert np.all(np.abs(pairs) < 4 / np.sqrt(rounds))
    sizes = drawn.sum(axis=1)  # not a fixed count: Poisson, empty draws included
    assert sizes.var() == pytest.approx(clients * rate * (1 - rate), rel=0.15)
    assert (sizes == 0).any()
    # The seeded draw of before does not predict it, nor does another secret.
    seeded = PartitionSampler(clients, seed=0)
    assert sum(d == seeded.draw(r, rate, "train") for r, d in enumerate(draws, 1)) < 0.05 * rounds
    other = PartitionSampler(clients, seed=0)
    other.secret = 0x1D6E_C470_3B95_82AF_F06C_2E19_5A7D_B318
    assert sum(d == other.draw(r, rate, "train") for r, d in enumerate(draws, 1)) < 0.05 * rounds
    assert [sampler.draw(r, rate, "train") for r in (1, 2)] == draws[:2]  # reproducible
    assert sampler.draw(1, 1.0, "train") == list(range(clients))  # q = 1: everyone
    assert sampler.draw(1, rate, "evaluate") == seeded.draw(1, rate, "evaluate")


# ------------------------------------------------------------ the released sum
def private_server(fraction: float, clients: int, sigma: float, clip: float = 1.0):
    return PersonalizedFedAvg(shared_keys=[W], num_partitions=clients, drift_keys=[W],
                              fraction_train=fraction,
                              privacy=Privacy(clip, sigma, steps=4, clip_on_server=True))


@pytest.mark.usefixtures("task_identity")
def test_the_release_is_the_sum_over_qk_whoever_replies():
    server = private_server(1.0, 4, 0.0)
    server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    updates = [f32(0.3, 0.4), f32(0.0, 0.5), f32(3.0, 4.0)]  # the last is clipped to 1

    def release(count):
        arrays, _ = server.aggregate_train(1, [reply({W: u}, node=n, **{"num-examples": 5})
                                               for n, u in enumerate(updates[:count], 1)])
        return arrays_of(arrays)[W].astype(np.float64)

    # Three of four replied: the sum over q K = 4, not their mean.
    np.testing.assert_allclose(release(3), [(0.3 + 0.0 + 0.6) / 4, (0.4 + 0.5 + 0.8) / 4],
                               rtol=1e-6)
    # One more client moves the release by its clipped update over q K: at most C / 4.
    moved = np.linalg.norm(release(3) - release(2))
    assert moved == pytest.approx(1.0 / 4, rel=1e-5)


@pytest.mark.usefixtures("task_identity")
def test_u_bar_under_privacy_is_post_processing_of_the_release_with_qk_for_m():
    """ū' = (1 − q) ū − q Δ̃/(E η): with q = 1 and three of four clients replying, ū
    drops out (Algorithm 1 with m replies would keep (1 − m/K) ū = ū/4 of it)."""
    eta, steps = 0.5, 2
    server = FedSPC(corrected_keys=[W], learning_rate=eta, shared_keys=[W],
                    num_partitions=4, drift_keys=[W],
                    privacy=Privacy(10.0, 0.0, steps=steps))
    server.global_reference = {W: f32(1.0, -1.0)}
    server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    updates = [f32(0.4, 0.0), f32(0.0, 0.8), f32(0.4, 0.4)]
    arrays, _ = server.aggregate_train(1, [
        reply({W: u}, node=n, **{"num-examples": 5, "shared-steps": steps})
        for n, u in enumerate(updates, 1)])
    released = arrays_of(arrays)[W].astype(np.float64)
    np.testing.assert_allclose(released, [0.8 / 4, 1.2 / 4], rtol=1e-6)
    np.testing.assert_allclose(server.global_reference[W], -released / (steps * eta),
                               rtol=1e-6)


@pytest.mark.usefixtures("task_identity")
def test_an_empty_poisson_draw_releases_the_noise_alone():
    server = private_server(0.01, 3, 2.0)  # q K = 0.03
    # The draw is secret and random: one in 33 secrets draws someone in round 1. This
    # secret (a fixed one, so the test cannot flake) draws nobody.
    server.use_secret(0)
    server.configure_train(1, record({W: np.zeros(100_000, dtype=np.float32)}),
                           ConfigRecord(), FakeGrid([1, 2, 3]))
    assert server.sampled == 0
    arrays, metrics = server.aggregate_train(1, [])
    assert arrays is not None and not server.report.failed and server.report.accepted == 0
    assert "clients" not in metrics  # under privacy the count is withheld
    assert arrays_of(arrays)[W].std() == pytest.approx(2.0 * 1.0 / 0.03, rel=0.02)


# ---------------------------------------------------------------- E under privacy
def test_under_privacy_e_is_the_expected_shared_steps_of_the_method():
    config = parse_run_config({"local-steps": 3, "dp-clipping-norm": 1.0,
                               "dp-noise-multiplier": 1.0})
    split = ParameterSplit(body=("w",), head=(), shared=("w",), personal=(),
                           parameters=frozenset({"w"}))
    twice = Method("twice", "all", (Phase(train="all", epochs="local_epochs"),) * 2)
    assert private_steps(twice, config, split, [10, 500]) == 6  # local-steps x 2 phases
    assert build_strategy(config, twice, split, 2, [10, 500]).privacy.steps == 6
    assert build_strategy(config, get_method("fedavg"), split, 2).privacy.steps == 3
    by_epochs = dataclasses.replace(config, local_steps=0)  # what the config refuses
    with pytest.raises(ConfigError, match="same number of shared steps"):
        private_steps(twice, by_epochs, split, [10, 500])


# ------------------------------------------------------------------- the account
def independent_epsilon(sigma: float, rate: float, rounds: int, delta: float,
                        accountant: str) -> float:
    import dp_accounting

    event = dp_accounting.GaussianDpEvent(sigma)
    if rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(rate, event)
    if accountant == "pld":
        account = dp_accounting.pld.PLDAccountant()
    else:
        account = dp_accounting.rdp.RdpAccountant(orders=list(range(2, 257)))
    return account.compose(dp_accounting.SelfComposedDpEvent(event, rounds)).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_the_reported_epsilon_is_dp_accountings_for_the_sampling_used(tmp_path, accountant):
    dp = {"dp-clipping-norm": 0.5, "dp-noise-multiplier": 0.8, "num-rounds": 3,
          "fraction-train": 0.67, "dp-accountant": accountant}
    _, rounds = run(tmp_path, accountant, **dp)
    assert [r["dp-epsilon"] for r in rounds] == [
        pytest.approx(independent_epsilon(0.8, 0.67, t, 1e-5, accountant), rel=1e-9)
        for t in (1, 2, 3)]
    config = json.loads((tmp_path / accountant / "config.json").read_text())["privacy"]
    assert config["adjacency"] == "add or remove one client (all of its data)"
    assert config["accountant"].startswith(f"dp_accounting {accountant.upper()}")
    assert "Poisson" in config["sampling"] and config["expected-clients"] == pytest.approx(2.01)
    # Sampling amplifies, and the PLD account is the tighter one.
    assert rounds[-1]["dp-epsilon"] < independent_epsilon(0.8, 1.0, 3, 1e-5, accountant)
    assert dp_account.epsilon(0.8, 0.67, 3, 1e-5, "pld") < dp_account.epsilon(0.8, 0.67, 3, 1e-5)


def test_an_unknown_accountant_is_refused():
    with pytest.raises(ConfigError, match="'dp-accountant'"):
        parse_run_config({"dp-accountant": "moments"})


def test_results_made_with_public_noise_say_so():
    results = Path(__file__).parent.parent / "docs" / "results"
    for name in ("cpu-cifar100-cnn-dp", "cpu-cifar100-cnn-dp-noise"):
        text = (results / name / "README.md").read_text()
        assert "public noise" in text, name


def test_under_privacy_no_client_and_no_result_names_who_took_part(tmp_path):
    """The sampling's amplification assumes the draws are secret: under privacy each
    message carries its own client's accepted round only, and neither metrics.json nor
    the reasons name the clients of a round. Without privacy both are there."""
    dp = {"num-rounds": 3, "dp-clipping-norm": CLIP, "dp-noise-multiplier": 0.001,
          "fraction-train": 0.67, "evaluate-before-aggregation": True}
    grid, rounds = run(tmp_path, "private", **dp)
    node_partition = {node: pid for pid, node in enumerate(grid.node_ids)}
    trained = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert trained
    for message in grid.sent:
        config = message.content.config_records["config"]
        accepted = list(config["accepted-rounds"])
        own = node_partition[message.metadata.dst_node_id]
        assert all(value == 0 for pid, value in enumerate(accepted) if pid != own)
    assert any(list(m.content.config_records["config"]["accepted-rounds"])
               [node_partition[m.metadata.dst_node_id]] > 0 for m in grid.sent)
    # Each of these names the round's clients, or is a sum of public per-client figures
    # (a partition's size fixes its images and steps) from which the draw can be solved;
    # the count, with colluders' own draws, tells whether another was drawn; and a
    # client's own accuracy moves when it was drawn (Ditto's personal model).
    withheld = ("train-client-ids", "client-accuracy-before-aggregation", "train-images",
                "images-per-second", "min-rounds-trained", "train-client-work-seconds",
                "train-client-setup-seconds", "train-clients", "train-dropped",
                "client-accuracy", "accuracy-before-aggregation", "train-loss")
    for row in rounds:
        assert not [key for key in withheld if key in row]
        assert "accuracy" in row
    _, plain = run(tmp_path, "plain", **{"num-rounds": 2, "evaluate-before-aggregation": True})
    assert [key for key in withheld if key not in plain[1]] == ["train-client-ids"]


@pytest.mark.usefixtures("task_identity")
def test_under_privacy_a_dropped_reply_does_not_say_whose_it_was():
    reasons = {}
    for private in (True, False):
        server = (private_server(1.0, 4, 0.0) if private else
                  PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W]))
        server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                               FakeGrid([1, 2, 3, 4]))
        good = reply({W: f32(0.1, 0.1)}, node=1, **{"num-examples": 5})
        bad = reply({W: f32(0.1, 0.1)}, node=2, **{"num-examples": 0})
        failed = from_node(Message(Error(code=0, reason="client 1 diverged in round 1"),
                                   reply_to=bad), 3)
        server.aggregate_train(1, [good, bad, failed])
        reasons[private] = server.report.reasons[:2]
    # Neither whose reply it was nor why (an error's text, or a count its partition
    # implies, can name the client), nor how many: one reason for the round.
    assert reasons[True] == [PRIVATE_DROPPED]
    assert reasons[False][0].startswith("node 2: 'num-examples'")
    assert reasons[False][1].startswith("node 3: client error: client 1 diverged")
