"""The one local training loop, and the gradient hooks that methods compose.

Every method's local training is a sequence of calls to :func:`train_epochs`: which
parameters it updates and which hooks rewrite their gradients between
``backward()`` and ``optimizer.step()`` is all that differs between methods. A hook
acts on a named set of parameters:

* :class:`ProximalTerm` adds ``mu * (w - anchor)``, the gradient of
  ``(mu/2) * ||w - anchor||^2`` (FedProx's proximal term; Ditto's personal objective).
* :class:`DriftCorrection` adds ``c - c_k`` (SCAFFOLD's control variates; FedSPC's
  ``-u_k + u_bar`` restricted to the shared block, Algorithm 1 step 2).

Parameters that are frozen in a phase simply have no gradient and are skipped by
every hook.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from fedspc_app.core.errors import DivergenceError
from fedspc_app.training.precision import resolve_precision, strict_fp32

Batches = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]
"""A callable returning a fresh iterator over one epoch of (images, labels)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(outputs, targets)`` → scalar mean loss (default: cross-entropy)."""


class GradientHook(Protocol):
    """Rewrites gradients in place after ``backward()`` and before ``step()``."""

    def __call__(self, parameters: Mapping[str, nn.Parameter]) -> None: ...


@dataclass(frozen=True)
class ProximalTerm:
    """Gradient of ``(mu/2) * ||w - anchor||^2`` over the anchored parameters.

    Used by FedProx (anchor = the received global model, ``mu = proximal-mu``) and
    by Ditto's personal model (anchor = the received global model,
    ``mu = ditto-lambda``).
    """

    anchor: Mapping[str, torch.Tensor]
    mu: float

    def __call__(self, parameters: Mapping[str, nn.Parameter]) -> None:
        if self.mu == 0.0:
            return
        for name, reference in self.anchor.items():
            parameter = parameters[name]
            if parameter.grad is not None:
                parameter.grad.add_(parameter.detach() - reference, alpha=self.mu)


@dataclass(frozen=True)
class DriftCorrection:
    """Adds a fixed correction to the gradients of the named parameters.

    For FedSPC the correction is ``u_bar - u_k`` over the trainable shared
    parameters, so each step follows ``grad F_k - u_k + u_bar`` (Algorithm 1,
    step 2). SCAFFOLD is the same hook with ``c - c_k`` over every parameter.
    """

    correction: Mapping[str, torch.Tensor]

    def __call__(self, parameters: Mapping[str, nn.Parameter]) -> None:
        for name, value in self.correction.items():
            parameter = parameters[name]
            if parameter.grad is not None:
                parameter.grad.add_(value)


class SGD:
    """SGD with momentum and weight decay: ``torch.optim.SGD``'s update (no dampening,
    no Nesterov), as the same tensor operations in the same order.

    Why not ``torch.optim.SGD`` itself: its constructor and first step import
    ``torch._dynamo`` (1.0-1.4 s measured), which a process that trains the project's own
    models (``cnn``, ``cnn-bn``, ``vgg11``) otherwise never loads, and a deployment
    starts a new ClientApp process for every message. ``tests/test_training.py`` holds
    it to ``torch.optim.SGD`` bit for bit.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], *, lr: float,
                 momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.parameters = list(parameters)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for index, parameter in enumerate(self.parameters):
            grad = parameter.grad
            if grad is None:
                continue
            if self.weight_decay:
                grad = grad.add(parameter, alpha=self.weight_decay)
            if self.momentum:
                buffer = self.buffers.get(index)
                if buffer is None:
                    buffer = self.buffers[index] = torch.clone(grad).detach()
                else:
                    buffer.mul_(self.momentum).add_(grad)
                grad = buffer
            parameter.add_(grad, alpha=-self.lr)


@dataclass(frozen=True)
class EpochsResult:
    """What one call of :func:`train_epochs` did."""

    steps: int
    examples: int
    loss_sum: float

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.examples if self.examples else float("nan")


