"""The run-config: flat kebab-case keys, parsed once into a typed, validated object.

Flower hands both the ServerApp and every ClientApp the same run-config
(``context.run_config``: the ``[tool.flwr.app.config]`` table of pyproject.toml,
overridden by ``flwr run --run-config``). :func:`parse_run_config` turns it into a
:class:`RunConfig`; nothing else in the project reads raw run-config keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import expand_user
from fedspc_app.core.named import check_name, is_named
from fedspc_app.core.privacy_config import (
    CENTRE_RULES,
    check_adaptive,
    check_privacy,
)
from fedspc_app.core.ranges import at_least as _at_least
from fedspc_app.core.ranges import choice as _choice
from fedspc_app.core.ranges import learning_rate_range_text, usable_learning_rate

DATASETS = ("digits", "cifar10", "cifar100", "tinyimagenet")
MODELS = ("cnn", "cnn-bn", "resnet18", "resnet34", "vgg11", "vit")
# Models whose channel widths scale with run-config 'model-width', and the channels of
# their narrowest layer at width 1.0 (a ResNet's stem and first stage, VGG-11's first
# convolution).
WIDTH_MODELS = {"resnet18": 64, "resnet34": 64, "vgg11": 64}


MODEL_EXAMPLE = "my_models:build_net"
"""A model of one's own, as the run-config names it (:mod:`fedspc_app.core.named`)."""


def width_models_text() -> str:
    """``resnet18, resnet34 and vgg11``."""
    names = list(WIDTH_MODELS)
    return ", ".join(names[:-1]) + " and " + names[-1]
