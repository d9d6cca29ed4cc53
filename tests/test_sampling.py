"""Each round's clients: drawn over partition ids from the seed (strategies.sampling)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from virtual_clock import Clock

from fedspc_app.core.protocol import NODE_QUERY
from fedspc_app.core.records import to_record
from strategies import FedSPC, PersonalizedFedAvg, sampling
from strategies.sampling import PartitionSampler

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampling, "time", clock)
    return clock


class Nodes:
    """A Grid with ``nodes`` (node id -> partition id) that answers partition queries."""

    def __init__(self, nodes: dict[int, int]) -> None:
        self.nodes = nodes
        self.queried: list[int] = []
        self.drop_key = None  # a node that answers without its partition id

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            assert message.metadata.message_type == MessageType.QUERY
            assert message.content.config_records["config"]["query"] == NODE_QUERY
            node = message.metadata.dst_node_id
            self.queried.append(node)
            metrics = MetricRecord()
            if node != self.drop_key:
                # Set past MetricRecord's own type check: what a node could send.
                metrics.__dict__["_data"]["partition-id"] = self.nodes[node]
            reply = Message(RecordDict({"metrics": metrics}), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies


def with_ids(ids) -> dict[int, int]:
    return {node: partition for partition, node in enumerate(ids)}


def test_the_draw_is_a_function_of_seed_round_and_phase():
    sampler = PartitionSampler(10, seed=3)
    first = sampler.draw(5, 0.3, "train")
    assert len(first) == 3 and first == sorted(set(first))
    assert PartitionSampler(10, seed=3).draw(5, 0.3, "train") == first
    draws = {tuple(sampler.draw(r, 0.3, "train")) for r in range(1, 21)}
    assert len(draws) > 10  # rounds draw different clients

    def run(sampler, phase):
        return [sampler.draw(r, 0.3, phase) for r in range(1, 21)]

    assert run(sampler, "evaluate") != run(sampler, "train")
    assert run(PartitionSampler(10, seed=4), "train") != run(sampler, "train")
    assert sampler.draw(1, 1.0, "train") == list(range(10))
    assert sampler.draw(1, 0.01, "train") == sampler.draw(1, 0.01, "train")
    assert len(sampler.draw(1, 0.01, "train")) == 1  # at least one client


@pytest.mark.parametrize(("clients", "fraction", "count"), [
    (100, 0.29, 29), (100, 0.57, 57), (100, 0.58, 58), (50, 0.58, 29),
    (10, 0.7, 7), (1000, 0.009, 9), (10, 0.3, 3), (10, 0.35, 3), (3, 0.67, 2),
    (10, 0.01, 1), (10, 1.0, 10)])
def test_a_fraction_samples_the_floor_of_its_decimal_product(clients, fraction, count):
    # 0.29 * 100 is 28.999999999999996 as a float: truncated, one client short.
    for phase in ("train", "evaluate"):
        assert len(PartitionSampler(clients, seed=1).draw(2, fraction, phase)) == count
    assert sampling.sampled_count(clients, fraction) == count


def test_the_plain_loop_samples_as_many_clients_as_the_server():
    from fedspc_app.serial import _sample
    rng = np.random.default_rng(0)
    assert len(_sample(rng, 100, 0.29)) == 29 and len(_sample(rng, 50, 0.58)) == 29


def test_the_same_partitions_are_sampled_whatever_the_node_ids():
    chosen = []
    for ids in ([11, 12, 13, 14, 15, 16], [906, 4, 77, 1000, 52, 8]):
        grid = Nodes(with_ids(ids))
        sampler = PartitionSampler(6, seed=0)
        nodes, drawn = sampler.sample(grid, 2, 0.5, "train")
        assert drawn == 3 and sorted(grid.queried) == sorted(ids)
        chosen.append([grid.nodes[n] for n in nodes])
        # Asked once: the next round uses what it learnt.
        sampler.sample(grid, 3, 0.5, "train")
        assert len(grid.queried) == 6
    assert chosen[0] == chosen[1]


def test_every_connected_node_when_the_whole_federation_is_drawn():
    grid = Nodes(with_ids([5, 9, 2]))
    sampler = PartitionSampler(3)
    nodes, drawn = sampler.sample(grid, 1, 1.0, "train")
    assert nodes == [2, 5, 9] and drawn == 3
    assert sorted(grid.queried) == [2, 5, 9]  # each bound to its partition once
    assert sampler.sample(grid, 2, 1.0, "train") == ([2, 5, 9], 3)
    assert len(grid.queried) == 3


def test_nodes_bound_before_round_1_are_not_asked():
    grid = Nodes(with_ids([5, 9, 2]))
    sampler = PartitionSampler(3)
    for node, partition in grid.nodes.items():  # the warm-up's or preflight's answers
        assert sampler.bind(node, partition) is None
    assert sampler.sample(grid, 1, 1.0, "train") == ([2, 5, 9], 3)
    assert grid.queried == []


def test_a_binding_never_changes_and_a_held_partition_is_not_given_twice():
    sampler = PartitionSampler(4)
    assert sampler.bind(10, 1) is None and sampler.bind(10, 1) is None
    assert sampler.bind(10, 2) == "node 10 is bound to partition 1, it now claims 2"
    assert sampler.bind(11, 1) == "partition 1 is held by connected node 10"
    assert sampler.partition_of == {10: 1}
    # Once node 10 is gone (a restarted node comes back under a new id), its partition
    # goes to the node that claims it.
    assert sampler.bind(11, 1, online={11}) is None
    assert sampler.partition_of == {10: 1, 11: 1}


def test_a_partition_taken_while_its_node_was_away_goes_back_when_it_returns():
    """Node 4 (partition 3) misses a round; node 9 claims partition 3 and is bound to
    it. When node 4 comes back under its id, partition 3 stays with node 4, node 9 is
    unbound and never messaged again (it was, before: the later binding won)."""
    grid = Nodes({1: 0, 2: 1, 3: 2})  # node 4 is away
    sampler = PartitionSampler(4, node_wait=0.0)
    for node, partition in {1: 0, 2: 1, 3: 2, 4: 3}.items():
        assert sampler.bind(node, partition) is None
    grid.nodes[9] = 3  # the claimant answers the query with partition 3
    assert sampler.sample(grid, 1, 1.0, "train")[0] == [1, 2, 3, 9]
    grid.nodes[4] = 3  # node 4 is back
    for server_round in (2, 3):
        assert sampler.sample(grid, server_round, 1.0, "train")[0] == [1, 2, 3, 4]
    assert 9 not in sampler.partition_of and sampler.partition_of[4] == 3


def test_a_node_claiming_a_connected_nodes_partition_is_not_messaged():
    # Node 7 answers the partition query with node 5's partition 0: it stays unbound,
    # so it is never messaged, and node 5 keeps its partition.
    grid = Nodes({5: 0, 6: 1, 7: 0})
    sampler = PartitionSampler(2)
    nodes, drawn = sampler.sample(grid, 1, 1.0, "train")
    assert nodes == [5, 6] and drawn == 2 and sampler.partition_of == {5: 0, 6: 1}


@pytest.mark.parametrize("answer", [True, 1.0, [1], -1, 2, None],
                         ids=["bool", "float", "list", "negative", "too-large", "missing"])
def test_an_invalid_partition_answer_leaves_the_node_unbound(answer):
    grid = Nodes({5: 0, 6: answer})
    if answer is None:
        grid.nodes[6] = 0
        grid.drop_key = 6
    sampler = PartitionSampler(2)
    sampler.ask(grid, [5, 6])
    assert sampler.partition_of == {5: 0}


def test_a_missing_node_is_waited_for_then_counted_as_not_replying(clock):
    grid = Nodes(with_ids([21, 22, 23, 24]))
    del grid.nodes[23]  # partition 2 is gone
    sampler = PartitionSampler(4, seed=0, node_wait=30.0)
    nodes, drawn = sampler.sample(grid, 1, 1.0, "train")
    assert 30.0 <= clock.now < 32.0  # waited node-wait seconds, not forever
    assert nodes == [21, 22, 24] and drawn == 4
    for server_round in range(1, 30):  # find a round whose draw includes partition 2
        partitions = sampler.draw(server_round, 0.5, "train")
        if 2 in partitions:
            break
    nodes, drawn = sampler.sample(grid, server_round, 0.5, "train")
    assert drawn == 2 and [grid.nodes[n] for n in nodes] == [p for p in partitions if p != 2]


def test_replies_do_not_teach_the_partition_of_a_node():
    # Only the answers before training bind a node; a train reply of an unbound node
    # is dropped and teaches nothing.
    strategy = PersonalizedFedAvg(shared_keys=["w"], num_partitions=2, fraction_train=0.5)
    strategy.broadcast = {"w": np.zeros(2, np.float32)}
    for node, partition in ((40, 0), (41, 1)):
        reply = Message(RecordDict({
            "arrays": to_record({"w": np.ones(2, np.float32)}),
            "metrics": MetricRecord({"num-examples": 5, "partition-id": partition})}),
            reply_to=Message(RecordDict(), dst_node_id=node,
                             message_type=MessageType.TRAIN))
        reply.metadata.__dict__["_src_node_id"] = node
        assert "bound to no partition" in strategy.check_reply(reply)
    assert strategy.sampler.partition_of == {}
    grid = Nodes({40: 0, 41: 1})
    messages = strategy.configure_train(2, to_record({"w": np.zeros(2, np.float32)}),
                                        ConfigRecord(), grid)
    assert sorted(grid.queried) == [40, 41] and len(messages) == 1
    assert strategy.sampler.partition_of == {40: 0, 41: 1}


def test_fedspc_divides_by_the_runs_clients_not_by_the_connected_nodes():
    # Three clients in the run; the grid also lists a stale fourth node id. One client
    # trains, with a reference change c: u_bar must become c / 3.
    strategy = FedSPC(shared_keys=["w"], num_partitions=3, corrected_keys=["w"],
                      learning_rate=0.5, upload="explicit")
    grid = Nodes(with_ids([1, 2, 3, 4]))
    messages = list(strategy.configure_train(
        1, ArrayRecord({"w": to_record({"w": np.zeros(2, np.float32)})["w"]}),
        ConfigRecord(), grid))
    # The change its update implies (an explicit upload must be): -Delta / (E eta).
    change = np.array([-0.5, -0.5], np.float32)
    reply = Message(RecordDict({
        "arrays": to_record({"w": np.array([0.5, 0.5], np.float32)}),
        "reference-change": to_record({"w": change}),
        "metrics": MetricRecord({"num-examples": 4, "partition-id": 0, "shared-steps": 2})}),
        reply_to=messages[0])
    reply.metadata.__dict__["_src_node_id"] = messages[0].metadata.dst_node_id
    strategy.min_train_replies = 0.1
    strategy.aggregate_train(1, [reply])
    np.testing.assert_allclose(strategy.global_reference["w"], change / 3)
