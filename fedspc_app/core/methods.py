"""Federated methods as small declarative descriptions, looked up by name.

A method says which block of the model is shared with the server (the rest is
personalized and never leaves the client), which phases of local training it runs
(which block each phase updates, for how many epochs, on which model, with which
proximal term), and which model is evaluated. The client executes the description
with the one training loop in :mod:`fedspc_app.training.loop`; the server aggregates the
shared block. FedSPC (``fedspc = true``) adds the control-variate correction to the
shared block of any method; SCAFFOLD is FedAvg with that correction always on.

The splits follow the paper's Table 2: FedPer/FedRep/FedBABU share the body
(feature extractor) and keep the head (classifier); LG-FedAvg shares the head and
keeps the body; Ditto shares the whole global model and keeps a full personal
model. To add a method, register a :class:`Method`, or name one of your own in
the run-config (``method = "package.module:NAME"``, :func:`get_method`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedspc_app.core.named import import_named, is_named

Block = Literal["all", "body", "head"]
SharedBlock = Literal["all", "body", "head", "none"]


@dataclass(frozen=True)
class Phase:
    """One stage of local training.

    Attributes
    ----------
    train : {"all", "body", "head"}
        Which block's parameters this phase updates; the rest is frozen.
    epochs : str
        Name of the :class:`~fedspc_app.core.config.RunConfig` field giving the number
        of local epochs (e.g. ``"local_epochs"``).
    model : {"shared", "personal"}
        ``"shared"`` trains the model built from the received shared parameters
        (plus the client's personalized ones); ``"personal"`` trains the client's
        separate personal model (Ditto's v_k).
    proximal : str | None
        Name of the RunConfig field holding the coefficient of a proximal term
        ``(c/2)||w - w_received||^2`` towards the received shared parameters.
    """

    train: Block
    epochs: str
    model: Literal["shared", "personal"] = "shared"
    proximal: str | None = None


@dataclass(frozen=True)
class Method:
    """A federated method, as data.

    Attributes
    ----------
    name : str
        Run-config value of ``method``.
    shared : {"all", "body", "head", "none"}
        The block the server aggregates; every other state-dict key is personal
        (``"none"``: nothing is shared, every client trains alone).
    phases : tuple[Phase, ...]
        Local training, in order.
    personal_model : bool
        Keep a full personal model (Ditto's v_k) in the client state; it is the
        model evaluated.
    finetune_before_eval : bool
        Evaluate after fine-tuning a copy on the client's training data
        (FedBABU; ``fedbabu-finetune-epochs`` / ``fedbabu-finetune-parts``).
    control_variates : bool
        Always apply the control-variate correction (SCAFFOLD).
    personalized : bool
        Whether the method is a PFL method (FedSPC targets these; the standard
        methods are FedAvg, FedProx, SCAFFOLD).
    summary : str
        One line for logs and the README.
    """

    name: str
    shared: SharedBlock
    phases: tuple[Phase, ...]
    personal_model: bool = False
    finetune_before_eval: bool = False
    control_variates: bool = False
    personalized: bool = True
    summary: str = ""


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (its name must be new)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


METHOD_EXAMPLE = "my_methods:FEDPER_WARMUP"
"""A method of one's own, as the run-config names it (:mod:`fedspc_app.core.named`)."""


def get_method(name: str) -> Method:
    """The registered method called ``name``, or for ``package.module:NAME`` the
    :class:`Method` that module defines under that name (a method of one's own, with
    no change to this package; the run-config's validation checks that its phases
    name fields it has)."""
    from fedspc_app.core.errors import ConfigError

    if is_named(name):
        method = import_named("method", name, METHOD_EXAMPLE)
        if not isinstance(method, Method):
            raise ConfigError(f"run-config 'method' = {name!r}: {type(method).__name__}, "
                              "not a fedspc_app.core.methods.Method")
        return method
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(
            f"run-config 'method' = {name!r} is not one of: {', '.join(METHODS)}; a "
            f"method of your own is named 'package.module:NAME' ({METHOD_EXAMPLE!r})"
        ) from None


_LOCAL = Phase(train="all", epochs="local_epochs")

register(Method("fedavg", "all", (_LOCAL,), personalized=False,
                summary="FedAvg: the whole model is shared and averaged"))
register(Method("fedprox", "all",
                (Phase("all", "local_epochs", proximal="proximal_mu"),),
                personalized=False,
                summary="FedProx: FedAvg with a proximal term (proximal-mu)"))
register(Method("scaffold", "all", (_LOCAL,), control_variates=True, personalized=False,
                summary="SCAFFOLD: FedAvg with control variates on the whole model"))
register(Method("fedper", "body", (_LOCAL,),
                summary="FedPer: shared body, personal head, trained together"))
register(Method("fedrep", "body",
                (Phase("head", "fedrep_head_epochs"), Phase("body", "local_epochs")),
                summary="FedRep: personal head first (body frozen), then the shared body"))
register(Method("fedbabu", "body", (Phase("body", "local_epochs"),),
                finetune_before_eval=True,
                summary="FedBABU: shared body, head frozen at its common init, "
                        "fine-tuned before evaluation"))
register(Method("lgfedavg", "head", (_LOCAL,),
                summary="LG-FedAvg: shared head, personal body"))
register(Method("local", "none", (_LOCAL,),
                summary="Local: every client trains its own model alone; nothing is "
                        "aggregated (the reference row of the tables)"))
register(Method("ditto", "all",
                (_LOCAL, Phase("all", "ditto_personal_epochs", model="personal",
                               proximal="ditto_lambda")),
                personal_model=True,
                summary="Ditto: shared global model, personal model v_k pulled "
                        "towards it (ditto-lambda)"))
