"""Which clients a round messages: a fraction of the K partitions, drawn from the seed.

Flower's own sampling draws node ids with the unseeded ``random`` module and waits,
with no limit, until all K nodes are connected. Here a round draws partition ids
with a generator seeded by the run's seed, the round and the phase, so a run, the
same run again and its resumed continuation (whose simulated nodes get new ids)
message the same clients. A round waits at most ``node_wait`` seconds for missing
nodes, then goes on with the connected ones; a drawn client that is not connected
counts as a sampled client that did not reply, and the round failure policy decides.

Each node is bound to one partition before it is messaged, from its first answer
before any training: the simulation's warm-up, the deployment's preflight report,
or for a node not heard from yet one small query (``NODE_QUERY``; nothing is loaded
on the node). A binding never changes, and a node is not bound to a partition that
another connected node holds; replies are checked against the binding, so a node
cannot reply for another's partition (docs/robustness.md, "Reply checks").

Under differential privacy (:attr:`PartitionSampler.secret` set) the training draw
is Poisson sampling instead: each training partition independently with probability
``fraction``, from a generator of the server's secret and the round
(:mod:`fedspc_app.core.dp_mechanism`), so that the run-config and the clients drawn in
past rounds say nothing of who a round draws, and the privacy account's sampling rate
is the sampler's. Evaluation draws stay seeded.

With held-out clients (``held-out-clients`` = N, the last N partition ids) the draws
are over the first K - N partitions only, exactly as in a run of K - N clients; the
held-out ones are messaged only for their evaluation (:meth:`PartitionSampler.held_out_nodes`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection, Iterable, Sequence
from logging import INFO, WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedspc_app.core.dp_mechanism import SAMPLE, secret_generator
from fedspc_app.core.protocol import CONFIG, METRICS, NODE_QUERY, PARTITION_ID, QUERY
from fedspc_app.core.replies import node_answer_schema, one_line

QUERY_TIMEOUT = 120.0  # seconds for the nodes' partition ids (a node answers from memory)


def sampled_count(clients: int, fraction: float) -> int:
    """How many of ``clients`` a seeded draw of ``fraction`` takes: the floor of the
    product as written in decimal, at least 1 and at most all. The float product
    falls just short of some whole numbers (0.29 × 100 = 28.999999999999996), which
    truncating would sample one client too few; rounding it to 9 decimals first keeps
    every product that was already exact as it was."""
    return min(clients, max(1, math.floor(round(clients * fraction, 9))))


class PartitionSampler:
    """Draws the clients of each round over partition ids.

    Parameters
    ----------
    num_partitions : int
        K, the number of clients of the run.
    seed : int
        The run's seed; with the round and the phase it fixes every draw.
    node_wait : float
        Seconds a round waits for missing nodes to connect before it samples among
        the connected ones.
    wait_for : int (default: K)
        How many connected nodes a round waits for.
    held_out : int (default: 0)
        The last ``held_out`` partitions never train: no draw includes them.
    """

    def __init__(self, num_partitions: int, *, seed: int = 0, node_wait: float = 120.0,
                 wait_for: int = 0, held_out: int = 0) -> None:
        if not 0 <= held_out < num_partitions:
            raise ValueError(f"held_out must be in [0, {num_partitions}), got {held_out}")
        self.num_partitions = num_partitions
        self.held_out = held_out
        self.training = num_partitions - held_out  # partitions 0 .. training-1 train
        self.seed = seed
        self.node_wait = node_wait
        self.wait_for = wait_for or num_partitions
        self.partition_of: dict[int, int] = {}  # node id -> its bound partition id
        # Differential privacy: the server's secret; training draws are Poisson from it.
        self.secret: int | None = None

    def bind(self, node_id: int, partition_id: int,
             online: Collection[int] | None = None) -> str | None:
        """Bind ``node_id`` to ``partition_id``; why not, when refused: a node keeps its
        first partition, and a partition held by another node that is connected (in
        ``online``; ``None``: any node bound so far) is not given to a second one."""
        bound = self.partition_of.get(node_id)
        if bound is not None:
            return (None if bound == partition_id else
                    f"node {node_id} is bound to partition {bound}, it now claims "
                    f"{partition_id}")
        holders = [node for node, partition in self.partition_of.items()
                   if partition == partition_id and (online is None or node in online)]
        if holders:
            return f"partition {partition_id} is held by connected node {holders[0]}"
        self.partition_of[node_id] = partition_id
        return None

    def bind_answers(self, replies: Iterable[Message],
                     online: Collection[int] | None = None) -> None:
        """Bind the nodes of query answers (the partition query, the warm-up) to the
        partition each names; an answer without a valid one, or a refused claim, is
        logged and leaves its node unbound (not messaged)."""
        schema = node_answer_schema(self.num_partitions)
        for reply in replies:
            node = reply.metadata.src_node_id
            reason = schema.check(reply)
            if reason is None:
                reason = self.bind(node, reply.content.metric_records[METRICS][PARTITION_ID],
                                   online)
            if reason is not None:
                log(WARNING, "node %d is not bound to a partition (%s); it is not "
                    "messaged", node, one_line(reason))

    def draw(self, server_round: int, fraction: float, phase: str) -> list[int]:
        """The partition ids drawn for ``phase`` of ``server_round``, sorted (among the
        partitions that train)."""
        if self.secret is not None and phase == MessageType.TRAIN:
            if fraction >= 1.0:
                return list(range(self.training))
            coins = secret_generator(self.secret, server_round, SAMPLE).random(self.training)
            return [int(p) for p in np.flatnonzero(coins < fraction)]
        size = sampled_count(self.training, fraction)
        if size == self.training:
            return list(range(self.training))
        generator = random.Random(f"{self.seed}/{phase}/{server_round}")
        return sorted(generator.sample(range(self.training), size))

    def connected(self, grid: Grid) -> list[int]:
        """The connected node ids, after waiting up to ``node_wait`` for ``wait_for``."""
        deadline = time.monotonic() + self.node_wait
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.wait_for or time.monotonic() >= deadline:
                break
            log(INFO, "Waiting for clients: %d of %d connected", len(nodes), self.wait_for)
            time.sleep(1.0)
        if len(nodes) < self.wait_for:
            log(WARNING, "%d of %d clients connected after %.0f s; going on with them",
                len(nodes), self.wait_for, self.node_wait)
        return nodes

    def ask(self, grid: Grid, nodes: Sequence[int]) -> None:
        """Bind every node in ``nodes`` (the connected ones) not bound yet, from its
        answer to the partition query."""
        unknown = [node for node in nodes if node not in self.partition_of]
        if not unknown:
            return
        log(INFO, "Asking %d client(s) for their partition id", len(unknown))
        messages = [Message(RecordDict({CONFIG: ConfigRecord({QUERY: NODE_QUERY})}),
                            dst_node_id=node, message_type=MessageType.QUERY)
                    for node in unknown]
        self.bind_answers(grid.send_and_receive(messages, timeout=QUERY_TIMEOUT), set(nodes))

    def sample(self, grid: Grid, server_round: int, fraction: float,
               phase: str) -> tuple[list[int], int]:
        """The node ids to message and the number of clients drawn: the connected
        nodes bound to the drawn partitions. When the whole federation is drawn, the
        ``wait_for`` nodes expected count as drawn."""
        drawn = self.draw(server_round, fraction, phase)
        node_of = self.nodes_of(grid, self.connected(grid))
        nodes = [node_of[p] for p in drawn if p in node_of]
        if len(drawn) == self.num_partitions:
            return sorted(nodes), max(len(nodes), self.wait_for)
        return nodes, len(drawn)

    def held_out_nodes(self, grid: Grid) -> tuple[list[int], int]:
        """The connected nodes of the held-out partitions (in partition order), and
        how many held-out clients there are. It does not wait for missing nodes: it
        follows :meth:`sample` of the same phase, which waited."""
        if not self.held_out:
            return [], 0
        node_of = self.nodes_of(grid, sorted(grid.get_node_ids()))
        held = range(self.training, self.num_partitions)
        return [node_of[p] for p in held if p in node_of], self.held_out

    def nodes_of(self, grid: Grid, nodes: Sequence[int]) -> dict[int, int]:
        """Partition id -> node id, over ``nodes`` (binding those not bound yet)."""
        self.ask(grid, nodes)
        online = set(nodes)
        node_of: dict[int, int] = {}
        for node, partition in list(self.partition_of.items()):  # earliest bound first
            if node not in online:
                continue
            if partition not in node_of:
                node_of[partition] = node
                continue
            # A node bound while the partition's node was away, and that node is back:
            # the partition stays with the earlier binding, the later one is undone.
            del self.partition_of[node]
            log(WARNING, "node %d and node %d are both bound to partition %d: it stays "
                "with node %d, node %d is unbound and not messaged", node_of[partition],
                node, partition, node_of[partition], node)
        return node_of