AGGREGATIONS = ("mean", "weighted", "median", "trimmed-mean", "krum", "multi-krum")
# The rules a few lying clients cannot steer (strategies/aggregation.py).
ROBUST_AGGREGATIONS = ("median", "trimmed-mean", "krum", "multi-krum")
SERVER_OPTIMIZERS = ("mean", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ATTACKS = ("none", "scale", "sign-flip", "noise", "small-steps", "bias")
DP_CLIPPING = ("client", "server")
DP_ACCOUNTANTS = ("rdp", "pld")  # dp_accounting's, under add/remove of one client
LR_SCHEDULES = ("constant", "exponential", "cosine", "step")
WANDB_MODES = ("offline", "online", "disabled")
AUGMENTS = ("auto", "none", "crop-flip")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
REFERENCE_UPLOADS = ("derived", "explicit")
REFERENCE_RULES = ("auto", "increment", "client-centre", "server-centre")
# A robust rule's bound on each update's norm before it (strategies/aggregation.py).
NORM_BOUNDS = ("none", "median")  # as a rule applies them; the run-config adds "auto"
FINETUNE_PARTS = ("all", "head")
# What a held-out client fine-tunes before it is tested (clients/held_out.py).
HELD_OUT_PARTS = ("auto", "personal", "all", "none")
PARTITIONS = ("dirichlet", "classes")
CACHE_DIR_ENV = "FEDSPC_CACHE_DIR"


def resolve_reference(reference: str, aggregation: str, dp: bool) -> str:
    """How FedSPC's u_bar follows the clients, ``fedspc-reference`` with ``auto``
    resolved: Algorithm 1's ``increment`` under the mean (and under differential
    privacy, which releases no client's own reference change), ``server-centre``
    under a robust rule, so that u_bar is as robust as the shared block
    (docs/robustness.md)."""
    if reference != "auto":
        return reference
    if dp or aggregation not in ROBUST_AGGREGATIONS:
        return "increment"
    return "server-centre"


def resolve_norm_bound(norm_bound: str, aggregation: str, corrects: bool = False) -> str:
    """``robust-norm-bound`` as it acts: ``none`` under the mean and the weighted mean,
    which never bound (Algorithm 1); ``auto`` is ``median`` under a robust rule when
    the run corrects the shared block (FedSPC, SCAFFOLD: a scaled liar's server-kept
    u_k swings further each round otherwise, docs/robustness.md), else ``none``."""
    if aggregation not in ROBUST_AGGREGATIONS:
        return "none"
    if norm_bound == "auto":
        return "median" if corrects else "none"
    return norm_bound


def resolved_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Run-config ``values`` (kebab-case, as config.json records them) with ``auto``
    resolved where it decides the arithmetic (``fedspc-reference``), so that runs
    recorded before a default became ``auto`` compare equal to the same run now, and
    ``robust-norm-bound`` as it acts (``none`` under the mean)."""
    out = dict(values)
    if "robust-norm-bound" in out:
        corrects = bool(out.get("fedspc")) or out.get("method") == "scaffold"
        out["robust-norm-bound"] = resolve_norm_bound(
            str(out["robust-norm-bound"]), str(out.get("aggregation", "mean")), corrects)
    if "fedspc-reference" in out:
        dp = float(out.get("dp-clipping-norm") or 0.0) > 0
        out["fedspc-reference"] = resolve_reference(
            str(out["fedspc-reference"]), str(out.get("aggregation", "mean")), dp)
    return out


def default_cache_dir() -> Path:
    """Folder for derived caches: ``$FEDSPC_CACHE_DIR``, or ``~/.cache/fedspc``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedspc"


def default_data_dir() -> Path:
    """Where datasets are looked for when ``data-dir`` is empty: ``<cache dir>/data``."""
    return default_cache_dir() / "data"


def _key(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Field ``foo_bar`` is run-config key ``foo-bar``.

    Defaults are those of ``[tool.flwr.app.config]`` in pyproject.toml (a quick,
    offline run on the embedded digits dataset); the paper's values are in the
    configuration table (docs/configuration.md) and in the presets under ``conf/``.
    """

    # What to train
    dataset: str = "digits"
    data_dir: str = ""
    download: bool = True
    model: str = "cnn"
    model_width: float = 1.0
    vit_embed_dim: int = 768
    method: str = "fedavg"
    fedspc: bool = False
    fedspc_upload: str = "derived"
    fedspc_reference: str = "auto"
    shared_keys: str = ""
    personal_keys: str = ""

    # Federation
    num_rounds: int = 10
    num_clients: int = 0
    fraction_train: float = 1.0
    aggregation: str = "mean"
    trim_fraction: float = 0.1
    byzantine_clients: int = 0
    krum_select: int = 0
    robust_norm_bound: str = "auto"
    server_optimizer: str = "mean"
    server_learning_rate: float = 0.0
    server_momentum: float = 0.0
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 0.0
    evaluate_every: int = 1
    evaluate_fraction: float = 1.0
    evaluate_before_aggregation: bool = False
    evaluate_global_model: bool = False
    evaluate_server: bool = False
    held_out_clients: int = 0
    held_out_epochs: int = 1
    held_out_parts: str = "auto"

    # Partitioning (the paper's Dirichlet label skew, or S classes per client)
    partition: str = "dirichlet"
    classes_per_client: int = 2
    alpha: float = 0.1
    min_samples: int = 10
    partition_max_tries: int = 1000
    seed: int = 0

    # Local training
    batch_size: int = 64
    local_epochs: int = 5
    local_steps: int = 0
    learning_rate: float = 0.02
    lr_schedule: str = "constant"
    lr_decay: float = 0.98
    lr_min: float = 0.0
    lr_step_rounds: int = 10
    momentum: float = 0.0
    weight_decay: float = 0.0
    augment: str = "auto"
    device: str = "auto"
    precision: str = "fp32"
    channels_last: bool = False
    deterministic: bool = False

    # Method options
    proximal_mu: float = 0.01
    fedrep_head_epochs: int = 1
    fedbabu_finetune_epochs: int = 1
    fedbabu_finetune_parts: str = "all"
    ditto_lambda: float = 1.0
    ditto_personal_epochs: int = 5

    # Results
    output_dir: str = "results"
    run_name: str = ""
    overwrite: bool = False
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fedspc"
    wandb_entity: str = ""
    wandb_mode: str = "offline"

    # Faults: checkpoints, resuming, the round failure policy
    checkpoint: bool = True
    resume: bool = False
    keep_client_state: bool = False
    client_state_dir: str = ""
    min_train_replies: float = 0.5
    max_failed_rounds: int = 3
    divergence_factor: float = 100.0
    round_timeout: float = 3600.0
    node_wait: float = 120.0
    # A time (ISO 8601 with its UTC offset) by which the run pauses: it starts no round
    # that would end after it (runs/pause.py); "" = none
    stop_by: str = ""

    # Client-level differential privacy of the shared block (the mechanism:
    # core/dp_mechanism.py; its account: runs/dp_account.py)
    dp_clipping_norm: float = 0.0
    dp_noise_multiplier: float = 0.0
    dp_clipping: str = "client"
    dp_delta: float = 1e-5
    dp_target_epsilon: float = 0.0
    dp_accountant: str = "rdp"
    # Adaptive clipping (Andrew et al., 2021): 0 = a fixed dp-clipping-norm; else the
    # target quantile γ of the update norms, the step η_C and the count's noise σ_b
    # (0 = q·K/20); and FedSPC's u_bar averaged over rounds under privacy (β, 0 = off)
    dp_clipping_quantile: float = 0.0
    dp_clipping_lr: float = 0.2
    dp_clipped_count_stddev: float = 0.0
    dp_reference_smoothing: float = 0.0
    dp_reference: str = "increment"  # or "level": the clients release uncorrected steps
    # Adaptive clipping's public bounds on C_t, as factors of dp-clipping-norm (C_1):
    # C_t stays in [min·C_1, max·C_1]; 0 / inf: no bound
    dp_clipping_norm_min_factor: float = 0.1
    dp_clipping_norm_max_factor: float = 10.0
    # What hides the draw besides the release: a training phase padded to this many
    # seconds (0 = off), and which rounds evaluate the clients ("final": the last only)
    dp_phase_seconds: float = 0.0
    dp_evaluate: str = "every-round"

    # Fault injection for tests and experiments: lying clients (clients/attack.py)
    attack: str = "none"
    attack_clients: int = 0
    attack_scale: float = 50.0

    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def reference_rule(self) -> str:
        """``fedspc-reference`` with ``auto`` resolved (:func:`resolve_reference`)."""
        return resolve_reference(self.fedspc_reference, self.aggregation, self.dp)

    @property
    def norm_bound(self) -> str:
        """``robust-norm-bound`` as it acts (:func:`resolve_norm_bound`)."""
        from fedspc_app.core.methods import get_method  # the registry imports this module
        try:
            corrects = self.fedspc or get_method(self.method).control_variates
        except (ConfigError, ValueError, ImportError):  # an unknown method: validate says
            corrects = self.fedspc
        return resolve_norm_bound(self.robust_norm_bound, self.aggregation, corrects)

    @property
    def dp(self) -> bool:
        """Whether client-level differential privacy is on (``dp-clipping-norm`` > 0)."""
        return self.dp_clipping_norm > 0

    # ------------------------------------------------------------------ helpers
    @property
    def stop_by_time(self) -> datetime | None:
        """``stop-by`` as an aware datetime, or None when it is not set."""
        return parse_stop_by(self.stop_by)

    @property
    def label(self) -> str:
        """Short method label, e.g. ``fedrep+fedspc``."""
        return f"{self.method}+fedspc" if self.fedspc else self.method

    @property
    def resolved_run_name(self) -> str:
        """``run-name``, or one built from the settings that tell runs apart:
        ``<dataset>-<model>-<label>-a<alpha>-s<seed>``, with ``-c<S>`` in place of
        ``-a<alpha>`` for ``partition = "classes"``."""
        if self.run_name:
            return self.run_name
        split = (f"c{self.classes_per_client}" if self.partition == "classes"
                 else f"a{self.alpha:g}")
        name = f"{self.dataset}-{self.model}-{self.label}-{split}-s{self.seed}"
        return name.replace(":", ".")  # a model or method of one's own: module.name

    @property
    def run_dir(self) -> Path:
        """Folder the results of this run go to (absolute)."""
        return (Path(self.output_dir).expanduser() / self.resolved_run_name).resolve()

    @property
    def resolved_data_dir(self) -> Path:
        """``data-dir``, or :func:`default_data_dir` when empty."""
        if self.data_dir:
            return Path(self.data_dir).expanduser().resolve()
        return default_data_dir().resolve()

    @property
    def compute_options(self) -> dict[str, Any]:
        """How the training loop and evaluation compute: keyword arguments
        ``precision`` and ``channels_last`` of ``train_epochs`` / ``evaluate_model``."""
        return {"precision": self.precision, "channels_last": self.channels_last}

    @property
    def step_options(self) -> dict[str, Any]:
        """The optimizer's settings, the divergence rule and :attr:`compute_options`:
        keyword arguments of ``train_epochs`` (the learning rate is the run's; a
        schedule overrides it)."""
        return {"learning_rate": self.learning_rate, "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "divergence_factor": self.divergence_factor, **self.compute_options}

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as kebab-case keys (for results and logs)."""
        out = {
            _key(f.name): getattr(self, f.name) for f in fields(self) if f.name != "extra"
        }
        out.update(self.extra)
        return out

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with fields changed (snake_case names)."""
        return dataclasses.replace(self, **changes)


_FIELD_TYPES = {f.name: f.type for f in fields(RunConfig) if f.name != "extra"}


def _coerce(key: str, value: Any, kind: str) -> Any:
    """Convert one run-config value to its field's type, or raise ConfigError."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"run-config '{key}' must be true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(f"run-config '{key}' must be an integer, got {value!r}")
        if isinstance(value, float):
            if value.is_integer():
                return int(value)
            raise ConfigError(f"run-config '{key}' must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run-config '{key}' must be an integer, got {value!r}") from None
    if kind == "float":
        if isinstance(value, bool):
            raise ConfigError(f"run-config '{key}' must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run-config '{key}' must be a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)):  # a list, table or date of TOML or YAML
        raise ConfigError(f"run-config '{key}' must be a quoted string, got {value!r}")
    return str(value)


def parse_stop_by(value: str) -> datetime | None:
    """run-config ``stop-by``: an ISO 8601 time with its UTC offset (``Z`` for UTC), so
    that every process of a run, on any machine, reads the same instant; "" is none."""
    if not value:
        return None
    example = "e.g. '2026-12-05T18:30:00+01:00' or '2026-12-05T17:30Z'"
    try:
        when = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ConfigError(f"run-config 'stop-by' = {value!r} is not an ISO 8601 time "
                          f"({example})") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise ConfigError(f"run-config 'stop-by' = {value!r} has no UTC offset ({example}); "
                          "the grid command's --stop-by also takes a local clock time "
                          "or a duration")
    return when


def validate(config: RunConfig) -> RunConfig:
    """Check ranges and names; return the config unchanged or raise ConfigError."""
    from fedspc_app.core.methods import get_method  # the registry imports this module

    _choice("dataset", config.dataset, DATASETS)
    if is_named(config.model):
        check_name("model", config.model, MODEL_EXAMPLE)
    elif config.model not in MODELS:
        raise ConfigError(
            f"run-config 'model' = {config.model!r} is not one of: {', '.join(MODELS)}; "
            f"a model of your own is named 'package.module:function' ({MODEL_EXAMPLE!r})")
    method = get_method(config.method)
    if config.dp and (method.personal_model or method.shared == "none"):
        # Its evaluation is of a model that changes only in the rounds its client was
        # drawn (Ditto's personal model; a method that shares nothing, where no release
        # moves it): the published mean accuracy and loss, less the colluders' own,
        # show exactly when another client trained.
        what = ("keeps a personal model" if method.personal_model
                else "shares nothing, so each client's model")
        raise ConfigError(
            f"run-config 'method' = {config.method!r} {what} that trains only when its "
            "client is drawn, and its evaluation would tell which clients a round drew: "
            "differential privacy (dp-clipping-norm > 0) is refused with it")
    known = {f.name for f in fields(RunConfig)}
    for phase in method.phases:  # a method of one's own names them in its own code
        for role, name in (("epochs", phase.epochs), ("proximal", phase.proximal)):
            if name is not None and name not in known:
                raise ConfigError(
                    f"run-config 'method' = {config.method!r}: a phase's {role} field "
                    f"{name!r} is not a run-config field (e.g. 'local_epochs')")
    _choice("aggregation", config.aggregation, AGGREGATIONS)
    _choice("server-optimizer", config.server_optimizer, SERVER_OPTIMIZERS)
    _choice("attack", config.attack, ATTACKS)
    _choice("dp-clipping", config.dp_clipping, DP_CLIPPING)
    _choice("dp-accountant", config.dp_accountant, DP_ACCOUNTANTS)
    _choice("lr-schedule", config.lr_schedule, LR_SCHEDULES)
    _choice("wandb-mode", config.wandb_mode, WANDB_MODES)
    if not 0.0 < config.lr_decay <= 1.0:
        raise ConfigError(f"run-config 'lr-decay' must be in (0, 1], got {config.lr_decay!r}")
    _at_least("lr-min", config.lr_min, 0.0)
    if config.lr_min >= config.learning_rate and config.lr_schedule == "cosine":
        raise ConfigError("run-config 'lr-min' must be below 'learning-rate' for the "
                          "cosine schedule")
    _at_least("lr-step-rounds", config.lr_step_rounds, 1)
    _at_least("local-steps", config.local_steps, 0)
    check_privacy(config)
    check_adaptive(config, config.fedspc or method.control_variates)
    if not 0.0 <= config.trim_fraction < 0.5:
        raise ConfigError("run-config 'trim-fraction' must be in [0, 0.5), "
                          f"got {config.trim_fraction!r}")
    _at_least("byzantine-clients", config.byzantine_clients, 0)
    training = config.num_clients - config.held_out_clients
    byzantine = config.byzantine_clients
    if config.aggregation in ("trimmed-mean", "median") and 0 < training <= 2 * byzantine:
        raise ConfigError(f"run-config 'aggregation' = '{config.aggregation}' " + (
            f"cuts byzantine-clients = {byzantine} values at each end of every coordinate, "
            f"which leaves nothing of the {training} training clients"
            if config.aggregation == "trimmed-mean" else "bounds fewer than half faulty "
            f"clients: byzantine-clients = {byzantine} of {training} training clients is not"))
    _at_least("krum-select", config.krum_select, 0)
    _at_least("attack-clients", config.attack_clients, 0)
    _at_least("server-learning-rate", config.server_learning_rate, 0.0)
    _at_least("server-momentum", config.server_momentum, 0.0)
    _at_least("server-tau", config.server_tau, 0.0)
    for key, beta in (("server-beta1", config.server_beta1),
                      ("server-beta2", config.server_beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"run-config '{key}' must be in [0, 1), got {beta!r}")
    if config.server_momentum >= 1.0:
        raise ConfigError("run-config 'server-momentum' must be < 1, "
                          f"got {config.server_momentum!r}")
    if not math.isfinite(config.attack_scale):
        raise ConfigError(f"run-config 'attack-scale' must be finite, got {config.attack_scale!r}")
    _choice("augment", config.augment, AUGMENTS)
    _choice("device", config.device, DEVICES)
    _choice("precision", config.precision, PRECISIONS)
    _choice("fedspc-upload", config.fedspc_upload, REFERENCE_UPLOADS)
    _choice("fedspc-reference", config.fedspc_reference, REFERENCE_RULES)
    if config.fedspc_reference in CENTRE_RULES and config.aggregation == "weighted":
        raise ConfigError(f"run-config 'fedspc-reference' = {config.fedspc_reference!r} "
                          "weighs every u_k alike: with 'weighted' set 'increment' or 'auto'")
    _choice("robust-norm-bound", config.robust_norm_bound, ("auto", *NORM_BOUNDS))
    _choice("fedbabu-finetune-parts", config.fedbabu_finetune_parts, FINETUNE_PARTS)
    _choice("held-out-parts", config.held_out_parts, HELD_OUT_PARTS)
    _at_least("held-out-clients", config.held_out_clients, 0)
    _at_least("held-out-epochs", config.held_out_epochs, 0)
    if config.num_clients > 0 and config.held_out_clients >= config.num_clients:
        raise ConfigError(
            f"run-config 'held-out-clients' = {config.held_out_clients} leaves no client to "
            f"train among num-clients = {config.num_clients} (the held-out clients are "
            "counted in num-clients)")
    _choice("partition", config.partition, PARTITIONS)
    _at_least("classes-per-client", config.classes_per_client, 1)
    _at_least("alpha", config.alpha, 0.0, strict=True)
    _at_least("num-rounds", config.num_rounds, 1)
    _at_least("num-clients", config.num_clients, 0)
    _at_least("min-samples", config.min_samples, 1)
    _at_least("partition-max-tries", config.partition_max_tries, 1)
    _at_least("batch-size", config.batch_size, 1)
    _at_least("local-epochs", config.local_epochs, 1)
    _at_least("learning-rate", config.learning_rate, 0.0, strict=True)
    if not usable_learning_rate(config.learning_rate):
        raise ConfigError(f"run-config 'learning-rate' must be {learning_rate_range_text()}, "
                          f"got {config.learning_rate!r}")
    _at_least("momentum", config.momentum, 0.0)
    _at_least("weight-decay", config.weight_decay, 0.0)
    _at_least("proximal-mu", config.proximal_mu, 0.0)
    _at_least("fedrep-head-epochs", config.fedrep_head_epochs, 0)
    _at_least("fedbabu-finetune-epochs", config.fedbabu_finetune_epochs, 0)
    _at_least("ditto-lambda", config.ditto_lambda, 0.0)
    _at_least("ditto-personal-epochs", config.ditto_personal_epochs, 1)
    _at_least("vit-embed-dim", config.vit_embed_dim, 12)
    _check_width(config.model, config.model_width)
    _at_least("max-failed-rounds", config.max_failed_rounds, 1)
    _at_least("divergence-factor", config.divergence_factor, 0.0)
    _at_least("round-timeout", config.round_timeout, 0.0, strict=True)
    _at_least("node-wait", config.node_wait, 0.0)
    parse_stop_by(config.stop_by)
    if not 0.0 < config.min_train_replies <= 1.0:
        raise ConfigError("run-config 'min-train-replies' must be in (0, 1], "
                          f"got {config.min_train_replies!r}")
    if config.resume and not config.checkpoint:
        raise ConfigError("run-config 'resume = true' needs 'checkpoint = true'")
    if config.keep_client_state and not config.checkpoint:
        raise ConfigError("run-config 'keep-client-state = true' needs 'checkpoint = true'")
    if config.resume and config.overwrite:
        raise ConfigError("run-config 'resume = true' continues the run folder and "
                          "'overwrite = true' replaces it: set one of them")
    for key, fraction in (("fraction-train", config.fraction_train),
                          ("evaluate-fraction", config.evaluate_fraction)):
        if not 0.0 < fraction <= 1.0 or not math.isfinite(fraction):
            raise ConfigError(f"run-config '{key}' must be in (0, 1], got {fraction!r}")
    _at_least("evaluate-every", config.evaluate_every, 1)
    if config.momentum >= 1.0:
        raise ConfigError(f"run-config 'momentum' must be < 1, got {config.momentum!r}")
    if config.momentum and (config.fedspc or method.control_variates):
        # Algorithm 1's u_k update reads Δθ/(E·η) as the mean corrected gradient of E
        # plain SGD steps; with momentum m the block moves about E·η/(1 − m) per unit of
        # it, so u_k overshoots every round and grows without bound.
        what = ("FedSPC (fedspc = true)" if config.fedspc else
                f"method {config.method!r} (its control variates)")
        raise ConfigError(
            f"run-config 'momentum' > 0 is refused with {what}: the u_k update assumes "
            "plain SGD steps (momentum moves the block by more than E·η per unit of "
            "correction, and u_k diverges); set momentum = 0")
    if config.vit_embed_dim % 12:
        raise ConfigError(
            f"run-config 'vit-embed-dim' must be divisible by the 12 heads, "
            f"got {config.vit_embed_dim}"
        )
    if method.shared == "none" and (
            config.fedspc or config.shared_keys.strip() or config.personal_keys.strip()):
        raise ConfigError(
            f"method '{config.method}' shares nothing with the server: fedspc, "
            "shared-keys and personal-keys do not apply to it")
    if method.control_variates and config.fedspc:
        raise ConfigError(
            f"method '{config.method}' already corrects every shared parameter; "
            "set fedspc = false (FedSPC on fedavg with everything shared is SCAFFOLD)"
        )
    if config.run_name:  # (empty: built from the settings)
        check_run_name(config.run_name)
    if not config.output_dir:
        raise ConfigError("run-config 'output-dir' must not be empty")
    for key in ("output-dir", "data-dir", "client-state-dir"):  # ~name of no user
        expand_user(getattr(config, key.replace("-", "_")), key)
    return config


RUN_NAME_BYTES = 200  # a folder's name (255 bytes at most) with room for lock files


def check_run_name(run_name: object, what: str = "run-config 'run-name'") -> None:
    """A run name is a folder's name (the run's, its clients' state): a plain one, so
    that it cannot point outside the folder it is joined to: text without a slash or
    backslash, not "." or "..", without control, format or line-separator characters
    (a NUL, a line break, a right-to-left override) or leading or trailing white
    space, at most :data:`RUN_NAME_BYTES` bytes in UTF-8."""
    plain = (isinstance(run_name, str) and run_name not in ("", ".", "..")
             and run_name == run_name.strip()  # (no name of spaces, nor one that ends so)
             and not any(c in "/\\" or unicodedata.category(c)[0] == "C"
                         or unicodedata.category(c) in ("Zl", "Zp") for c in run_name)
             and len(run_name.encode("utf-8", errors="replace")) <= RUN_NAME_BYTES)
    if not plain:
        shown = (f"a {type(run_name).__name__}" if not isinstance(run_name, str)
                 else repr(run_name[:60]) + ("…" if len(run_name) > 60 else ""))
        raise ConfigError(f"{what} must be a plain name (text of at most {RUN_NAME_BYTES} "
                          "bytes, no slash, backslash, control character or white space "
                          f"at its ends, not '.' or '..'), got {shown}")


def _check_width(model: str, width: float) -> None:
    _at_least("model-width", width, 0.0, strict=True)
    if width == 1.0:
        return
    if model not in WIDTH_MODELS:
        raise ConfigError(
            f"run-config 'model-width' = {width:g} applies to {width_models_text()} "
            f"only; model {model!r} has no width to scale (leave model-width = 1.0)")
    if round(WIDTH_MODELS[model] * width) < 1:
        raise ConfigError(
            f"run-config 'model-width' = {width:g} leaves {model}'s narrowest layer "
            f"({WIDTH_MODELS[model]} channels at width 1.0) with no channels; it must be "
            f"above {0.5 / WIDTH_MODELS[model]:g}")


def parse_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """Parse Flower's run-config (kebab-case keys) into a validated RunConfig.

    Unknown keys are an error (a typo would otherwise silently fall back to a
    default), except keys starting with ``x-``, which are kept in ``extra`` for
    users' own extensions.
    """
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    known = {_key(name): name for name in _FIELD_TYPES}
    for key, value in run_config.items():
        if key in known:
            name = known[key]
            values[name] = _coerce(key, value, _FIELD_TYPES[name])
        elif key.startswith("x-"):
            extra[key] = value
        else:
            close = difflib.get_close_matches(key.replace("_", "-"), known, n=3, cutoff=0.6)
            hint = f" (did you mean: {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown run-config key '{key}'{hint}")
    return validate(RunConfig(**values, extra=extra))
