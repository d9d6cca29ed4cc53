"""The run's model: built from the run seed (identical on every party), built once per
process and reset for each client, and its state-dict entries as numpy arrays, always
by key, never by position (the ArrayRecords of messages are
:mod:`fedspc_app.core.records`, the shared/personal split :mod:`fedspc_app.models.split`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedspc_app.core.config import RunConfig
from fedspc_app.core.records import ArrayDict
from fedspc_app.data.datasets import ImageDataset
from fedspc_app.data.run_data import DatasetShape
from fedspc_app.models.networks import build_model


def state_arrays(model: nn.Module, keys: Iterable[str]) -> ArrayDict:
    """Copies of the model's state-dict entries ``keys`` as numpy arrays."""
    state = model.state_dict()
    return {key: state[key].detach().cpu().numpy().copy() for key in keys}


def load_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Overwrite the model's state-dict entries named in ``arrays``."""
    state = model.state_dict()
    unknown = [key for key in arrays if key not in state]
    if unknown:
        raise KeyError(f"not in the model's state dict: {unknown[:5]}")
    with torch.no_grad():
        for key, value in arrays.items():
            target = state[key]
            if tuple(target.shape) != tuple(np.shape(value)):
                raise ValueError(
                    f"shape mismatch for {key!r}: model {tuple(target.shape)}, "
                    f"array {tuple(np.shape(value))}"
                )
            target.copy_(torch.as_tensor(np.asarray(value)).to(target.dtype))


def make_model(config: RunConfig, dataset: ImageDataset | DatasetShape) -> nn.Module:
    """The run's model, initialised from the run seed (identical on every party)."""
    return build_model(
        config.model,
        num_classes=dataset.num_classes,
        in_chans=dataset.in_chans,
        image_size=dataset.image_size,
        seed=config.seed,
        vit_embed_dim=config.vit_embed_dim,
        width=config.model_width,
    )


@dataclass
class _InitialModel:
    """One built model per process and its initial entries, to reset it from."""

    key: tuple | None = None
    model: nn.Module | None = None
    initial: dict[str, torch.Tensor] | None = None


_INITIAL = _InitialModel()


def initial_model(config: RunConfig, dataset: ImageDataset | DatasetShape) -> nn.Module:
    """The run's initial model, equal to what :func:`make_model` returns.

    The process builds it once and afterwards resets the same object to its initial
    entries (a copy instead of a build: milliseconds instead of seconds for ResNet-34
    or ViT). The caller may change the model until its next call of this function;
    a process running one client message at a time (a simulation worker) never needs
    two at once.
    """
    key = (config.model, dataset.num_classes, dataset.in_chans, dataset.image_size,
           config.seed, config.vit_embed_dim, config.model_width)
    cache = _INITIAL
    if cache.key != key or cache.model is None or cache.initial is None:
        cache.key, cache.model = None, None  # a failed build leaves no stale model
        model = make_model(config, dataset)
        cache.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        cache.key, cache.model = key, model
        return model
    model = cache.model
    with torch.no_grad():
        model.load_state_dict(cache.initial)
    for parameter in model.parameters():
        parameter.grad = None
        parameter.requires_grad_(True)
    return model.train()
