"""One lying client against FedSPC and against the same robust rule without FedSPC,
with the defaults (``fedspc-reference = "auto"``: the server centre, the server
keeping every u_k and sending each client its own; ``robust-norm-bound = "auto"``:
with FedSPC each update bounded to the round's median norm, without FedSPC no bound),
on the small
simulated federation of scripts/attack_table.py (12 rounds, seeds 0–2 here; the
server checks each E_k, as the app does): the lie may move the shared block at most
1.5 times as far with FedSPC as without (the ratio of the means over the seeds), for
the four named attacks and two adaptive lies (a mild scale, and a small lean repeated
every round); u_bar's norm at most 1.5 times its attack-free norm, which misses under
Multi-Krum for sign-flip (a strict xfail with the figure). Why both defaults are
needed (the client centre alone, the bound alone) is measured here too, and a liar
that trains from its own u_k, which they do not stop; the 30-round, five-seed table
by the slow tests (docs/robustness.md)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord
from test_strategies import FakeGrid, f32, record, reply

from clients.attack import attacked_reply
from fedspc_app.core.config import RunConfig, resolve_norm_bound
from fedspc_app.core.protocol import REFERENCE_CHANGE
from strategies import AggregationRule, FedSPC
from strategies.aggregation import bounded

pytestmark = pytest.mark.usefixtures("task_identity")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "attack_table.py"
spec = importlib.util.spec_from_file_location("attack_table", SCRIPT)
table = sys.modules.setdefault("attack_table", importlib.util.module_from_spec(spec))
spec.loader.exec_module(table)
FAST = table.Setting(rounds=12)  # E_k checked against the partition's size
SEEDS = (0, 1, 2)
FULL = table.Setting()  # 30 rounds, with table.SEEDS (0–4): the documented table
# u_bar attacked / clean measured above 1.5 (12 rounds, seeds 0–2): Multi-Krum scores
# the u_k, and the sign-flipping liar's u_k (the server's, from its bounded replies)
# drifts inside the honest clients' spread before it is far enough to be left out.
U_BAR_MISSES = {("sign-flip", "multi-krum"): 1.61}
NAMED = [attack for attack in table.ATTACKS if attack not in table.ADAPTIVE]
# Lies that still move theta_s once bounded (a scaled update bounded to the median
# norm is the liar's honest update): measured against the honest floor.
SURVIVING = ("sign-flip", "noise", "small-steps")
# The federation without the defaults' two parts: the clients keeping their own u_k
# (the client centre), and no bound on the updates' norms.
CLIENTS_KEEP = replace(FAST, norm_bound="none")


def within_bounds(row) -> bool:
    return row.ratio <= 1.5 and row.u_bar <= 1.5


@pytest.mark.parametrize("rule", table.RULES)
@pytest.mark.parametrize("attack", list(table.ATTACKS))
def test_fedspc_moves_the_shared_block_no_further_than_the_rule_alone(attack, rule):
    cell = table.measure_seeds(attack, rule, "auto", FAST, SEEDS)
    assert cell.ratio <= 1.5, cell


@pytest.mark.parametrize("rule", table.RULES)
@pytest.mark.parametrize("attack", list(table.ATTACKS))
def test_a_lie_leaves_u_bar_near_its_attack_free_norm(attack, rule, request):
    if (attack, rule) in U_BAR_MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            f"measured {U_BAR_MISSES[attack, rule]} (12 rounds, seeds 0-2; 30 rounds, "
            "seeds 0-4: docs/robustness.md)")))
    assert table.measure_seeds(attack, rule, "auto", FAST, SEEDS).u_bar <= 1.5


@pytest.mark.parametrize("rule", table.RULES)
def test_the_server_keeping_the_u_k_is_what_stops_a_repeated_lie(rule):
    # The same lean of norm 0.1 every round, no bound: where each client keeps its own
    # u_k (client-centre), the lean is integrated into the liar's u_k round after
    # round and moves theta_s several times the honest floor; where the server keeps
    # the u_k and the liar trains from its (server-centre), its next honest update
    # undoes the lean, and the effect is the rule alone's.
    own = table.measure_seeds("bias 0.1", rule, "client-centre", CLIENTS_KEEP, SEEDS)
    kept = table.measure_seeds("bias 0.1", rule, "server-centre", CLIENTS_KEEP, SEEDS)
    null = table.measure_seeds(table.NULL, rule, "server-centre", CLIENTS_KEEP, SEEDS)
    assert own.with_fedspc >= 3 * null.with_fedspc, (own, null)
    assert kept.with_fedspc <= 1.5 * max(null.with_fedspc, kept.without), (kept, null)
    assert kept.ratio <= 1.5 < own.ratio


def test_the_bound_is_what_stops_a_scaled_update():
    # x50 under the median: the server keeping the u_k does not stop a liar whose
    # every reply is 50 times its update (its u_k swings further each round); bounding
    # each update to the round's median norm (the default with FedSPC) does.
    unbounded = table.measure_seeds("scale x50", "median", "server-centre", CLIENTS_KEEP,
                                    SEEDS)
    bounded_ = table.measure_seeds("scale x50", "median", "server-centre", FAST, SEEDS)
    assert unbounded.ratio > 1.5 >= bounded_.ratio
    assert bounded_.with_fedspc < 0.2 * unbounded.with_fedspc


@pytest.mark.parametrize("rule", table.RULES)
def test_the_effects_are_the_lies_not_a_divergence_floor(rule):
    # The liar training honestly with another noise draw moves theta_s with FedSPC by
    # a tenth of what the mildest lie does: the effects with FedSPC measure the lie,
    # not a divergence of the trajectories. Without FedSPC the x50 lie's effect under
    # the median is only about three times this floor (0.37 against 0.14).
    null = table.measure_seeds(table.NULL, rule, "auto", FAST, SEEDS)
    lies = [table.measure_seeds(attack, rule, "auto", FAST, SEEDS) for attack in SURVIVING]
    assert null.with_fedspc <= 0.15 * min(cell.with_fedspc for cell in lies), null
    assert null.without <= 0.5 * min(cell.without for cell in lies if cell.without), null
    assert 0.8 <= null.u_bar <= 1.2


def test_the_bounds_fail_for_algorithm_ones_increment():
    # Multi-Krum scores the shared updates; with the increment a client reporting one
    # step sends an honest update (selected) and a change E times too large into u_bar
    # (when the server does not check E_k).
    row = table.measure(table.UNCHECKED, "multi-krum", "increment", CLIENTS_KEEP)
    assert row.u_bar > 3 and not within_bounds(row)
    assert not within_bounds(table.measure("scale x50", "median", "increment", CLIENTS_KEEP))


def test_the_norm_bound_scales_updates_above_the_median_norm_to_it():
    origin = {"w": f32(0, 0), "b": f32(1)}
    updates = [{"w": f32(3, 4), "b": f32(9)}, {"w": f32(0, 1), "b": f32(2)},
               {"w": f32(0, 2), "b": f32(3)}, {"w": f32(60, 80), "b": f32(4)}]
    rule = AggregationRule("median", norm_bound="median")
    factors = rule.bound_factors(updates, origin, ["w"])
    assert factors == pytest.approx([3.5 / 5, 1.0, 1.0, 3.5 / 100])  # median norm 3.5
    out = bounded(updates, origin, ["w"], factors)
    assert [float(np.linalg.norm(u["w"])) for u in out] == pytest.approx([3.5, 1, 2, 3.5])
    assert out[1] is updates[1] and out[0]["b"] is updates[0]["b"]  # the rest untouched
    for name, bound in (("mean", "median"), ("weighted", "median"), ("median", "none")):
        assert AggregationRule(name, norm_bound=bound).bound_factors(
            updates, origin, ["w"]) == [1.0] * 4
    # The run-config's "auto": the median norm under a robust rule when the run
    # corrects the shared block (FedSPC, SCAFFOLD), none otherwise.
    assert resolve_norm_bound("auto", "median", True) == "median"
    assert resolve_norm_bound("auto", "median", False) == "none"
    assert resolve_norm_bound("auto", "mean", True) == "none"
    assert resolve_norm_bound("median", "trimmed-mean", False) == "median"
    with pytest.raises(ValueError, match="norm bound"):
        AggregationRule("median", norm_bound="max")


@pytest.mark.parametrize("upload", ["derived", "explicit"])
def test_fedspc_derives_the_change_from_the_bounded_update(upload):
    # Round 1 (u_bar = 0): u_k = -Delta_k / (E eta) of the update the rule saw; the
    # liar's x50 update is bounded to the median norm, and so is its change.
    eta, steps = 0.1, 4
    strategy = FedSPC(shared_keys=["w"], corrected_keys=["w"], learning_rate=eta,
                      num_partitions=5, min_train_replies=0.1, upload=upload,
                      aggregation=AggregationRule("median", norm_bound="median"))
    theta = f32(1.0, -1.0)
    strategy.configure_train(1, record({"w": theta}), ConfigRecord(), FakeGrid(range(1, 6)))
    deltas = [f32(-0.4, 0.2) * (50.0 if k == 0 else 1.0 + 0.1 * k) for k in range(5)]
    replies = []
    for k, delta in enumerate(deltas):
        extra = ({REFERENCE_CHANGE: record({"w": -delta / (steps * eta)})}
                 if upload == "explicit" else None)
        replies.append(reply({"w": theta + delta}, node=k + 1, extra_records=extra,
                             **{"num-examples": 10, "shared-steps": steps}))
    strategy.aggregate_train(1, replies)
    norms = [float(np.linalg.norm(d)) for d in deltas]
    bound = float(np.median(norms))
    for k, delta in enumerate(deltas):
        factor = min(1.0, bound / norms[k])
        np.testing.assert_allclose(strategy.client_references[k]["w"],
                                   -factor * delta / (steps * eta), rtol=1e-5)
    assert strategy.norm_factors[0] == pytest.approx(bound / norms[0])


def test_under_the_mean_a_repeated_lean_moves_fedspc_without_bound():
    # Algorithm 1 under the plain mean (FedSPC and SCAFFOLD alike): a lean of norm
    # 0.1 moves theta_s ever further, about linearly in the rounds (seed 0: 0.87,
    # 1.82, 4.66, 9.40 after 30, 60, 150, 300), where without FedSPC it stays at 0.04.
    # The robust rules bound it (median, 300 rounds: 0.61; trimmed mean 0.80).
    short = table.measure("bias 0.1", "mean", "auto", replace(FULL, rounds=30))
    long = table.measure("bias 0.1", "mean", "auto", replace(FULL, rounds=60))
    assert long.with_fedspc > 1.8 * short.with_fedspc > 1.5
    assert abs(long.without - short.without) < 0.02 and long.without < 0.1
    robust_short = table.measure("bias 0.1", "median", "auto", replace(FULL, rounds=30))
    robust_long = table.measure("bias 0.1", "median", "auto", replace(FULL, rounds=60))
    assert robust_long.with_fedspc < 1.2 * robust_short.with_fedspc


@pytest.mark.slow
@pytest.mark.parametrize("rule", table.RULES)
def test_an_unchecked_step_count_moves_u_bar_only_where_the_server_does_not_check(rule):
    # A server that does not check E_k (the app always does): the liar's u_k, derived
    # from a step count five times too small and sent back to it, over-corrects its
    # next update, and u_bar moves (rounds 16-30, seeds 0-4: 1.37 under the median,
    # 1.61 under the trimmed mean, 1.94 under Multi-Krum). Checked, it is dropped.
    unchecked = table.measure_seeds(table.UNCHECKED, rule, "auto", FULL)
    assert (unchecked.u_bar > 1.5) == (rule != "median"), unchecked
    checked = table.measure_seeds("small-steps", rule, "auto", FULL)
    assert checked.u_bar <= 1.5 and checked.ratio <= 1.5, checked


@pytest.mark.slow
def test_the_documented_table():
    # 30 rounds, seeds 0-4, the defaults (docs/robustness.md): every ratio at most 1.5;
    # u_bar within 1.5 times its attack-free norm but for noise under Multi-Krum
    # (measured 1.97, two seeds of five above 1.5). The liar that keeps its own u_k
    # (table.OWN) is not in table.ATTACKS: test_a_liar_that_trains_from_its_own_u_k.
    misses = {("noise", "multi-krum")}
    for attack in table.ATTACKS:
        for rule in table.RULES:
            cell = table.measure_seeds(attack, rule, "auto", FULL)
            assert cell.ratio <= 1.5, (attack, rule, cell)
            assert (cell.u_bar > 1.5) == ((attack, rule) in misses), (attack, rule, cell)


def test_the_bias_attack_adds_the_same_vector_of_norm_s_every_round():
    config = RunConfig(attack="bias", attack_clients=2, attack_scale=0.3, seed=4)
    received = {"w": np.zeros((2, 3), np.float32), "n": np.zeros(1, np.int64)}
    leans = {}
    for pid in (0, 1):
        for server_round, step in ((1, 1.0), (7, -2.0)):
            honest = {"w": np.full((2, 3), step, np.float32), "n": np.ones(1, np.int64)}
            sent, metrics = attacked_reply(config, pid, server_round, received, honest,
                                           {"train-loss": 0.5}, ["w"])
            lean = sent["w"].astype(np.float64) - honest["w"]
            assert np.linalg.norm(lean) == pytest.approx(0.3, rel=1e-5)
            assert sent["w"].dtype == np.float32 and sent["n"] is honest["n"]
            assert metrics == {"train-loss": 0.5}
            leans.setdefault(pid, []).append(lean)
        np.testing.assert_allclose(leans[pid][0], leans[pid][1], atol=1e-6)
    assert not np.allclose(leans[0][0], leans[1][0])  # each attacker its own direction


@pytest.mark.parametrize("rule", table.RULES)
def test_a_liar_that_trains_from_its_own_u_k_is_not_stopped(rule):
    # The server cannot tell which u_k a client trained from. A liar that keeps its
    # own and adds the lean every round walks the u_k the server keeps for it (the
    # server integrates what it sends, as under the client centre), and the centre of
    # the u_k moves a rank: the lean moves theta_s several times as far as without
    # FedSPC (30 rounds, seeds 0-4: 6.95, 10.72, 28.05; docs/robustness.md). Measured
    # here so that a change that closes it says so.
    cell = table.measure_seeds(table.OWN, rule, "auto", FAST, SEEDS)
    kept = table.measure_seeds("bias 0.1", rule, "auto", FAST, SEEDS)
    assert cell.ratio > 3 and cell.with_fedspc > 3 * kept.with_fedspc, (cell, kept)
