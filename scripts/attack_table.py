"""How far one lying client moves the shared block with FedSPC, against the same
robust rule without FedSPC, on a small simulated federation; a markdown table.

The federation: K = 10 clients, one shared block of D = 20 floats, client k's loss
``sum_i h_ki (theta_i - c_ki)^2 / 2`` (its own optimum c_k and curvature h_k, so
local steps drift), E = 5 gradient steps of eta = 0.05 a round with Gaussian noise
on each gradient, 30 rounds, every client every round. The server is the project's
strategy (FedSPC with ``reference="auto"``, or PersonalizedFedAvg), fed through
``configure_train`` / ``aggregate_train``; clients keep u_k by Algorithm 1 with the
project's arithmetic (:mod:`fedspc_app.core.correction`), and the liar (partition
0) trains honestly and sends what :func:`clients.attack.attacked_reply` makes of its
reply. Every run draws the same noise, so a clean and an attacked run differ only by
the lie.

effect = ||theta_attacked - theta_clean|| after the last round; the ratio is FedSPC's
effect over the effect without FedSPC; ``u_bar`` is the attacked run's ||u_bar|| over
the clean run's, each the mean over the second half of the rounds. Each figure is the
mean over the seeds (0-4: the problem, the noise and the sampler's seed), the ratio
the ratio of those means. The server checks each client's E_k, as the ServerApp does;
the row "small-steps, E_k unchecked" does not. The row "honest, other noise" is no
attack: the liar trains honestly with another draw of its gradient noise, the effect
of a legitimate change in one client's reply.

    python scripts/attack_table.py
    python scripts/attack_table.py --norm-bound median
    python scripts/attack_table.py --reference increment --rules median --seeds 0
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.attack import attacked_reply
from fedspc_app.core.config import RunConfig, resolve_norm_bound
from fedspc_app.core.correction import reference_change, shared_update
from fedspc_app.core.protocol import CLIENT_REFERENCE_RECORD
from fedspc_app.core.records import from_record
from strategies import AggregationRule, FedSPC, PersonalizedFedAvg

ATTACKS = {"scale x50": ("scale", 50.0), "sign-flip": ("sign-flip", 50.0),
           "noise": ("noise", 50.0), "small-steps": ("small-steps", 50.0),
           # Lies an adversary would pick against FedSPC: a mild scale, and a small
           # lean that is the same every round (norm 0.1, beside honest updates of
           # norm about 2.4 without FedSPC, 0.25 with it once the drift is corrected).
           "scale x2": ("scale", 2.0), "bias 0.1": ("bias", 0.1)}
ADAPTIVE = ("scale x2", "bias 0.1")
# Not an attack: the liar trains honestly with another draw of its gradient noise,
# the effect of a legitimate change in one client's reply (the floor under a lie's).
NULL = "honest, other noise"
# small-steps where the server does not check E_k (the app always does).
UNCHECKED = "small-steps, E_k unchecked"
# The lean from a liar that trains from the u_k it keeps itself, not the one the
# server sends it (fedspc-reference = "server-centre"): nothing tells the server which
# one a client trained from.
OWN = "bias 0.1, own u_k"
ROWS = (*ATTACKS, NULL, UNCHECKED, OWN)
RULES = ("median", "trimmed-mean", "multi-krum")
SEEDS = (0, 1, 2, 3, 4)
W = "w"


@dataclass(frozen=True)
class Setting:
    clients: int = 10
    dim: int = 20
    steps: int = 5
    learning_rate: float = 0.05
    rounds: int = 30
    noise: float = 0.5
    attackers: int = 1
    seed: int = 0
    check_counts: bool = True  # the server checks each client's E_k (as the app does)
    liar_keeps_own: bool = False  # the liars train from their own u_k (OWN)
    norm_bound: str = "auto"  # run-config robust-norm-bound


class Grid:
    """Just enough of a Grid for the strategies: every client trains every round, so
    the sampler needs only the connected nodes (node n holds partition n - 1)."""

    def __init__(self, clients: int) -> None:
        self.nodes = list(range(1, clients + 1))

    def get_node_ids(self):
        return list(self.nodes)


def strategy(rule: str, fedspc: bool, reference: str, setting: Setting):
    common = dict(shared_keys=[W], num_partitions=setting.clients, min_train_replies=0.1,
                  aggregation=AggregationRule(rule, trim_fraction=0.2, byzantine=2,
                                              norm_bound=resolve_norm_bound(
                                                  setting.norm_bound, rule, fedspc)),
                  seed=setting.seed,
                  expected_counts=({pid: (10, setting.steps) for pid in range(setting.clients)}
                                   if setting.check_counts else None))
    server = (FedSPC(corrected_keys=[W], learning_rate=setting.learning_rate,
                     reference=reference, **common)
              if fedspc else PersonalizedFedAvg(**common))
    for node in Grid(setting.clients).nodes:  # node n holds partition n - 1, bound
        server.sampler.bind(node, node - 1)   # as a simulation's warm-up binds it
    return server


def run(rule: str, fedspc: bool, attack: str, reference: str = "auto",
        setting: Setting = Setting()) -> tuple[np.ndarray, list[float]]:
    """The final theta_s and ||u_bar|| per round (empty without FedSPC)."""
    if attack == UNCHECKED:
        attack, setting = "small-steps", replace(setting, check_counts=False)
    if attack == OWN:
        attack, setting = "bias 0.1", replace(setting, liar_keeps_own=True)
    return _run(rule, fedspc, attack, reference, setting)


@functools.lru_cache(maxsize=256)  # the clean runs recur in every row
def _run(rule: str, fedspc: bool, attack: str, reference: str,
         setting: Setting) -> tuple[np.ndarray, list[float]]:
    name, scale = ATTACKS.get(attack, ("none", 50.0))
    config = RunConfig(attack=name, attack_clients=setting.attackers if name != "none" else 0,
                       attack_scale=scale, seed=setting.seed,
                       learning_rate=setting.learning_rate)
    problem = np.random.default_rng(setting.seed)
    optimum = problem.normal(0.0, 2.0, size=(setting.clients, setting.dim))
    curvature = problem.uniform(0.5, 2.0, size=(setting.clients, setting.dim))
    server, grid = strategy(rule, fedspc, reference, setting), Grid(setting.clients)
    theta = np.zeros(setting.dim, dtype=np.float32)
    own = [np.zeros(setting.dim, dtype=np.float32) for _ in range(setting.clients)]
    norms = []
    eta = np.float32(setting.learning_rate)
    for server_round in range(1, setting.rounds + 1):
        sent_to = {message.metadata.dst_node_id: message for message in server.configure_train(
            server_round, ArrayRecord({W: Array(theta)}), ConfigRecord(), grid)}
        u_bar = server.global_reference[W] if fedspc else np.zeros_like(theta)
        replies = []
        for k in range(setting.clients):
            liar = k < setting.attackers and attack == NULL
            records = sent_to[k + 1].content.array_records
            keeps_own = setting.liar_keeps_own and k < setting.attackers
            if fedspc and CLIENT_REFERENCE_RECORD in records and not keeps_own:
                own[k] = from_record(records[CLIENT_REFERENCE_RECORD])[W]  # (client-centre)
            noise = np.random.default_rng([setting.seed, server_round, k, *([1] * liar)])
            local = theta.copy()
            for _ in range(setting.steps):
                gradient = (curvature[k] * (local - optimum[k])
                            + setting.noise * noise.standard_normal(setting.dim))
                if fedspc:
                    gradient = gradient - own[k] + u_bar
                local = (local - eta * gradient.astype(np.float32)).astype(np.float32)
            metrics = {"num-examples": 10, "shared-steps": setting.steps, "partition-id": k,
                       "train-loss": 1.0}
            sent = {W: local}
            if fedspc:  # Algorithm 1, step 3, on the client's honest update
                update = shared_update(sent, {W: theta}, [W])
                own[k] = (own[k] + reference_change(update, {W: u_bar}, steps=setting.steps,
                                                    learning_rate=setting.learning_rate)[W])
            if k < config.attack_clients:
                sent, metrics = attacked_reply(config, k, server_round, {W: theta}, sent,
                                               metrics, [W])
            content = RecordDict({"arrays": ArrayRecord({W: Array(sent[W])}),
                                  "metrics": MetricRecord(metrics)})
            replies.append(Message(content, reply_to=sent_to[k + 1]))  # from node k + 1
        arrays, _ = server.aggregate_train(server_round, replies)
        if arrays is not None:
            theta = arrays[W].numpy()
        if fedspc:
            norms.append(float(np.linalg.norm(server.global_reference[W])))
    theta.flags.writeable = False  # cached
    return theta, tuple(norms)


@dataclass(frozen=True)
class Row:
    """One attack under one rule, one seed."""

    attack: str
    rule: str
    without: float  # the lie's effect on theta_s without FedSPC
    with_fedspc: float
    u_bar: float  # attacked ||u_bar|| over clean (mean over the second half)

    @property
    def ratio(self) -> float:
        # Below 1e-6 the effect is float rounding (Krum never selecting the liar).
        return self.with_fedspc / self.without if self.without > 1e-6 else float("inf")


@dataclass(frozen=True)
class Cell:
    """One attack under one rule over several seeds: the ratios are of the means over
    the seeds (a seed whose effect without FedSPC is near 0 does not decide it)."""

    rows: tuple[Row, ...]

    @property
    def without(self) -> float:
        return float(np.mean([row.without for row in self.rows]))

    @property
    def with_fedspc(self) -> float:
        return float(np.mean([row.with_fedspc for row in self.rows]))

    @property
    def ratio(self) -> float:
        return self.with_fedspc / self.without if self.without > 0 else float("inf")

    @property
    def u_bar(self) -> float:
        return float(np.mean([row.u_bar for row in self.rows]))


def measure(attack: str, rule: str, reference: str = "auto",
            setting: Setting = Setting()) -> Row:
    clean, _ = run(rule, False, "none", setting=setting)
    attacked, _ = run(rule, False, attack, setting=setting)
    clean_spc, clean_norms = run(rule, True, "none", reference, setting)
    attacked_spc, norms = run(rule, True, attack, reference, setting)
    return Row(attack, rule, float(np.linalg.norm(attacked - clean)),
               float(np.linalg.norm(attacked_spc - clean_spc)),
               late_mean(norms) / late_mean(clean_norms))


def measure_seeds(attack: str, rule: str, reference: str = "auto",
                  setting: Setting = Setting(), seeds=SEEDS) -> Cell:
    return Cell(tuple(measure(attack, rule, reference, replace(setting, seed=seed))
                      for seed in seeds))


def late_mean(norms: list[float]) -> float:
    """The mean ||u_bar|| over the second half of the rounds (the first rounds' u_bar
    is the same whatever the rule: the centre of the first changes)."""
    return float(np.mean(norms[len(norms) // 2:]))


def spread(values) -> str:
    return f"{np.mean(values):.2f} ± {np.std(values):.2f}" if len(values) > 1 else \
        f"{values[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default="auto",
                        choices=("auto", "increment", "client-centre", "server-centre"))
    parser.add_argument("--rules", nargs="+", default=list(RULES))
    parser.add_argument("--attacks", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--rounds", type=int, default=Setting.rounds)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--norm-bound", default=Setting.norm_bound, choices=("auto", "none", "median"),
                        help="run-config robust-norm-bound")
    parser.add_argument("--attackers", type=int, default=Setting.attackers)
    parser.add_argument("--noise", type=float, default=Setting.noise,
                        help="standard deviation of each gradient's noise")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)  # a line a round otherwise
    # Messages outside a running Flower app (as the tests' task_identity fixture does).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    setting = Setting(rounds=args.rounds, attackers=args.attackers, noise=args.noise,
                      norm_bound=args.norm_bound)
    print(f"{setting.clients} clients, {setting.attackers} lying (partition 0"
          f"{'…' + str(setting.attackers - 1) if setting.attackers > 1 else ''}), "
          f"D = {setting.dim}, E = {setting.steps}, {setting.rounds} rounds, "
          f"fedspc-reference = {args.reference!r}, robust-norm-bound = {args.norm_bound!r}, "
          "trim-fraction 0.2, byzantine-clients 2, "
          f"E_k checked (but in '{UNCHECKED}'), seeds {args.seeds}: each figure the mean "
          "over the seeds ± their standard deviation; the ratio is of the means, with "
          "the seeds' own ratios in brackets\n")
    print("| attack | rule | effect without FedSPC | effect with FedSPC | ratio | "
          "‖ū‖ attacked / clean |")
    print("|---|---|---:|---:|---:|---:|")
    for attack in args.attacks:
        for rule in args.rules:
            cell = measure_seeds(attack, rule, args.reference, setting, args.seeds)
            ratios = [row.ratio for row in cell.rows]
            ratio = (f"{cell.ratio:.2f}" if np.isfinite(cell.ratio) else "— (0 without)")
            if len(ratios) > 1 and np.isfinite(cell.ratio):
                ratio += f" ({min(ratios):.2f}–{max(ratios):.2f})"
            print(f"| {attack} | {rule} | {spread([r.without for r in cell.rows])} | "
                  f"{spread([r.with_fedspc for r in cell.rows])} | {ratio} | "
                  f"{spread([r.u_bar for r in cell.rows])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