def train_epochs(
    model: nn.Module,
    batches: Batches,
    *,
    epochs: int,
    trainable: Iterable[str],
    learning_rate: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    hooks: Iterable[GradientHook] = (),
    loss_fn: LossFn = F.cross_entropy,
    precision: str = "fp32",
    channels_last: bool = False,
    divergence_factor: float = 0.0,
    max_steps: int = 0,
) -> EpochsResult:
    """Train ``model`` for ``epochs`` passes with SGD on the ``trainable`` parameters,
    or, with ``max_steps`` > 0, for exactly that many steps, passing over the data as
    often as it takes (``local-steps``; ``epochs`` is then ignored).

    Parameters not named in ``trainable`` are frozen for the duration of the call
    (``requires_grad`` is restored afterwards). The model is in training mode, so
    BatchNorm statistics follow the data even for frozen blocks.

    Returns the number of optimizer steps taken, the examples seen and the summed
    (data) loss. ``loss_fn`` must return the mean loss of a batch. A non-finite loss
    or trainable parameter raises :class:`DivergenceError` naming the first bad step,
    and so does, with ``divergence_factor`` > 0, a loss over that many times the
    larger of 1 and the first step's loss (a blow-up that is still finite);
    they are checked after every epoch, so that the device is not waited on at every
    step; a non-finite gradient shows up as one of the two. ``precision`` ``bf16``
    runs the forward pass and the loss under bfloat16 autocast (the parameters, their
    gradients and the optimizer stay float32), ``auto`` does so where the device
    computes bfloat16 natively; ``channels_last`` stores the model's and the images'
    4-d tensors channels-last (faster convolutions on GPUs and, with bf16, on CPUs).
    """
    named = dict(model.named_parameters())
    trainable = set(trainable)
    unknown = trainable - named.keys()
    if unknown:
        raise KeyError(f"not parameters of the model: {sorted(unknown)[:5]}")
    previous = {name: p.requires_grad for name, p in named.items()}
    for name, parameter in named.items():
        parameter.requires_grad_(name in trainable)
    hooks = tuple(hooks)
    steps, examples, loss_sum = 0, 0, 0.0
    first_loss: float | None = None
    try:
        if not trainable or (epochs <= 0 and max_steps <= 0):
            return EpochsResult(0, 0, 0.0)
        optimizer = SGD(
            [named[name] for name in named if name in trainable],
            lr=learning_rate,
            momentum=momentum,
            weight_decay=weight_decay,
        )
        model.train()
        memory_format = _memory_format(model, channels_last)
        taken = 0
        for epoch in (itertools.count() if max_steps > 0 else range(epochs)):
            if max_steps > 0 and taken >= max_steps:
                break
            losses, sizes = [], []
            for images, labels in batches():
                if max_steps > 0 and taken >= max_steps:
                    break
                taken += 1
                if memory_format is not None:
                    images = images.contiguous(memory_format=memory_format)
                with autocast(images.device, precision):
                    loss = loss_fn(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                for hook in hooks:
                    hook(named)
                optimizer.step()
                losses.append(loss.detach())
                sizes.append(labels.shape[0])
            if not losses:  # no batch at all: more passes would not take a step either
                break
            # One read of the epoch's losses (a read per step would wait for the GPU).
            values = torch.stack(losses).float().tolist() if losses else []
            for value, size in zip(values, sizes):
                steps += 1
                if not math.isfinite(value):
                    raise DivergenceError(f"loss {value} at step {steps}")
                if first_loss is None:
                    first_loss = value
                elif divergence_factor and value > divergence_factor * max(first_loss, 1.0):
                    raise DivergenceError(
                        f"loss {value:.4g} at step {steps}, over {divergence_factor:g} times "
                        f"the larger of 1 and the first step's {first_loss:.4g}")
                examples += size
                loss_sum += value * size
            _check_finite(named, trainable, f"after epoch {epoch + 1} (step {steps})")
    finally:
        for name, parameter in named.items():
            parameter.requires_grad_(previous[name])
    return EpochsResult(steps, examples, loss_sum)


@torch.no_grad()
def _check_finite(named: Mapping[str, nn.Parameter], keys: Iterable[str], when: str) -> None:
    for name in keys:
        if not bool(torch.isfinite(named[name]).all()):
            raise DivergenceError(f"parameter {name!r} is not finite {when}")


def autocast(device: torch.device, precision: str):
    """bfloat16 autocast for ``precision = bf16`` (and ``auto`` where the device has
    native bfloat16, :mod:`fedspc_app.training.precision`); a no-op for ``fp32``.

    On CUDA, fp32 means fp32: cuDNN would otherwise run convolutions in TF32 (10-bit
    mantissa), PyTorch's default, so its TF32 switch is turned off for the process
    (:func:`~fedspc_app.training.precision.strict_fp32`)."""
    if device.type == "cuda":
        strict_fp32()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          enabled=resolve_precision(precision, device) == "bf16")


def _memory_format(model: nn.Module, channels_last: bool) -> torch.memory_format | None:
    """Convert ``model`` to channels-last when asked; the images' format, or None."""
    if not channels_last:
        return None
    model.to(memory_format=torch.channels_last)
    return torch.channels_last


@torch.no_grad()
def evaluate_model(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
    precision: str = "fp32", channels_last: bool = False,
) -> tuple[int, int, float]:
    """Return (correct, examples, summed cross-entropy loss) of ``model``."""
    model.eval()
    memory_format = _memory_format(model, channels_last)
    correct, examples, loss_sum = 0, 0, 0.0
    for images, labels in batches:
        if memory_format is not None:
            images = images.contiguous(memory_format=memory_format)
        with autocast(images.device, precision):
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        examples += labels.shape[0]
    return correct, examples, loss_sum
