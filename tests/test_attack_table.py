"""One lying client against FedSPC (``fedspc-reference = "auto"``) and against the
same robust rule without FedSPC, on the small simulated federation of
scripts/attack_table.py (12 rounds here): the lie may move the shared block at most
1.5 times as far with FedSPC as without, and u_bar's norm at most 1.5 times its
attack-free norm. The cells that miss the first bound are strict xfails with the
ratio measured (docs/robustness.md, "What was tried")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("task_identity")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "attack_table.py"
spec = importlib.util.spec_from_file_location("attack_table", SCRIPT)
table = sys.modules.setdefault("attack_table", importlib.util.module_from_spec(spec))
spec.loader.exec_module(table)
FAST = table.Setting(rounds=12)
# E_k checked against the partition's size, as the ServerApp does when it knows it.
CHECKED = table.Setting(rounds=12, check_counts=True)
MISSES = {("scale x50", "median"): 2.9, ("scale x50", "trimmed-mean"): 1.7}


def within_bounds(row) -> bool:
    return row.ratio <= 1.5 and row.u_bar <= 1.5


@pytest.mark.parametrize("rule", table.RULES)
@pytest.mark.parametrize("attack", list(table.ATTACKS))
def test_fedspc_moves_the_shared_block_no_further_than_the_rule_alone(attack, rule,
                                                                       request):
    if (attack, rule) in MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            f"measured ratio {MISSES[attack, rule]}: with FedSPC the honest updates are "
            "alike, so a scaled one crosses the median (also with an honest u_k)")))
    # small-steps lies about E_k alone, which only FedSPC reads: measured with the
    # server checking E_k (both drop the liar), and u_bar without the check below.
    row = table.measure(attack, rule, "auto", CHECKED if attack == "small-steps" else FAST)
    assert row.u_bar <= 1.5
    assert row.ratio <= 1.5, row


@pytest.mark.parametrize("rule", table.RULES)
def test_an_unchecked_step_count_does_not_move_u_bar(rule, request):
    if rule == "multi-krum":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "measured 3.4 over rounds 7-12: u_bar 2.2 against 0.5 in rounds 7-8 while "
            "the liar's u_k changes Multi-Krum's selection; 0.98 over rounds 16-30")))
    row = table.measure("small-steps", rule, "auto", FAST)
    assert row.u_bar <= 1.5, row


def test_the_bounds_fail_for_algorithm_ones_increment():
    # Multi-Krum scores the shared updates; with the increment a client reporting one
    # step sends an honest update (selected) and a change E times too large into u_bar.
    row = table.measure("small-steps", "multi-krum", "increment", FAST)
    assert row.u_bar > 3 and not within_bounds(row)
    assert not within_bounds(table.measure("scale x50", "median", "increment", FAST))
