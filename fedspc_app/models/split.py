"""How a method splits a model: the shared and personal sets of state-dict keys.

The body/head split comes from the model (:func:`fedspc_app.models.networks.split_body_head`);
a method shares its body, its head or everything (:mod:`fedspc_app.core.methods`), and a
run-config may declare its own split with key patterns (``shared-keys``,
``personal-keys``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import Block, Method
from fedspc_app.models.networks import split_body_head


@dataclass(frozen=True)
class ParameterSplit:
    """How one method splits one model.

    Attributes
    ----------
    body, head : tuple[str, ...]
        State-dict keys of the feature extractor and the classifier (with a declared
        split: the method's shared block and the other one, see :func:`parameter_split`).
    shared : tuple[str, ...]
        State-dict keys aggregated by the server (parameters and buffers).
    personal : tuple[str, ...]
        Every other key; kept by the client, never sent.
    parameters : frozenset[str]
        Names of the trainable parameters (state-dict keys that are not buffers).
    """

    body: tuple[str, ...]
    head: tuple[str, ...]
    shared: tuple[str, ...]
    personal: tuple[str, ...]
    parameters: frozenset[str]

    def block(self, block: Block) -> tuple[str, ...]:
        """State-dict keys of ``"body"``, ``"head"`` or ``"all"``."""
        return {"body": self.body, "head": self.head, "all": self.body + self.head}[block]

    def trainable(self, block: Block) -> tuple[str, ...]:
        """Trainable parameter names of a block."""
        return tuple(key for key in self.block(block) if key in self.parameters)

    @property
    def corrected(self) -> tuple[str, ...]:
        """The shared trainable parameters: the keys of u_k and u_bar."""
        return tuple(key for key in self.shared if key in self.parameters)


def parse_patterns(text: str) -> tuple[str, ...]:
    """The comma-separated glob patterns of a ``shared-keys``/``personal-keys`` value."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def declared_split(keys: Iterable[str], shared: str = "",
                   personal: str = "") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(shared, personal)`` state-dict keys from glob patterns (``fnmatch``, case-sensitive).

    One side may be left empty: it is then every key the other side does not match. Each
    pattern must match a key, no key may be on both sides, and every key on one of them.
    """
    keys = tuple(keys)
    sides = {"shared-keys": parse_patterns(shared), "personal-keys": parse_patterns(personal)}
    matched: dict[str, set[str]] = {}
    for name, patterns in sides.items():
        matched[name] = set()
        for pattern in patterns:
            hits = fnmatch.filter(keys, pattern)
            if not hits:
                raise ConfigError(
                    f"run-config '{name}': pattern {pattern!r} matches no state-dict key "
                    f"of the model (keys look like: {', '.join(keys[:4])}, ...)")
            matched[name].update(hits)
    if sides["shared-keys"] and sides["personal-keys"]:
        both = [key for key in keys if key in matched["shared-keys"] & matched["personal-keys"]]
        if both:
            raise ConfigError(f"run-config 'shared-keys' and 'personal-keys' both match "
                              f"{', '.join(both[:4])}; a key is either shared or personal")
        neither = [key for key in keys
                   if key not in matched["shared-keys"] | matched["personal-keys"]]
        if neither:
            raise ConfigError(f"run-config 'shared-keys' and 'personal-keys' leave "
                              f"{', '.join(neither[:4])} unassigned; every key must be on "
                              "one side")
    if sides["shared-keys"]:
        shared_set = matched["shared-keys"]
    elif sides["personal-keys"]:
        shared_set = set(keys) - matched["personal-keys"]
    else:
        raise ConfigError("run-config 'shared-keys'/'personal-keys' hold no pattern")
    return (tuple(key for key in keys if key in shared_set),
            tuple(key for key in keys if key not in shared_set))


def parameter_split(model: nn.Module, method: Method, *, shared_keys: str = "",
                    personal_keys: str = "", local_buffers: bool = False) -> ParameterSplit:
    """Split ``model``'s state-dict keys for ``method``.

    ``local_buffers`` (differential privacy): the shared block's buffers (BatchNorm
    statistics, counters) stay with each client, as FedBN keeps them, so that only
    clipped and noised trainable parameters are released.

    By default the split is the method's (the paper's Table 2). With ``shared_keys`` or
    ``personal_keys`` (the run-config's patterns, see :func:`declared_split`) the declared
    split replaces it, and the method's phases keep their roles: the block the method
    shares ("body", or "head" for LG-FedAvg) is the declared shared set, the other block the
    declared personal set.
    """
    # Every name of a parameter: a module registered under two names (an alias) has its
    # parameters under both in the state dict, and neither may pass for a buffer.
    parameters = frozenset(name for name, _ in model.named_parameters(remove_duplicate=False))
    keys = tuple(model.state_dict())
    if shared_keys.strip() or personal_keys.strip():
        shared, personal = declared_split(keys, shared_keys, personal_keys)
        body, head = (personal, shared) if method.shared == "head" else (shared, personal)
        if not any(key in parameters for key in shared):
            raise ConfigError("the declared shared block has no trainable parameter; "
                              "nothing would be learned together")
        return _one_side_each(model, _buffers_local(
            ParameterSplit(body, head, shared, personal, parameters), local_buffers))
    body, head = split_body_head(model)
    everything = body + head
    shared_set = set({"all": everything, "body": body, "head": head,
                      "none": ()}[method.shared])
    personal = tuple(key for key in keys if key not in shared_set)
    shared = tuple(key for key in keys if key in shared_set)
    return _one_side_each(model, _buffers_local(
        ParameterSplit(body, head, shared, personal, parameters), local_buffers))


def _one_side_each(model: nn.Module, split: ParameterSplit) -> ParameterSplit:
    """``split``, after checking that no tensor of ``model`` is both shared and personal
    (one tensor under two state-dict keys, e.g. an aliased module, split by a declared
    pattern): a client would load the received global weights, then overwrite them with
    its own old copy."""
    state = model.state_dict()
    shared = {state[key].data_ptr(): key for key in split.shared if state[key].numel()}
    for key in split.personal:
        other = shared.get(state[key].data_ptr()) if state[key].numel() else None
        if other is not None:
            raise ConfigError(f"state-dict keys {other!r} (shared) and {key!r} (personal) "
                              "are one tensor of the model (a module registered under two "
                              "names); put both on the same side of the split")
    return split


def _buffers_local(split: ParameterSplit, local_buffers: bool) -> ParameterSplit:
    if not local_buffers:
        return split
    buffers = {key for key in split.shared if key not in split.parameters}
    if not buffers:
        return split
    return dataclasses.replace(
        split, shared=tuple(k for k in split.shared if k not in buffers),
        personal=tuple(k for k in (*split.personal, *split.shared) if k not in split.shared
                       or k in buffers))


def check_private_release(model: nn.Module, split: ParameterSplit, in_chans: int,
                          image_size: int, seed: int = 0) -> None:
    """Under differential privacy, raise :class:`ConfigError` unless the release can
    move what the clients evaluate: at least one released (shared trainable)
    parameter, and at least one of them reaching the model's output (a gradient of
    one forward pass on random images, in eval mode, so no statistic changes). Were
    nothing released that the model uses, a client's model would change only in the
    rounds it was drawn, and its evaluation, published every round, would say which.
    """
    released = [key for key in split.corrected if key in split.parameters]
    if not released:
        raise ConfigError(
            "differential privacy: the shared block holds no trainable parameter to "
            "release (the model's shared part is buffers only), so each client's model "
            "would change only when it is drawn and its evaluation would tell when; "
            "share a trainable block or turn dp-clipping-norm off")
    import torch

    training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn((2, in_chans, image_size, image_size), generator=generator)
        model(images).float().square().sum().backward()
        parameters = dict(model.named_parameters())
        reached = any(parameters[key].grad is not None
                      and bool(torch.any(parameters[key].grad != 0)) for key in released)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)
    if not reached:
        raise ConfigError(
            "differential privacy: none of the released parameters "
            f"({', '.join(released[:3])}{', …' if len(released) > 3 else ''}) reaches the "
            "model's output, so the release never moves what the clients evaluate and "
            "their evaluation would tell when each was drawn; share parameters the "
            "model uses or turn dp-clipping-norm off")
