"""A server optimizer on the shared block: FedAvgM, FedAdam, FedYogi, FedAdagrad
(Hsu et al., 2019; Reddi et al., 2021), by Flower's own implementations.

Flower ships each as a whole-model strategy whose ``aggregate_train`` first averages
the replies (``FedAvg.aggregate_train``) and then steps from ``current_arrays``. This
module runs that step alone: a subclass of Flower's strategy whose averaging stage
returns the aggregate this project already computed (the mean, or a robust rule's
aggregate, which becomes the optimizer's pseudo-gradient), so the step itself is
Flower's code, untouched. It acts on the shared trainable parameters only: shared
buffers (BatchNorm statistics, integer counters) keep the aggregate. With FedSPC,
u_bar is still updated from the clients' reference changes as Algorithm 1 says;
the optimizer moves theta_s only.

Its state (Adam's m_t and v_t, FedAvgM's momentum) is read and restored by key, so
the server's checkpoint holds it and a resumed run steps exactly as an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi

from fedspc_app.core.records import ArrayDict

SERVER_OPTIMIZERS = ("mean", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
_FLOWER = {"fedavgm": FedAvgM, "fedadam": FedAdam, "fedyogi": FedYogi,
           "fedadagrad": FedAdagrad}
# Keys of the state arrays: "<name>/<parameter key>".
MOMENTUM, FIRST_MOMENT, SECOND_MOMENT = "momentum", "m", "v"


class _GivenAggregate(FedAvg):
    """The averaging stage of Flower's strategies, replaced: it returns the aggregate
    set in :attr:`given` (placed after the optimizer class in the MRO, so that the
    optimizer's ``super().aggregate_train`` lands here)."""

    given: ArrayRecord | None = None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.given, None


_STEPPERS = {name: type(f"{cls.__name__}Step", (cls, _GivenAggregate), {})
             for name, cls in _FLOWER.items()}


class ServerOptimizer:
    """One of Flower's server optimizers applied to ``keys`` of the shared block.

    Parameters
    ----------
    name : {"fedavgm", "fedadam", "fedyogi", "fedadagrad"}
    keys : Sequence[str]
        The shared trainable parameters it steps.
    learning_rate : float (default: 0.0, meaning Flower's default for ``name``)
        The server learning rate (FedAvgM's ``server_learning_rate``, FedOpt's ``eta``).
    momentum : float (default: 0.0)
        FedAvgM's server momentum.
    beta1, beta2, tau : float
        FedAdam's and FedYogi's moment decays and, with FedAdagrad, the adaptivity
        ``tau`` (0: Flower's default).
    """

    def __init__(self, name: str, keys: Sequence[str], *, learning_rate: float = 0.0,
                 momentum: float = 0.0, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 0.0) -> None:
        if name not in _FLOWER:
            raise ValueError(f"server optimizer must be one of {tuple(_FLOWER)}, got {name!r}")
        self.name = name
        self.keys = tuple(keys)
        options: dict[str, float] = {}
        if name == "fedavgm":
            options["server_momentum"] = momentum
            if learning_rate:
                options["server_learning_rate"] = learning_rate
        else:
            if learning_rate:
                options["eta"] = learning_rate
            if tau:
                options["tau"] = tau
            if name in ("fedadam", "fedyogi"):
                options.update(beta_1=beta1, beta_2=beta2)
        self.flower = _STEPPERS[name](**options)

    def step(self, server_round: int, current: Mapping[str, np.ndarray],
             aggregate: ArrayDict) -> ArrayDict:
        """The aggregate with :attr:`keys` replaced by the optimizer's step from
        ``current`` (the broadcast theta_s^t) towards ``aggregate``."""
        if not self.keys:
            return dict(aggregate)
        start = ArrayRecord({k: Array(np.ascontiguousarray(current[k])) for k in self.keys})
        flower = self.flower
        flower.given = ArrayRecord({k: Array(np.ascontiguousarray(aggregate[k]))
                                   for k in self.keys})
        if self.name == "fedavgm":
            flower.current_arrays = start
        else:
            flower.current_arrays = {k: start[k].numpy() for k in self.keys}
        stepped, _ = flower.aggregate_train(server_round, [])
        flower.given = None
        out = dict(aggregate)
        for key in self.keys:
            out[key] = np.asarray(stepped[key].numpy(), dtype=aggregate[key].dtype)
        return out

    # ------------------------------------------------------------------ state
    def state_arrays(self) -> ArrayDict:
        """The optimizer's state by key (empty before its first step)."""
        flower = self.flower
        if self.name == "fedavgm":
            vector = flower.momentum_vector
            return ({f"{MOMENTUM}/{k}": np.asarray(v) for k, v in zip(self.keys, vector)}
                    if vector is not None else {})
        state: ArrayDict = {}
        for prefix, moments in ((FIRST_MOMENT, flower.m_t), (SECOND_MOMENT, flower.v_t)):
            state.update({f"{prefix}/{k}": np.asarray(v) for k, v in (moments or {}).items()})
        return state

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_arrays` returned (a checkpoint's)."""
        flower = self.flower

        def part(prefix: str) -> dict[str, np.ndarray] | None:
            found = {k[len(prefix) + 1:]: np.asarray(v) for k, v in state.items()
                     if k.startswith(prefix + "/")}
            if not found:
                return None
            if set(found) != set(self.keys):
                raise ValueError(f"the checkpoint's server-optimizer state ({prefix}) does "
                                 "not cover the shared trainable parameters")
            return found

        if self.name == "fedavgm":
            momentum = part(MOMENTUM)
            flower.momentum_vector = ([momentum[k] for k in self.keys]
                                      if momentum is not None else None)
        else:
            flower.m_t, flower.v_t = part(FIRST_MOMENT), part(SECOND_MOMENT)
