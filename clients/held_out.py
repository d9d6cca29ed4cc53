"""Clients that never trained (``held-out-clients``): how a new client is tested.

A held-out client joins as a new client would: it receives the current shared block,
starts its personalized part where every client of the run started (the common
initial model; Ditto: its personal model from the received global one), fine-tunes
what ``held-out-parts`` names for ``held-out-epochs`` epochs on its training split, and
is tested on its test split. Nothing it computes is kept or sent except the test
counts: it has no state between evaluations, every evaluation starts afresh from the
shared block of that round.

The fine-tuning is not corrected. FedSPC's correction ``-u_k + u_bar`` acts on the
shared block only, and ``auto``/``personal`` fine-tune only the personalized part, which
Algorithm 1 never corrects. With ``all`` the new client would also train its copy of
the shared block, but the correction estimates how far a client's local steps drift from
the federation's, and a client that never trained has no estimate (its ``u_k`` is zero):
the corrected gradient would add ``u_bar``, the other clients' mean drift, to its own,
which corrects nothing about this client and never returns to the federation.
"""

from __future__ import annotations

from clients.local import ClientJob, EvaluateOutcome, assemble, device_tensors
from clients.state import ClientState
from fedspc_app.core.config import RunConfig
from fedspc_app.core.methods import Block, Method
from fedspc_app.models.split import ParameterSplit
from fedspc_app.training.loop import ProximalTerm, evaluate_model, train_epochs


def is_held_out(config: RunConfig, partition_id: int, num_partitions: int) -> bool:
    """Whether ``partition_id`` is one of the run's held-out clients (the last
    ``held-out-clients`` partition ids, see :func:`fedspc_app.data.run_data.hold_out`)."""
    return partition_id >= num_partitions - config.held_out_clients


def fine_tuned_keys(method: Method, config: RunConfig, split: ParameterSplit) -> tuple[str, ...]:
    """The trainable parameters a held-out client fine-tunes (``held-out-parts``).

    ``auto`` is the method's own personalization of a client: its personal block
    (FedPer, FedRep: the head; LG-FedAvg: the body; ``local``: everything), FedBABU the
    parts its evaluation fine-tunes (``fedbabu-finetune-parts``), Ditto its whole
    personal model, FedAvg, FedProx and SCAFFOLD nothing. ``personal`` is the personal
    block (Ditto: its personal model), ``all`` every parameter, ``none`` nothing.
    """
    parts = config.held_out_parts
    if parts == "none" or config.held_out_epochs == 0:
        return ()
    if parts == "all" or method.personal_model:
        return split.trainable("all")
    if parts == "auto" and method.finetune_before_eval:
        block: Block = "all" if config.fedbabu_finetune_parts == "all" else "head"
        return split.trainable(block)
    return tuple(key for key in split.personal if key in split.parameters)


def evaluate_new_client(job: ClientJob) -> EvaluateOutcome:
    """Fine-tune a new client's model from the received shared block and test it.

    The model is the received shared block with the run's initial personalized
    entries (``job.state`` is ignored: a held-out client has none). Ditto's personal
    model starts from the received global model and trains with its proximal term
    towards it (``ditto-lambda``), as its clients' personal models do.
    """
    config, method, split, data, received = (job.config, job.method, job.split, job.data,
                                             job.received)
    model = assemble(job.model.to(data.device), split, received, ClientState())
    keys = fine_tuned_keys(method, config, split)
    if keys:
        hooks = []
        if method.personal_model and method.shared == "all":  # assembled as received
            anchor = device_tensors(received, [k for k in keys if k in received], data.device)
            hooks.append(ProximalTerm(anchor, float(config.ditto_lambda)))
        train_epochs(model, data.batches("train", job.generator("held-out")),
                     epochs=config.held_out_epochs, trainable=keys, hooks=hooks,
                     **config.step_options)
    return EvaluateOutcome(*evaluate_model(model, data.batches("test")(),
                                           **config.compute_options))
