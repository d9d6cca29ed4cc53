"""Algorithm 1 (FedSPC), SCAFFOLD and FedProx against small cases computed by hand.

The model is ``f(x) = h * (w * x)`` with one scalar "body" weight ``w`` and one
scalar "head" weight ``h``; the loss is ``(f(x) - y)^2 / 2`` on one sample per
client, so one local epoch is one SGD step and every number can be followed on
paper. The gradients are ``dL/dw = r h x`` and ``dL/dh = r w x`` with
``r = h w x - y``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from torch import nn

from clients import ClientJob, ClientState, train_client
from fedspc_app.core.config import RunConfig
from fedspc_app.core.methods import get_method
from fedspc_app.core.records import to_record
from fedspc_app.models.split import parameter_split
from strategies import FedSPC

ETA = 0.1
CLIENTS = {0: (1.0, 2.0), 1: (2.0, -1.0)}  # partition id -> (x, y)


class TwoScalars(nn.Module):
    """``h * (w * x)`` with w the body and h the head."""

    def __init__(self, w: float = 0.5, h: float = 1.0) -> None:
        super().__init__()
        self.body = nn.Linear(1, 1, bias=False)
        self.head = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.body.weight.fill_(w)
            self.head.weight.fill_(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(1)

    def get_classifier(self) -> nn.Module:
        return self.head


def half_squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - target) ** 2).mean()


@dataclass
class OneSample:
    """Stands in for ClientData: one (x, y) pair, one batch per epoch."""

    x: float
    y: float
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable

    @property
    def train_indices(self) -> np.ndarray:
        return np.zeros(1, dtype=np.int64)

    def batches(self, split, generator=None):
        def epoch():
            yield (torch.tensor([[self.x]], dtype=torch.float64),
                   torch.tensor([self.y], dtype=torch.float64))
        return epoch


def config(**changes) -> RunConfig:
    base = dict(learning_rate=ETA, local_epochs=2, momentum=0.0, weight_decay=0.0,
                proximal_mu=0.0)
    base.update(changes)
    return RunConfig(**base)


def client_round(method_name: str, cfg: RunConfig, received: dict, state: ClientState,
                 pid: int, global_reference=None):
    method = get_method(method_name)
    model = TwoScalars().double()
    split = parameter_split(model, method)
    x, y = CLIENTS[pid]
    job = ClientJob(cfg, method, model, split,
                    {k: np.asarray(v, dtype=np.float64) for k, v in received.items()},
                    state, OneSample(x, y), partition_id=pid)
    return train_client(job, global_reference=global_reference, loss_fn=half_squared_error)


def scalar(arrays: dict, key: str) -> float:
    return float(np.asarray(arrays[key]).reshape(()))


# ---------------------------------------------------------------- by hand
def test_fedspc_client_round_one_by_hand():
    """FedPer + FedSPC, round 1 (u_k = u_bar = 0): the correction is zero.

    Client 0 (x=1, y=2), w=0.5, h=1, eta=0.1, two steps:
      step 1: r = -1.5,       gw = -1.5,        gh = -0.75      -> w = 0.65,  h = 1.075
      step 2: r = -1.30125,   gw = -1.39884375, gh = -0.8458125 -> w = 0.789884375,
                                                                    h = 1.15958125
      Delta w = 0.289884375;  u_0^1 = 0 - 0 - 0.289884375 / (2 * 0.1) = -1.449421875
    Client 1 (x=2, y=-1):
      step 1: r = 2,    gw = 4,     gh = 2     -> w = 0.1,     h = 0.8
      step 2: r = 1.16, gw = 1.856, gh = 0.232 -> w = -0.0856, h = 0.7768
      Delta w = -0.5856;  u_1^1 = 0.5856 / 0.2 = 2.928
    """
    cfg = config(fedspc=True, method="fedper")
    zero = {"body.weight": np.zeros((1, 1))}
    out0 = client_round("fedper", cfg, {"body.weight": [[0.5]]}, ClientState(), 0, zero)
    out1 = client_round("fedper", cfg, {"body.weight": [[0.5]]}, ClientState(), 1, zero)

    assert out0.shared_steps == 2 and out1.shared_steps == 2
    assert scalar(out0.shared, "body.weight") == pytest.approx(0.789884375, abs=1e-6)
    assert scalar(out0.state.personal, "head.weight") == pytest.approx(1.15958125, abs=1e-6)
    assert scalar(out0.state.local_reference, "body.weight") == pytest.approx(-1.449421875,
                                                                             abs=1e-5)
    assert scalar(out1.shared, "body.weight") == pytest.approx(-0.0856, abs=1e-6)
    assert scalar(out1.state.personal, "head.weight") == pytest.approx(0.7768, abs=1e-6)
    assert scalar(out1.state.local_reference, "body.weight") == pytest.approx(2.928, abs=1e-5)
    # The head is personal: it is neither uploaded nor corrected.
    assert set(out0.shared) == {"body.weight"}
    assert set(out0.state.local_reference) == {"body.weight"}


def test_fedspc_client_round_two_applies_the_correction_by_hand():
    """Round 2 of client 0 with u_0 = -1.449421875 and u_bar = 0.7392890625.

    The correction added to every body gradient is u_bar - u_0 = 2.1887109375.
    Start: w = 0.3521421875 (the server's round-1 result), h = 1.15958125 (kept).
      step 1: r = h w x - y = 0.408339... - 2 = -1.5916600...,
              gw = r h x = -1.8456592...,  gh = r w x = -0.5604957...
              w = 0.35214219 - 0.1 * (-1.8456592 + 2.1887109) = 0.31783702
              h = 1.15958125 + 0.05604957 = 1.21563082
    """
    w, h, c = 0.3521421875, 1.15958125, 2.1887109375
    x, y = CLIENTS[0]
    for _ in range(2):  # the same arithmetic as the docstring, twice
        r = h * w * x - y
        gw, gh = r * h * x, r * w * x
        w, h = w - ETA * (gw + c), h - ETA * gh
    cfg = config(fedspc=True, method="fedper")
    state = ClientState(personal={"head.weight": np.array([[1.15958125]])},
                        local_reference={"body.weight": np.array([[-1.449421875]])})
    out = client_round("fedper", cfg, {"body.weight": [[0.3521421875]]}, state, 0,
                       {"body.weight": np.array([[0.7392890625]], dtype=np.float32)})
    assert scalar(out.shared, "body.weight") == pytest.approx(w, abs=1e-6)
    assert scalar(out.state.personal, "head.weight") == pytest.approx(h, abs=1e-6)
    # u_0^2 = u_0^1 - u_bar^1 - (w_final - w_start) / (E eta)
    expected_u = -1.449421875 - 0.7392890625 - (w - 0.3521421875) / (2 * ETA)
    assert scalar(out.state.local_reference, "body.weight") == pytest.approx(expected_u,
                                                                            abs=1e-4)
    assert out.state.rounds_trained == 1


def reply(outcome, node_id: int) -> Message:
    content = RecordDict({
        "arrays": to_record({k: v.astype(np.float32) for k, v in outcome.shared.items()}),
        "metrics": MetricRecord({**outcome.metrics, "num-examples": 1,
                                 "partition-id": node_id - 1}),
    })
    message = Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_src_node_id"] = node_id  # what the SuperLink sets
    return message


class TwoNodes:
    """Nodes 1 and 2, holding partitions 0 and 1 (they say so when asked)."""

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, *, timeout=None):
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"q{message.metadata.dst_node_id}"
        return [Message(RecordDict({"metrics": MetricRecord(
            {"partition-id": m.metadata.dst_node_id - 1})}), reply_to=m) for m in messages]


def test_fedspc_server_rounds_by_hand(task_identity):
    """Server step 4 over two rounds, the second with client 0 only (K = 2).

    Round 1: w^1 = 0.5 + (0.289884375 - 0.5856) / 2 = 0.3521421875
             u_bar^1 = (1/2)(-1.449421875 + 2.928) = 0.7392890625
    Round 2 (only client 0 trains): w^2 = w_0's result;
             u_bar^2 = u_bar^1 + (1/2)(u_0^2 - u_0^1)
    """
    from flwr.app import ConfigRecord

    cfg = config(fedspc=True, method="fedper")
    strategy = FedSPC(shared_keys=["body.weight"], corrected_keys=["body.weight"],
                      learning_rate=ETA)
    start = to_record({"body.weight": np.array([[0.5]], dtype=np.float32)})
    messages = list(strategy.configure_train(1, start, ConfigRecord(), TwoNodes()))
    reference = messages[0].content.array_records["global-reference"]
    assert scalar({k: a.numpy() for k, a in reference.items()}, "body.weight") == 0.0

    zero = {"body.weight": np.zeros((1, 1), dtype=np.float32)}
    outs = [client_round("fedper", cfg, {"body.weight": [[0.5]]}, ClientState(), pid, zero)
            for pid in (0, 1)]
    arrays, _ = strategy.aggregate_train(1, [reply(o, i + 1) for i, o in enumerate(outs)])
    w1 = scalar({k: a.numpy() for k, a in arrays.items()}, "body.weight")
    assert w1 == pytest.approx(0.3521421875, abs=1e-6)
    assert scalar(strategy.global_reference, "body.weight") == pytest.approx(0.7392890625,
                                                                            abs=1e-5)

    # Round 2: only client 0 replies; K stays the number of connected nodes (2).
    strategy.configure_train(2, arrays, ConfigRecord(), TwoNodes())
    u_bar_1 = strategy.global_reference
    out = client_round("fedper", cfg, {"body.weight": [[w1]]}, outs[0].state, 0, u_bar_1)
    arrays2, _ = strategy.aggregate_train(2, [reply(out, 1)])
    assert scalar({k: a.numpy() for k, a in arrays2.items()}, "body.weight") == pytest.approx(
        scalar(out.shared, "body.weight"), abs=1e-6)
    change = (scalar(out.state.local_reference, "body.weight")
              - scalar(outs[0].state.local_reference, "body.weight"))
    assert scalar(strategy.global_reference, "body.weight") == pytest.approx(
        0.7392890625 + change / 2, abs=1e-4)


def test_scaffold_one_round_by_hand():
    """SCAFFOLD (everything shared) with c = c_k = 0 in round 1 is plain SGD on w and h.

    Client 0 after two steps: w = 0.789884375, h = 1.15958125 (as above), and
    c_0 = -(final - start) / (K eta) for both: c_w = -1.449421875, c_h = -0.7979062...
    """
    cfg = config(method="scaffold")
    zero = {"body.weight": np.zeros((1, 1)), "head.weight": np.zeros((1, 1))}
    out = client_round("scaffold", cfg, {"body.weight": [[0.5]], "head.weight": [[1.0]]},
                       ClientState(), 0, zero)
    assert set(out.shared) == {"body.weight", "head.weight"}
    assert out.state.personal is None
    assert scalar(out.shared, "head.weight") == pytest.approx(1.15958125, abs=1e-6)
    assert scalar(out.state.local_reference, "body.weight") == pytest.approx(-1.449421875,
                                                                            abs=1e-5)
    assert scalar(out.state.local_reference, "head.weight") == pytest.approx(
        -(1.15958125 - 1.0) / 0.2, abs=1e-5)


def test_scaffold_correction_by_hand():
    """With c - c_k = (0.3, -0.2) every step's gradient is shifted by that amount."""
    w, h = 0.5, 1.0
    x, y = CLIENTS[1]
    for _ in range(2):
        r = h * w * x - y
        gw, gh = r * h * x, r * w * x
        w, h = w - ETA * (gw + 0.3), h - ETA * (gh - 0.2)
    cfg = config(method="scaffold")
    state = ClientState(local_reference={"body.weight": np.array([[0.1]]),
                                         "head.weight": np.array([[0.0]])})
    c = {"body.weight": np.array([[0.4]]), "head.weight": np.array([[-0.2]])}
    out = client_round("scaffold", cfg, {"body.weight": [[0.5]], "head.weight": [[1.0]]},
                       state, 1, c)
    assert scalar(out.shared, "body.weight") == pytest.approx(w, abs=1e-6)
    assert scalar(out.shared, "head.weight") == pytest.approx(h, abs=1e-6)
    # c_k^+ = c_k - c + (x - y_k)/(K eta)
    assert scalar(out.state.local_reference, "body.weight") == pytest.approx(
        0.1 - 0.4 - (w - 0.5) / 0.2, abs=1e-5)


def test_fedprox_one_round_by_hand():
    """FedProx adds mu (theta - theta^t) to every gradient; mu = 0.5.

    Client 0, step 1: theta = theta^t, so the proximal gradient is 0 ->
    w = 0.65, h = 1.075. Step 2: gw = -1.39884375 + 0.5 * 0.15 = -1.32384375,
    gh = -0.8458125 + 0.5 * 0.075 = -0.8083125 -> w = 0.782384375, h = 1.15583125.
    """
    cfg = config(method="fedprox", proximal_mu=0.5)
    out = client_round("fedprox", cfg, {"body.weight": [[0.5]], "head.weight": [[1.0]]},
                       ClientState(), 0)
    assert scalar(out.shared, "body.weight") == pytest.approx(0.782384375, abs=1e-6)
    assert scalar(out.shared, "head.weight") == pytest.approx(1.15583125, abs=1e-6)
    assert out.state.local_reference is None


def test_fedrep_counts_only_body_steps_for_the_reference():
    """FedRep: 1 head epoch (body frozen), then 2 body epochs; E = 2, not 3."""
    cfg = config(method="fedrep", fedspc=True, fedrep_head_epochs=1)
    zero = {"body.weight": np.zeros((1, 1))}
    out = client_round("fedrep", cfg, {"body.weight": [[0.5]]}, ClientState(), 0, zero)
    assert out.shared_steps == 2
    # Head first with w = 0.5 fixed: r = -1.5, gh = -0.75 -> h = 1.075.
    # Then the body with h = 1.075 fixed.
    w, h, x, y = 0.5, 1.075, 1.0, 2.0
    for _ in range(2):
        w -= ETA * (h * w * x - y) * h * x
    assert scalar(out.shared, "body.weight") == pytest.approx(w, abs=1e-6)
    assert scalar(out.state.personal, "head.weight") == pytest.approx(1.075, abs=1e-6)
    assert scalar(out.state.local_reference, "body.weight") == pytest.approx(
        -(w - 0.5) / (2 * ETA), abs=1e-5)


DITTO_RECEIVED = {"body.weight": [[0.5]], "head.weight": [[1.0]]}


def ditto_round(ditto_lambda: float, state: ClientState | None = None, fedspc: bool = True):
    """Client 0 (x=1, y=2): one global epoch, two personal epochs (two steps on v_k)."""
    cfg = config(method="ditto", fedspc=fedspc, ditto_lambda=ditto_lambda,
                 ditto_personal_epochs=2, local_epochs=1)
    u_bar = {"body.weight": np.array([[1.0]]), "head.weight": np.array([[0.0]])}
    return client_round("ditto", cfg, DITTO_RECEIVED, state or ClientState(), 0,
                        u_bar if fedspc else None)


@pytest.mark.parametrize(
    ("ditto_lambda", "v_w", "v_h"),
    [(0.0, 0.789884375, 1.15958125),
     (1.0, 0.774884375, 1.15208125),
     (2.0, 0.759884375, 1.14458125)],
)
def test_ditto_corrects_the_global_model_only(ditto_lambda, v_w, v_h):
    """Ditto + FedSPC: the global model gets the correction, v_k only its proximal pull.

    Global model (theta^t: w=0.5, h=1), one step with correction (u_bar - u_k) = (1, 0):
      r = 0.5 - 2 = -1.5, gw = -1.5 + 1 = -0.5, gh = -0.75
      -> w = 0.5 + 0.05 = 0.55, h = 1 + 0.075 = 1.075
    Personal model v (starts at theta^t: w=0.5, h=1), gradient of
    L + (lam/2) ||v - theta^t||^2, no correction, two steps:
      step 1: r = -1.5, gw = -1.5 + lam * 0 = -1.5, gh = -0.75 + lam * 0 = -0.75
              -> w = 0.65, h = 1.075 (the pull is zero: v = theta^t)
      step 2: r = 1.075 * 0.65 - 2 = -1.30125
              gw = r h = -1.39884375 + lam * 0.15
              gh = r w = -0.8458125  + lam * 0.075
              -> w = 0.65 + 0.139884375 - 0.015 lam = 0.789884375 - 0.015 lam
                 h = 1.075 + 0.08458125 - 0.0075 lam = 1.15958125 - 0.0075 lam
      lam = 0: (0.789884375, 1.15958125); lam = 1: (0.774884375, 1.15208125);
      lam = 2: (0.759884375, 1.14458125).
    """
    out = ditto_round(ditto_lambda)
    assert scalar(out.shared, "body.weight") == pytest.approx(0.55, abs=1e-9)
    assert scalar(out.shared, "head.weight") == pytest.approx(1.075, abs=1e-9)
    assert out.shared_steps == 1  # only the global model's step counts for u_k
    assert scalar(out.state.personal_model, "body.weight") == pytest.approx(v_w, abs=1e-9)
    assert scalar(out.state.personal_model, "head.weight") == pytest.approx(v_h, abs=1e-9)
    assert out.state.personal is None
    # u_k^1 = 0 - u_bar - Delta w / (E eta) = -1 - 0.05 / 0.1 = -1.5 (body);
    #         0 - 0 - 0.075 / 0.1 = -0.75 (head)
    assert scalar(out.state.local_reference, "body.weight") == pytest.approx(-1.5, abs=1e-6)
    assert scalar(out.state.local_reference, "head.weight") == pytest.approx(-0.75, abs=1e-6)


def test_ditto_lambda_moves_only_the_personal_model():
    weak, strong = ditto_round(0.0), ditto_round(2.0)
    # The global model and the reference do not depend on lambda ...
    for key in ("body.weight", "head.weight"):
        assert scalar(weak.shared, key) == scalar(strong.shared, key)
        assert scalar(weak.state.local_reference, key) == scalar(
            strong.state.local_reference, key)
    # ... the personal model does: a stronger pull keeps v closer to theta^t.
    for key, start in (("body.weight", 0.5), ("head.weight", 1.0)):
        gap_weak = abs(scalar(weak.state.personal_model, key) - start)
        gap_strong = abs(scalar(strong.state.personal_model, key) - start)
        assert gap_strong < gap_weak - 0.005


def test_ditto_pulls_a_kept_personal_model_towards_the_received_one():
    """Round 2: v_k starts from the client's own v (w=0.8, h=1.2), not from theta^t.

    lam = 1, anchor theta^t = (0.5, 1.0), client 0 (x=1, y=2), two steps:
      step 1: r = 0.8 * 1.2 - 2 = -1.04
              gw = r h + (0.8 - 0.5) = -1.248 + 0.3 = -0.948
              gh = r w + (1.2 - 1.0) = -0.832 + 0.2 = -0.632
              -> w = 0.8948, h = 1.2632
      step 2: r = 0.8948 * 1.2632 - 2 = -0.86968864
              gw = r h + 0.3948 = -1.098590690048 + 0.3948 = -0.703790690048
              gh = r w + 0.2632 = -0.778197395072 + 0.2632 = -0.514997395072
              -> w = 0.9651790690048, h = 1.3146997395072
    """
    state = ClientState(personal_model={"body.weight": np.array([[0.8]]),
                                        "head.weight": np.array([[1.2]])})
    out = ditto_round(1.0, state=state, fedspc=False)
    assert scalar(out.state.personal_model, "body.weight") == pytest.approx(0.9651790690048,
                                                                            abs=1e-9)
    assert scalar(out.state.personal_model, "head.weight") == pytest.approx(1.3146997395072,
                                                                            abs=1e-9)
    # The global model starts from theta^t, not from v: w = 0.65, h = 1.075 (no correction).
    assert scalar(out.shared, "body.weight") == pytest.approx(0.65, abs=1e-9)
    assert scalar(out.shared, "head.weight") == pytest.approx(1.075, abs=1e-9)
    assert out.state.local_reference is None
