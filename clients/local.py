"""Local training and evaluation of any registered method on one client.

:func:`train_client` executes a :class:`~fedspc_app.core.methods.Method` description:
it assembles the model from the received shared parameters and the client's own
personalized ones, runs each phase with the one training loop, adding a
:class:`~fedspc_app.training.loop.ProximalTerm` where the phase asks for one and a
:class:`~fedspc_app.training.loop.DriftCorrection` on the shared block when the control
variates are on (FedSPC, SCAFFOLD), then computes the new local reference
(Algorithm 1, step 3). Nothing here touches Flower messages or ``context.state``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from clients.state import ClientState
from fedspc_app.core.config import RunConfig
from fedspc_app.core.correction import (
    add,
    reference_change,
    shared_update,
    uncorrected_step,
    zeros_like,
)
from fedspc_app.core.dp_mechanism import clip_update, update_norm
from fedspc_app.core.errors import DivergenceError
from fedspc_app.core.methods import Method, Phase
from fedspc_app.core.protocol import (
    EXAMPLES_SEEN,
    LOCAL_CORRECT,
    LOCAL_EXAMPLES,
    NUM_EXAMPLES,
    ROUNDS_TRAINED,
    SHARED_STEPS,
    TRAIN_LOSS,
    WITHIN_CLIPPING_NORM,
)
from fedspc_app.core.records import ArrayDict
from fedspc_app.models.run_model import load_arrays, state_arrays
from fedspc_app.models.split import ParameterSplit
from fedspc_app.training.client_data import ClientData, seeded_generator
from fedspc_app.training.loop import (
    DriftCorrection,
    LossFn,
    ProximalTerm,
    evaluate_model,
    train_epochs,
)


@dataclass(frozen=True)
class TrainOutcome:
    """The result of one round of local training.

    Attributes
    ----------
    shared : dict
        The client's final shared parameters ``theta_{s,k}^{t,E}`` (to upload).
    state : ClientState
        The client state to commit.
    shared_steps : int
        ``E``: optimizer steps that updated the shared block.
    reference_change : dict | None
        ``u_k^{t+1} - u_k^t`` when the control variates are on.
    metrics : dict
        Scalars for the reply (train loss, examples, steps).
    """

    shared: ArrayDict
    state: ClientState
    shared_steps: int
    reference_change: ArrayDict | None
    metrics: dict[str, int | float]


@dataclass(frozen=True)
class EvaluateOutcome:
    """Personalized test metrics of one client.

    ``global_correct`` / ``global_examples``: for a method with a personal model and
    ``evaluate-global-model``, the received global model on the same test split;
    ``None`` otherwise.
    """

    correct: int
    examples: int
    loss_sum: float
    global_correct: int | None = None
    global_examples: int | None = None

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else float("nan")


# Reply metrics of ``evaluate-before-aggregation``.


def uses_control_variates(method: Method, config: RunConfig) -> bool:
    """SCAFFOLD always; any other method when ``fedspc = true``."""
    return method.control_variates or config.fedspc


def keeps_client_state(method: Method, config: RunConfig, split: ParameterSplit) -> bool:
    """Whether a client has state to keep between rounds: personalized parameters,
    a personal model, or a local reference u_k."""
    return bool(split.personal or method.personal_model
                or uses_control_variates(method, config))


def updates_shared(phase: Phase, split: ParameterSplit) -> bool:
    """Whether ``phase`` takes optimizer steps on shared parameters (its steps are E)."""
    return phase.model == "shared" and any(
        key in split.shared and key in split.parameters for key in split.trainable(phase.train))


def expected_shared_steps(method: Method, config: RunConfig, split: ParameterSplit,
                          train_images: int) -> int:
    """E_k, the optimizer steps a client with ``train_images`` training images takes on
    the shared block in a round: each phase that updates it runs its epochs of
    ceil(images / batch-size) batches, or ``local-steps`` steps (what
    :func:`train_client` counts). The server
    checks the replies' reported steps against it."""
    batches = math.ceil(train_images / config.batch_size)
    return sum((config.local_steps or int(getattr(config, phase.epochs)) * batches)
               for phase in method.phases if updates_shared(phase, split))


def device_tensors(arrays: Mapping[str, np.ndarray], keys, device) -> dict[str, torch.Tensor]:
    """``arrays[key]`` for each of ``keys``, as tensors on ``device``."""
    return {key: torch.as_tensor(arrays[key]).to(device) for key in keys}


