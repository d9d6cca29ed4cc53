"""Run the real ServerApp and ClientApp in one process, without Ray or a SuperLink.

:class:`InProcessGrid` is a Flower ``Grid`` that hands every message to the
ClientApp of its destination node directly, like the simulation engine does:
each node has its own ``Context`` whose state is kept only when the handler
succeeded (an exception becomes an error reply). Every message and reply is
deep-copied on the way (no object is shared between server and client, as over a
network) and recorded, so tests can inspect exactly what crossed the wire: the
rounds' messages in ``sent`` / ``replies``, the queries (a simulation's warm-up, the
sampler's partition ids) in ``queries`` / ``query_replies``, where the fault-injecting
``deliver`` of a subclass does not see them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    def __init__(self, client_app: ClientApp, num_nodes: int,
                 run_config: Mapping[str, Any], node_ids: Sequence[int] | None = None) -> None:
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 1
        self.client_app = client_app
        # Partition i lives on node_ids[i] (by default node i + 1).
        self.node_ids = list(node_ids or range(1, num_nodes + 1))
        self.contexts: dict[int, Context] = {
            node_id: Context(
                run_id=1,
                node_id=node_id,
                node_config={"partition-id": partition_id, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for partition_id, node_id in enumerate(self.node_ids)
        }
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self.queries: list[Message] = []
        self.query_replies: list[Message] = []
        self.fail_nodes: set[int] = set()
        self.unread: dict[str, Message] = {}
        self._ids = itertools.count(1)

    # The Grid interface -------------------------------------------------------
    def set_run(self, run) -> None:
        pass

    @property
    def run(self):
        raise NotImplementedError("InProcessGrid has no Run object")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type,
                       dst_node_id=dst_node_id, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages):
        """Deliver each message at once; its reply waits for :meth:`pull_messages`."""
        ids = []
        for message in messages:
            message = copy.deepcopy(message)
            message_id = f"m{next(self._ids)}"
            message.metadata.__dict__["_message_id"] = message_id
            if message.metadata.message_type == MessageType.QUERY:
                self.queries.append(message)
                reply = InProcessGrid.deliver(self, message)
                self.query_replies.append(reply)
            else:
                self.sent.append(message)
                reply = self.deliver(message)
                self.replies.append(reply)
            self.unread[message_id] = copy.deepcopy(reply)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.unread.pop(i) for i in list(message_ids) if i in self.unread]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))

    # -------------------------------------------------------------------------
    def deliver(self, message: Message) -> Message:
        node_id = message.metadata.dst_node_id
        context = self.contexts[node_id]
        trial = copy.deepcopy(context)
        try:
            if node_id in self.fail_nodes:
                raise RuntimeError(f"node {node_id} was told to fail")
            reply = self.client_app(message, trial)
        except Exception as error:  # becomes an error reply, as in Flower
            return Message(Error(code=0, reason=f"{type(error).__name__}: {error}"),
                           reply_to=message)
        self.contexts[node_id] = trial
        return reply

    def state(self, partition_id: int) -> RecordDict:
        return self.contexts[self.node_ids[partition_id]].state


def run_server(grid: Grid, run_config: Mapping[str, Any]) -> str | None:
    """Run the real ServerApp on ``grid``; the message it stopped with (its
    ``SystemExit``), or ``None`` when it ran to the end."""
    from fedspc_app import server_app

    try:
        server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                      run_config=dict(run_config)))
    except SystemExit as stop:
        return str(stop)
    return None
