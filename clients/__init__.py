"""Client-side logic: local training of any registered method, and client state.

The client keeps its personalized parameters, its FedSPC/SCAFFOLD local reference
``u_k`` and (Ditto) its personal model in :class:`~clients.state.ClientState`,
which lives in Flower's ``context.state`` and is committed only after a round
succeeded.
"""

from clients.local import ClientJob, EvaluateOutcome, TrainOutcome, evaluate_client, train_client
from clients.state import ClientState

__all__ = [
    "ClientJob", "ClientState", "EvaluateOutcome", "TrainOutcome", "evaluate_client",
    "train_client",
]