def assemble(model: nn.Module, split: ParameterSplit, received: Mapping[str, np.ndarray],
             state: ClientState) -> nn.Module:
    """Load the received shared entries and the client's personalized ones.

    Before a client's first round its personalized entries are those of the
    common initial model (every party builds it from the run seed).
    """
    load_arrays(model, received)
    if state.personal is not None:
        load_arrays(model, state.personal)
    return model


@dataclass(frozen=True)
class ClientJob:
    """One client's work in one round: what :func:`train_client` and
    :func:`evaluate_client` take.

    Attributes
    ----------
    model : nn.Module
        A freshly built model of the run (its personalized entries are replaced by
        the client's state when there is one).
    received : dict
        The shared entries broadcast by the server, ``theta_s^t``.
    state : ClientState
        The client's committed state (personalized entries, ``u_k``, personal model).
    """

    config: RunConfig
    method: Method
    model: nn.Module
    split: ParameterSplit
    received: Mapping[str, np.ndarray]
    state: ClientState
    data: ClientData
    server_round: int = 1
    partition_id: int = 0

    def generator(self, purpose: str) -> torch.Generator:
        """The seeded generator of this client's batches for ``purpose``."""
        return seeded_generator(self.config.seed, self.server_round, self.partition_id,
                                purpose)


def train_client(
    job: ClientJob,
    global_reference: Mapping[str, np.ndarray] | None = None,
    loss_fn: LossFn = F.cross_entropy,
) -> TrainOutcome:
    """Run one round of ``job.method``'s local training on this client.

    Parameters
    ----------
    global_reference : dict | None
        ``u_bar^t`` (SCAFFOLD's ``c``) over ``split.corrected``; required when the
        control variates are on.
    loss_fn : callable
        The local objective's data term (default: cross-entropy).
    """
    config, method, split, state, data = job.config, job.method, job.split, job.state, job.data
    received, server_round, partition_id = job.received, job.server_round, job.partition_id
    correct_shared = uses_control_variates(method, config)
    if correct_shared and global_reference is None:
        raise ValueError("the control variates are on but no global reference was sent")
    device = data.device
    model = assemble(job.model, split, received, state).to(device)
    personal_model = None
    if method.personal_model:
        personal_model = copy.deepcopy(model)
        load_arrays(personal_model, state.personal_model or received)

    local_reference = None
    correction = None
    if correct_shared:
        local_reference = state.local_reference or zeros_like(received, split.corrected)
        # -u_k + u_bar, added to every shared gradient (Algorithm 1, step 2).
        correction = {
            key: torch.as_tensor(global_reference[key] - local_reference[key]).to(device)
            for key in split.corrected
        }
    anchor = device_tensors(received, [k for k in split.shared if k in split.parameters], device)

    batches = data.batches("train", job.generator("train"))
    shared_steps = 0
    corrected_steps = dict.fromkeys(split.corrected if correct_shared else (), 0)
    last_loss = float("nan")
    examples_seen = 0
    for phase in method.phases:
        target = personal_model if phase.model == "personal" else model
        trainable = split.trainable(phase.train)
        hooks = []
        if phase.proximal is not None:
            mu = float(getattr(config, phase.proximal))
            hooks.append(ProximalTerm({k: anchor[k] for k in trainable if k in anchor}, mu))
        shared_phase = updates_shared(phase, split)
        if correction is not None and shared_phase:
            hooks.append(DriftCorrection({k: correction[k] for k in trainable if k in correction}))
        # local-steps: the shared phase takes exactly that many steps (every client the
        # same E, which differential privacy needs); the other phases run their epochs.
        fixed = config.local_steps if shared_phase else 0
        try:
            result = train_epochs(
                target,
                batches,
                epochs=int(getattr(config, phase.epochs)),
                trainable=trainable,
                hooks=hooks,
                loss_fn=loss_fn,
                max_steps=fixed,
                **config.step_options,
            )
        except DivergenceError as error:
            raise DivergenceError(f"client {partition_id} diverged in round {server_round} "
                                  f"({phase.train} phase): {error}") from None
        if shared_phase:
            shared_steps += result.steps
            for key in trainable:  # the steps that corrected each key ("level")
                if key in corrected_steps:
                    corrected_steps[key] += result.steps
        if result.examples:
            last_loss = result.mean_loss
            examples_seen += result.examples

    final_shared = state_arrays(model, split.shared)
    level = correct_shared and config.dp and config.dp_reference == "level"
    if level:
        # dp-reference = "level": the release is of the steps the gradients alone took
        # (the correction's own displacement taken out), so the u_bar the server derives
        # from it follows the clients' mean gradient and its noise does not accumulate.
        final_shared = uncorrected_step(final_shared, global_reference, local_reference,
                                        steps=corrected_steps,
                                        learning_rate=config.learning_rate)
    clipping = {}
    if config.dp and config.dp_clipping == "client":
        if config.dp_clipping_quantile > 0:  # adaptive clipping: b_k = 1[‖Δ_k‖ ≤ C_t]
            norm = update_norm(final_shared, received, split.corrected)
            clipping = {WITHIN_CLIPPING_NORM: int(norm <= config.dp_clipping_norm)}
        # Clipped before u_k is staged: u_k follows the update the server sees.
        final_shared = clip_update(final_shared, received, split.corrected,
                                   config.dp_clipping_norm)
    local = {}
    if config.evaluate_before_aggregation and not method.personal_model:
        # The model this client trained (its shared block before the server's averaging).
        correct, examples, _ = _evaluate(config, model, data)
        local = {LOCAL_CORRECT: int(correct), LOCAL_EXAMPLES: int(examples)}
    change = None
    new_reference = None
    if correct_shared:
        update = shared_update(final_shared, received, split.corrected)
        change = reference_change(
            update, local_reference if level else global_reference, steps=shared_steps,
            learning_rate=config.learning_rate)
        if not all(np.all(np.isfinite(value)) for value in change.values()):
            # (1/(E eta) overflowing, or an update too large for float32): staged, such
            # a u_k would break every later round of this client
            raise DivergenceError(
                f"client {partition_id} diverged in round {server_round}: its reference "
                f"change (the update over E * eta, E = {shared_steps}, eta = "
                f"{config.learning_rate:g}) is not finite")
        new_reference = add(local_reference, change)

    new_state = ClientState(
        personal=state_arrays(model, split.personal) if split.personal else None,
        local_reference=new_reference,
        personal_model=(
            state_arrays(personal_model, personal_model.state_dict().keys())
            if personal_model is not None else None
        ),
        rounds_trained=state.rounds_trained + 1,
        round=server_round,
    )
    metrics = {
        NUM_EXAMPLES: len(data.train_indices),
        TRAIN_LOSS: float(last_loss),
        SHARED_STEPS: int(shared_steps),
        EXAMPLES_SEEN: int(examples_seen),
        ROUNDS_TRAINED: new_state.rounds_trained,
        **local,
        **clipping,
    }
    return TrainOutcome(final_shared, new_state, shared_steps, change, metrics)


