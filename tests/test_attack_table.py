"""One lying client against FedSPC (``fedspc-reference = "auto"``) and against the
same robust rule without FedSPC, on the small simulated federation of
scripts/attack_table.py (12 rounds, seeds 0–2 here; the server checks each E_k, as
the app does): the lie may move the shared block at most 1.5 times as far with
FedSPC as without (the ratio of the means over the seeds), and u_bar's norm at most
1.5 times its attack-free norm; the same for two adaptive lies (a mild scale, and a
small lean repeated every round), which miss it by far. The cells that miss the first bound are strict
xfails with the ratio measured (docs/robustness.md, "What was tried"); the bound on
the updates' norms (``robust-norm-bound = "median"``) and the E_k-unchecked variant
are measured by the slow tests."""

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
from fedspc_app.core.config import RunConfig
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
# Measured ratios (12 rounds, seeds 0–2): FedSPC's correction makes the honest updates
# alike, so the liar's scaled update lands beyond them in the direction they share,
# and its derived reference change, 50 times too large, puts its tracked u_k at one
# end of every coordinate: the centres of theta_s and of the u_k move a rank a round.
MISSES = {("scale x50", "median"): 3.31, ("scale x50", "trimmed-mean"): 1.75,
          # The adaptive lies (a mild scale; a lean of norm 0.1 the same every round):
          # the corrected honest updates are small and alike, and the references
          # integrate a lie that repeats, so every rule misses by far (bias under
          # Multi-Krum: u_bar 2.26 too).
          ("scale x2", "median"): 3.80, ("scale x2", "trimmed-mean"): 2.22,
          ("bias 0.1", "median"): 6.00, ("bias 0.1", "trimmed-mean"): 6.97,
          ("bias 0.1", "multi-krum"): 16.92}
NAMED = [attack for attack in table.ATTACKS if attack not in table.ADAPTIVE]


def within_bounds(row) -> bool:
    return row.ratio <= 1.5 and row.u_bar <= 1.5


@pytest.mark.parametrize("rule", table.RULES)
@pytest.mark.parametrize("attack", list(table.ATTACKS))
def test_fedspc_moves_the_shared_block_no_further_than_the_rule_alone(attack, rule,
                                                                       request):
    if (attack, rule) in MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            f"measured ratio {MISSES[attack, rule]} (12 rounds, seeds 0-2; the 30-round "
            "figures in docs/robustness.md); robust-norm-bound = 'median' cuts the x50 "
            "effect with FedSPC fourfold but the rule alone's more, test_the_norm_bound")))
    cell = table.measure_seeds(attack, rule, "auto", FAST, SEEDS)
    assert cell.u_bar <= 1.5, cell
    assert cell.ratio <= 1.5, cell


@pytest.mark.parametrize("rule", table.RULES)
def test_the_effects_are_the_lies_not_a_divergence_floor(rule):
    # The liar training honestly with another noise draw moves theta_s with FedSPC by
    # a tenth of what the mildest lie does: the effects with FedSPC measure the lie,
    # not a divergence of the trajectories. Without FedSPC the x50 lie's effect under
    # the median is only about three times this floor (0.37 against 0.14).
    null = table.measure_seeds(table.NULL, rule, "auto", FAST, SEEDS)
    lies = [table.measure_seeds(attack, rule, "auto", FAST, SEEDS)
            for attack in (*NAMED, table.UNCHECKED)]
    assert null.with_fedspc <= 0.15 * min(cell.with_fedspc for cell in lies), null
    assert null.without <= 0.5 * min(cell.without for cell in lies if cell.without), null
    assert 0.8 <= null.u_bar <= 1.2


def test_the_bounds_fail_for_algorithm_ones_increment():
    # Multi-Krum scores the shared updates; with the increment a client reporting one
    # step sends an honest update (selected) and a change E times too large into u_bar
    # (when the server does not check E_k).
    row = table.measure(table.UNCHECKED, "multi-krum", "increment", FAST)
    assert row.u_bar > 3 and not within_bounds(row)
    assert not within_bounds(table.measure("scale x50", "median", "increment", FAST))


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


def test_a_repeated_lean_is_below_the_noise_without_fedspc_and_far_above_with_it():
    # One client adding the same vector of norm 0.1 to its update every round: without
    # FedSPC its effect is at most the honest liar's other-noise floor; with FedSPC it
    # is several times that floor under each robust rule (the references take the
    # repeated lean for drift and correct every client by it).
    for rule in table.RULES:
        null = table.measure_seeds(table.NULL, rule, "auto", FAST, SEEDS)
        lean = table.measure_seeds("bias 0.1", rule, "auto", FAST, SEEDS)
        assert lean.without <= 1.0 * max(null.without, null.with_fedspc), (rule, lean, null)
        assert lean.with_fedspc >= 3 * null.with_fedspc, (rule, lean, null)


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
def test_an_unchecked_step_count_does_not_move_u_bar(rule):
    # Over rounds 16-30, seeds 0-4: 1.04, 1.03, 0.99. (Over rounds 7-12 of 12 rounds
    # the liar's growing u_k changes Multi-Krum's selection for a few rounds: 1.81.)
    cell = table.measure_seeds(table.UNCHECKED, rule, "auto", FULL)
    assert cell.u_bar <= 1.5, cell


@pytest.mark.slow
def test_the_norm_bound():
    # robust-norm-bound = "median" (30 rounds, seeds 0-4): the x50 liar's effect with
    # FedSPC falls from 1.36 to 0.35 under the median, but without FedSPC from 0.30
    # to 0.06, so the ratio stays above 1.5; and under Multi-Krum a sign-flipping
    # liar's u_bar grows (the tracked u_k of clipped honest clients drift from their
    # own): why it is not the default.
    bound = replace(FULL, norm_bound="median")
    plain = table.measure_seeds("scale x50", "median", "auto", FULL)
    clipped = table.measure_seeds("scale x50", "median", "auto", bound)
    assert clipped.with_fedspc < 0.5 * plain.with_fedspc
    assert clipped.without < 0.5 * plain.without
    assert clipped.ratio > 1.5
    assert table.measure_seeds("sign-flip", "multi-krum", "auto", bound).u_bar > 1.5


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
