"""The tracked u_k on disk (strategies/references.py), the trimming floor and Krum's
scoring from streamed distances (strategies/aggregation.py), ``fedspc-reference =
"auto"`` (fedspc_app/core/config.py), and a checkpoint that writes and restores the
u_k one array at a time (fedspc_app/runs/checkpoint.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum
from inprocess import InProcessGrid
from test_durable import RUN_CONFIG, round_inputs, train_message
from test_reference_rule import run, server
from test_strategies import FakeGrid, arrays_of, f32, record, reply

from fedspc_app import client_app
from fedspc_app.client_app import server_kept_reference
from fedspc_app.core.config import RunConfig, resolved_settings, validate
from fedspc_app.core.deferred import Deferred
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.protocol import CLIENT_REFERENCE_RECORD
from fedspc_app.runs.checkpoint import Checkpoint, fingerprint, read_checkpoint, write_checkpoint
from strategies import AggregationRule, FedSPC, PersonalizedFedAvg
from strategies.aggregation import krum_choice, trimmed_mean
from strategies.references import PREFIX, ClientReferences

pytestmark = pytest.mark.usefixtures("task_identity")
SHAPES = {"conv.weight": (3, 2, 2), "conv.bias": (3,), "fc.weight": (4, 5)}
RULES = [AggregationRule("mean"), AggregationRule("median"),
         AggregationRule("trimmed-mean", trim_fraction=0.2),
         AggregationRule("trimmed-mean", trim_fraction=0.1, byzantine=2),
         AggregationRule("krum", byzantine=2), AggregationRule("multi-krum", byzantine=2),
         AggregationRule("multi-krum", byzantine=1, krum_select=3)]


def references(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
           for _ in range(count)]
    out[1] = {k: v * np.float32(60.0) for k, v in out[1].items()}  # a liar's u_k
    return out


def in_memory_centre(rule: AggregationRule, values: list[dict]) -> dict:
    """The client centre as the server computed it with every u_k in memory."""
    chosen = [values[i] for i in rule.selected(values, list(SHAPES))]
    return rule.combine(chosen, [1.0] * len(chosen))


# ------------------------------------------------------------ the rules themselves
@pytest.mark.parametrize("count", [3, 4, 5, 9, 10, 23])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.2, 0.45])
def test_the_trimmed_mean_by_count_is_flowers_bit_for_bit(count, fraction):
    values = np.random.default_rng(count).normal(size=(count, 7, 3)).astype(np.float32)
    ours = trimmed_mean(values, int(fraction * count))
    assert ours.tobytes() == trim_mean(values, fraction).tobytes()


def test_trimming_never_cuts_fewer_than_the_byzantine_clients():
    rule = AggregationRule("trimmed-mean", trim_fraction=0.2, byzantine=1)
    assert [rule.trim_count(n) for n in (3, 4, 5, 10, 12)] == [1, 1, 1, 2, 2]
    assert AggregationRule("trimmed-mean", trim_fraction=0.2).trim_count(4) == 0  # Flower's
    # Four replies, one a liar x50: Flower's floor(0.2 * 4) = 0 cuts nothing.
    values = [{"w": f32(v)} for v in (1.0, 1.1, 0.9, 50.0)]
    assert AggregationRule("trimmed-mean", trim_fraction=0.2).combine(
        values, [1.0] * 4)["w"][0] == pytest.approx(13.25)
    assert rule.combine(values, [1.0] * 4)["w"][0] == pytest.approx(1.05)
    assert rule.shortfall(3) is None and rule.shortfall(2) is not None
    # The median holds against fewer than half: with f = 3 it needs n > 6.
    median = AggregationRule("median", byzantine=3)
    assert median.shortfall(7) is None and median.shortfall(6) is not None
    assert AggregationRule("median").shortfall(2) is None  # f = 0: no floor
    # Half of an even n lying sets the median (a liar's 1e9 against 0.02):
    liars = [{"w": f32(v)} for v in (0.02, 0.02, 1e9, 1e9)]
    assert AggregationRule("median").combine(liars, [1.0] * 4)["w"][0] == pytest.approx(5e8)
    assert AggregationRule("median", byzantine=2).shortfall(4) is not None


def test_a_round_with_too_few_replies_to_cut_f_a_side_fails_with_the_reason():
    server = PersonalizedFedAvg(shared_keys=["w"], num_partitions=5, aggregation=AggregationRule(
        "trimmed-mean", trim_fraction=0.2, byzantine=2))
    server.configure_train(1, record({"w": f32(0.0)}), ConfigRecord(), FakeGrid(range(1, 6)))
    replies = [reply({"w": f32(v)}, node=n, **{"num-examples": 10})
               for n, v in enumerate((1.0, 1.1, 0.9, 50.0), start=1)]
    arrays, metrics = server.aggregate_train(1, replies)
    assert arrays is None and metrics is None and server.report.failed
    assert any("trimmed-mean cuts byzantine-clients = 2" in r for r in server.report.reasons)
    assert server.accepted_rounds == [0] * 5  # no client commits the round
    arrays, _ = server.aggregate_train(1, replies + [reply({"w": f32(1.05)}, node=5,
                                                           **{"num-examples": 10})])
    assert arrays_of(arrays)["w"][0] == pytest.approx(1.05)  # five: the middle one


def test_the_config_refuses_a_trimmed_mean_that_would_cut_every_client():
    with pytest.raises(ConfigError, match="leaves nothing of the 4 training clients"):
        validate(RunConfig(aggregation="trimmed-mean", byzantine_clients=2, num_clients=4))
    validate(RunConfig(aggregation="trimmed-mean", byzantine_clients=2, num_clients=5))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rule", [r for r in RULES if r.name in ("krum", "multi-krum")],
                         ids=lambda r: f"{r.name}-{r.byzantine}-{r.krum_select}")
def test_krum_from_a_distance_matrix_selects_as_flower(seed, rule):
    values = references(9, seed)
    flat = np.stack([np.concatenate([v[k].ravel() for k in SHAPES]) for v in values])
    distances = ((flat[:, None, :].astype(np.float64) - flat[None]) ** 2).sum(axis=2)
    assert krum_choice(distances, rule.byzantine, rule.krum_count(9)) == rule.selected(
        values, list(SHAPES))
    contents = [RecordDict({"a": ArrayRecord({"x": Array(row)})}) for row in flat]
    chosen = select_multikrum(contents, rule.byzantine, rule.krum_count(9))
    assert sorted(contents.index(c) for c in chosen) == rule.selected(values, list(SHAPES))


# ------------------------------------------------------------ the store on disk
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.byzantine}")
@pytest.mark.parametrize("block_bytes", [4 * 7 * 3, 1 << 20])  # 3 floats a block; one block
def test_the_streamed_centre_is_the_in_memory_one_bit_for_bit(rule, block_bytes, tmp_path):
    values = references(7)
    store = ClientReferences(SHAPES, 9, folder=tmp_path, block_bytes=block_bytes)
    for pid, value in enumerate(values[:5]):
        store.add(pid, value)
    for pid, value in enumerate(values[5:], start=5):  # two steps: u = 0 + a + b
        half = {k: v * np.float32(0.5) for k, v in value.items()}
        store.add(pid, half)
        store.add(pid, {k: v - half[k] for k, v in value.items()})
        values[pid] = {k: np.add(half[k], v - half[k], dtype=np.float32)
                       for k, v in value.items()}
    values += [{k: np.zeros(s, np.float32) for k, s in SHAPES.items()}] * 1  # pid 7: 0
    assert list(store) == list(range(7)) and 7 not in store and len(store) == 7
    centre = store.centre(rule, 8)
    expected = in_memory_centre(rule, values)
    for key in SHAPES:
        assert centre[key].dtype == np.float32
        assert centre[key].tobytes() == expected[key].astype(np.float32).tobytes(), key
    np.testing.assert_array_equal(store[6]["fc.weight"], values[6]["fc.weight"])


def test_the_store_lives_in_its_own_folder_and_is_removed_with_it(tmp_path):
    stale = tmp_path / (PREFIX + "left-by-a-stopped-server")
    stale.mkdir()
    store = ClientReferences(SHAPES, 4, folder=tmp_path)
    assert not stale.exists() and store.path.parent.parent == tmp_path
    store.add(2, references(3)[2])
    mapped = np.load(store.path, mmap_mode="r")  # a plain .npy: rows are clients
    assert mapped.shape == (4, 3 * 4 + 3 + 20) and not mapped[:2].any()
    np.testing.assert_array_equal(mapped[2, 15:], references(3)[2]["fc.weight"].ravel())
    del mapped
    store.close()
    assert not store.path.parent.exists()
    with pytest.raises(KeyError):
        ClientReferences(SHAPES, 4).add(4, references(3)[2])


# ------------------------------------------------------------ FedSPC and checkpoints
def test_fedspc_keeps_the_u_k_beside_the_checkpoint_and_restores_them_lazily(tmp_path):
    strategy, federation, _ = run("client-centre", rule="median", rounds=3, partial=True)
    config = RunConfig(fedspc=True, aggregation="median", output_dir=str(tmp_path))
    identity = fingerprint(config, 5)
    state = strategy.state_arrays()
    assert all(isinstance(state[f"client/{k}/w"], Deferred) for k in strategy.client_references)
    write_checkpoint(tmp_path, Checkpoint(round=3, phase="complete", shared={"w": f32(0, 0)},
                                          global_reference=state, strategy=strategy.state_dict()),
                     identity, new_arrays=True)
    saved = read_checkpoint(tmp_path, identity)
    assert all(isinstance(v, Deferred) for v in saved.global_reference.values())
    restored = server("client-centre", rule="median", reference_dir=tmp_path / "run")
    restored.load_state_dict(saved.strategy, 3, global_reference=saved.global_reference)
    assert list(restored.client_references) == list(strategy.client_references)
    for k in strategy.client_references:
        assert (restored.client_references[k]["w"].tobytes()
                == strategy.client_references[k]["w"].tobytes())
        np.testing.assert_allclose(restored.client_references[k]["w"], federation.own[k],
                                   rtol=1e-5, atol=1e-6)
    assert restored.client_references.path.is_relative_to(tmp_path / "run")
    np.testing.assert_array_equal(restored.global_reference["w"], strategy.global_reference["w"])


def test_auto_is_algorithm_one_under_the_mean_and_the_centre_under_a_robust_rule():
    assert RunConfig().fedspc_reference == "auto"
    assert RunConfig().reference_rule == "increment"
    assert RunConfig(aggregation="weighted").reference_rule == "increment"
    for rule in ("median", "trimmed-mean", "krum", "multi-krum"):
        assert RunConfig(aggregation=rule).reference_rule == "server-centre"
        assert RunConfig(aggregation=rule, fedspc_reference="increment").reference_rule == (
            "increment")
    dp = validate(RunConfig(fedspc=True, dp_clipping_norm=1.0, local_steps=4))
    assert dp.fedspc_reference == "auto" and dp.reference_rule == "increment"
    assert server("auto", rule="median").reference == "server-centre"
    assert server("auto").reference == "increment"
    # Bit for bit the increment under the mean, and the same rounds under the median as
    # the client centre.
    for rule, same in (("mean", "increment"), ("median", "server-centre")):
        _, _, auto = run("auto", rule=rule, rounds=4, partial=True)
        _, _, explicit = run(same, rule=rule, rounds=4, partial=True)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(auto, explicit))


def test_runs_recorded_before_auto_compare_equal_to_their_settings_now():
    old = {"fedspc-reference": "increment", "aggregation": "mean"}
    assert resolved_settings(old) == resolved_settings({**old, "fedspc-reference": "auto"})
    median = {"fedspc-reference": "increment", "aggregation": "median"}
    assert resolved_settings(median) != resolved_settings({**median,
                                                           "fedspc-reference": "auto"})
    # A checkpoint's identity holds the resolved rule: an old "increment" run under the
    # mean resumes with the default.
    assert fingerprint(RunConfig(), 4)["fedspc-reference"] == "increment"
    assert fingerprint(RunConfig(aggregation="krum"), 4)["fedspc-reference"] == "server-centre"


def test_krum_with_the_client_centre_scores_the_u_k_that_make_u_bar():
    # Client 0 reports one shared step instead of four: its reference change, and so
    # its u_k, is about four times too large, while its shared update is honest.
    # Krum on the u_k leaves it out of u_bar.
    strategy = FedSPC(shared_keys=["w"], corrected_keys=["w"], learning_rate=0.1,
                      num_partitions=5, min_train_replies=0.1, reference="auto",
                      aggregation=AggregationRule("multi-krum", byzantine=1))
    assert strategy.reference == "server-centre"
    base = 1.0 + 0.1 * np.random.default_rng(3).standard_normal((5, 2))
    theta = f32(0.0, 0.0)
    strategy.configure_train(1, record({"w": theta}), ConfigRecord(), FakeGrid(range(1, 6)))
    replies = [reply({"w": (theta - 0.4 * base[k]).astype(np.float32)}, node=k + 1,
                     **{"num-examples": 10, "shared-steps": 1 if k == 0 else 4})
               for k in range(5)]
    strategy.aggregate_train(1, replies)
    # u_k = -u_bar - Delta / (E eta) = base_k for the honest clients, 4 base_0 for the liar.
    assert strategy.client_references[0]["w"] == pytest.approx(4 * base[0], rel=1e-5)
    # u_bar is the mean over the K = 5 u_k Krum keeps (n - f = 4): the honest ones.
    np.testing.assert_allclose(strategy.global_reference["w"], base[1:].mean(axis=0),
                               rtol=1e-5)


def test_shipped_grids_keep_the_u_bar_rule_of_their_committed_runs():
    # The default became "auto": a grid with committed FedSPC runs under a robust rule
    # must still resolve to the rule those runs used (runs from before the key existed
    # used Algorithm 1's increment), or rerunning it is another experiment. Likewise
    # robust-norm-bound, which no committed run had: every run must resolve to "none".
    import json
    from pathlib import Path

    from fedspc_app.experiments.grid import load_grid
    from fedspc_app.runs.checkpoint import FORMER_DEFAULTS

    repo = Path(__file__).resolve().parent.parent
    checked = robust = bounded = 0
    for path in sorted((repo / "conf/experiments").glob("*.yaml")):
        grid = load_grid(path, output_dir=str(repo / "docs/results"))
        for cell in grid.cells:
            recorded = cell.run_dir / "config.json"
            if cell.kind != "federated" or not recorded.is_file():
                continue
            then = resolved_settings({**FORMER_DEFAULTS,
                                      **json.loads(recorded.read_text())["run-config"]})
            now = resolved_settings(cell.run_config)
            assert now["robust-norm-bound"] == then["robust-norm-bound"] == "none", (
                path.name, cell.name)
            bounded += cell.run_config["aggregation"] not in ("mean", "weighted")
            if not cell.run_config.get("fedspc"):
                continue
            assert now["fedspc-reference"] == then["fedspc-reference"], (path.name, cell.name)
            checked += 1
            robust += cell.run_config["aggregation"] not in ("mean", "weighted")
    assert checked >= 20 and robust >= 10 and bounded >= 20


def test_a_checkpoint_from_before_the_key_resumes_with_the_increment(tmp_path):
    # Written before fedspc-reference existed: Algorithm 1's increment, the only rule.
    for aggregation, resumes in (("mean", "auto"), ("median", "increment")):
        config = RunConfig(fedspc=True, aggregation=aggregation)
        old = {k: v for k, v in fingerprint(config, 4).items() if k != "fedspc-reference"}
        write_checkpoint(tmp_path, Checkpoint(round=1, phase="complete", shared={"w": f32(0)},
                                              global_reference={"w": f32(1)}, strategy={}),
                         old, new_arrays=True)
        identity = fingerprint(config.replace(fedspc_reference=resumes), 4)
        assert read_checkpoint(tmp_path, identity).round == 1
        if aggregation == "median":  # auto is the client centre there: another run
            with pytest.raises(ConfigError, match="fedspc-reference: checkpoint 'increment'"):
                read_checkpoint(tmp_path, fingerprint(config, 4))


def test_a_checkpoint_from_before_the_norm_bound_resumes_without_it(tmp_path):
    assert RunConfig().robust_norm_bound == "auto"
    assert RunConfig(robust_norm_bound="median").norm_bound == "none"  # the mean: never
    # auto: the median norm under a robust rule where the run corrects the shared block
    assert RunConfig(aggregation="median", fedspc=True).norm_bound == "median"
    assert RunConfig(aggregation="median", method="scaffold").norm_bound == "median"
    assert RunConfig(aggregation="median").norm_bound == "none"
    for aggregation in ("mean", "median"):
        config = RunConfig(fedspc=True, aggregation=aggregation, robust_norm_bound="none")
        old = {k: v for k, v in fingerprint(config, 4).items() if k != "robust-norm-bound"}
        write_checkpoint(tmp_path, Checkpoint(round=1, phase="complete", shared={"w": f32(0)},
                                              global_reference={"w": f32(1)}, strategy={}),
                         old, new_arrays=True)
        assert read_checkpoint(tmp_path, fingerprint(config, 4)).round == 1
        # The default now bounds under a robust rule: another run than the checkpoint's.
        bounded = fingerprint(config.replace(robust_norm_bound="auto"), 4)
        if aggregation == "mean":  # ignored under the mean: the same run
            assert read_checkpoint(tmp_path, bounded).round == 1
        else:
            with pytest.raises(ConfigError, match="robust-norm-bound: checkpoint 'none'"):
                read_checkpoint(tmp_path, bounded)


# ------------------------------------------------------------ the server keeps the u_k
def test_the_server_centre_sends_each_client_the_u_k_it_keeps_for_it():
    # Round 1: every client's u_k is 0; round 2: the one the server derived from its
    # reply (client 0's, bounded to the median norm, as the server saw it), each in its
    # own message (a round's messages share one RecordDict until this one is added).
    eta, steps = 0.1, 4
    strategy = FedSPC(shared_keys=["w"], corrected_keys=["w"], learning_rate=eta,
                      num_partitions=5, min_train_replies=0.1, reference="auto",
                      aggregation=AggregationRule("median", norm_bound="median"))
    assert strategy.reference == "server-centre"
    theta = f32(1.0, -1.0)
    grid = FakeGrid(range(1, 6))
    first = list(strategy.configure_train(1, record({"w": theta}), ConfigRecord(), grid))
    for message in first:
        kept = message.content.array_records[CLIENT_REFERENCE_RECORD]
        assert kept["w"].numpy().tobytes() == f32(0.0, 0.0).tobytes()
    deltas = [f32(-0.4, 0.2) * (50.0 if k == 0 else 1.0 + 0.1 * k) for k in range(5)]
    strategy.aggregate_train(1, [reply({"w": theta + d}, node=k + 1, **{
        "num-examples": 10, "shared-steps": steps}) for k, d in enumerate(deltas)])
    second = list(strategy.configure_train(2, record({"w": theta}), ConfigRecord(), grid))
    assert len({id(m.content) for m in second}) == 5
    bound = float(np.median([np.linalg.norm(d) for d in deltas]))
    for message in second:
        pid = message.metadata.dst_node_id - 1
        kept = message.content.array_records[CLIENT_REFERENCE_RECORD]["w"].numpy()
        assert kept.tobytes() == strategy.client_references[pid]["w"].tobytes()
        factor = min(1.0, bound / float(np.linalg.norm(deltas[pid])))
        np.testing.assert_allclose(kept, -factor * deltas[pid] / (steps * eta), rtol=1e-5)
    # The client centre (clients keep their own) and the increment send none.
    for reference in ("client-centre", "increment"):
        other = FedSPC(shared_keys=["w"], corrected_keys=["w"], learning_rate=eta,
                       num_partitions=5, reference=reference,
                       aggregation=AggregationRule("median"))
        for message in other.configure_train(1, record({"w": theta}), ConfigRecord(), grid):
            assert CLIENT_REFERENCE_RECORD not in message.content.array_records


def test_a_client_trains_with_the_u_k_the_server_sent_and_checks_it():
    u_bar = {"w": f32(0.5, 0.5), "b": np.zeros((2, 2), np.float32)}

    def message(kept=None):
        content = RecordDict({"global-reference": record(u_bar)})
        if kept is not None:
            content[CLIENT_REFERENCE_RECORD] = record(kept)
        return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)

    assert server_kept_reference(message(), u_bar) is None
    kept = {"w": f32(1.0, 2.0), "b": np.ones((2, 2), np.float32)}
    got = server_kept_reference(message(kept), u_bar)
    assert all(got[k].tobytes() == kept[k].tobytes() for k in kept)
    for bad in ({"w": f32(1.0, 2.0)},  # a key missing
                {**kept, "c": f32(1.0)},  # one more
                {**kept, "w": f32(1.0, 2.0, 3.0)},  # another shape
                {**kept, "w": np.array([1.0, 2.0])},  # float64
                {**kept, "w": f32(1.0, np.nan)}):  # not finite
        with pytest.raises(ValueError, match="client reference"):
            server_kept_reference(message(bad), u_bar)


def test_a_client_refuses_a_u_bar_that_does_not_fit_its_corrected_parameters():
    """u_bar must have exactly the corrected keys, their shapes, float32 and finite
    values: a shape numpy can broadcast ((1,) for a matrix) would otherwise train."""
    shared, u_bar, split = round_inputs()
    key = split.corrected[0]
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    assert not grid.deliver(train_message(1, shared, u_bar, node_id=1)).has_error()
    others = {k: v for k, v in u_bar.items() if k != key}
    for bad in ({**u_bar, key: np.zeros(1, np.float32)},  # broadcasts to the parameter
                others,  # a key missing
                {**u_bar, "extra": f32(0.0)},  # one more
                {**u_bar, key: u_bar[key].astype(np.float64)},  # float64
                {**u_bar, key: np.full_like(u_bar[key], np.nan)}):  # not finite
        reply = grid.deliver(train_message(2, shared, bad, node_id=1))
        assert reply.has_error() and "global reference u_bar" in reply.error.reason



def test_the_checkpoint_holding_every_u_k_and_the_secret_is_for_its_owner_only(tmp_path):
    """Under the usual umask the checkpoint's arrays (every client's u_k here) and
    checkpoint.json (the secret under differential privacy) are 0600, as the
    clients' own state files, and so is the server's file of tracked u_k."""
    strategy, _, _ = run("client-centre", rule="median", rounds=1, partial=False)
    previous = os.umask(0o022)
    try:
        write_checkpoint(tmp_path, Checkpoint(
            round=1, phase="complete", shared={"w": f32(0, 0)},
            global_reference=strategy.state_arrays(),
            strategy={**strategy.state_dict(), "dp-secret": "deadbeef"}),
            fingerprint(RunConfig(fedspc=True), 5), new_arrays=True)
        store = ClientReferences({"w": (2,)}, 3, folder=tmp_path / "refs")
    finally:
        os.umask(previous)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (
        tmp_path / "checkpoint-r00001.npz", tmp_path / "checkpoint.json", store.path)}
    assert set(modes.values()) == {oct(0o600)}, modes