def evaluate_client(job: ClientJob) -> EvaluateOutcome:
    """Personalized accuracy of this client on its own test split.

    The evaluated model is the received shared block plus the client's
    personalized entries; Ditto evaluates its personal model ``v_k`` (and, with
    ``evaluate-global-model``, then the received global model too); FedBABU first
    fine-tunes (a throw-away copy) on the client's training data. Nothing here
    changes the client state.
    """
    config, method, split, data, received = (job.config, job.method, job.split, job.data,
                                             job.received)
    model = job.model.to(data.device)
    if method.personal_model:
        global_correct = global_examples = None
        if config.evaluate_global_model:
            load_arrays(model, received)
            global_correct, global_examples, _ = _evaluate(config, model, data)
        load_arrays(model, job.state.personal_model or received)
        return EvaluateOutcome(*_evaluate(config, model, data), global_correct, global_examples)
    model = assemble(model, split, received, job.state)
    if method.finetune_before_eval and config.fedbabu_finetune_epochs > 0:
        block = "all" if config.fedbabu_finetune_parts == "all" else "head"
        train_epochs(
            model,
            data.batches("train", job.generator("finetune")),
            epochs=config.fedbabu_finetune_epochs,
            trainable=split.trainable(block),
            **config.step_options,
        )
    return EvaluateOutcome(*_evaluate(config, model, data))


def _evaluate(config: RunConfig, model: nn.Module, data: ClientData) -> tuple[int, int, float]:
    """Correct predictions, examples and summed loss of ``model`` on the test split."""
    return evaluate_model(model, data.batches("test")(), **config.compute_options)
