"""ServerApp: parse the run-config, check data and partition, run the method's strategy.

In simulation the server loads the dataset and computes the partition itself, so
that any bad input stops the run with one message before training. In a
deployment the server machine need not hold the data (see
:mod:`fedspc_app.server.deployment`).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from torch import nn

from clients.durable import (
    FINAL_MARKER,
    keep_final_personal,
    simulation_folder,
    write_view_marker,
)
from clients.held_out import fine_tuned_keys
from clients.local import expected_shared_steps, keeps_client_state
from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.dp_mechanism import noise_std
from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.files import folder_lock
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.protocol import ACCEPTED_ROUNDS, DEPLOYMENT, NUM_CLIENTS, RUN_NAME
from fedspc_app.core.records import to_record
from fedspc_app.data.datasets import ImageDataset
from fedspc_app.data.partition_files import save_partition
from fedspc_app.data.run_data import DatasetShape, load_partition
from fedspc_app.models.run_model import make_model, state_arrays
from fedspc_app.models.split import ParameterSplit, check_private_release, parameter_split
from fedspc_app.runs import dp_account
from fedspc_app.runs.checkpoint import TRAINED, RoundRecords, fingerprint, resume_point
from fedspc_app.runs.pause import RunPaused, clear_pause
from fedspc_app.runs.provenance import provenance
from fedspc_app.runs.results import (
    CONFIG_JSON,
    RunRecorder,
    TrafficGrid,
    read_json_file,
    read_summary,
)
from fedspc_app.runs.runfolder import claim_run_folder
from fedspc_app.runs.tensorboard import check_tensorboard
from fedspc_app.runs.wandb_log import check_wandb
from fedspc_app.server import warm_up
from fedspc_app.server.deployment import is_deployment, preflight, server_dataset
from fedspc_app.server.evaluation import ServerEvaluator, check_server_evaluation
from fedspc_app.training.precision import (
    apply_determinism,
    emulation_warning,
    precision_report,
    resolve_device,
)
from fedspc_app.training.schedule import round_learning_rates
from strategies import (
    AggregationRule,
    FedSPC,
    PersonalizedFedAvg,
    Privacy,
    RoundReport,
    ServerOptimizer,
    run_rounds,
)

app = ServerApp()


def build_strategy(config: RunConfig, method: Method, split: ParameterSplit,
                   num_clients: int = 2, train_sizes: Sequence[int] | None = None):
    """The method's strategy: FedSPC when the control variates are on, else
    PersonalizedFedAvg (both aggregate the shared block alike), with the run's
    aggregation rule and server optimizer. ``train_sizes`` (each partition's training
    images): the replies' reported images and shared steps are checked against them."""
    optimizer = None
    if config.server_optimizer != "mean":
        optimizer = ServerOptimizer(
            config.server_optimizer, split.corrected,
            learning_rate=config.server_learning_rate, momentum=config.server_momentum,
            beta1=config.server_beta1, beta2=config.server_beta2, tau=config.server_tau)
    expected = None
    if train_sizes is not None:
        expected = {pid: (int(size), expected_shared_steps(method, config, split, int(size)))
                    for pid, size in enumerate(train_sizes)}
    common = dict(
        shared_keys=split.shared,
        aggregation=AggregationRule(config.aggregation, trim_fraction=config.trim_fraction,
                                    byzantine=config.byzantine_clients,
                                    krum_select=config.krum_select,
                                    norm_bound=config.norm_bound),
        fraction_train=config.fraction_train,
        min_available_nodes=num_clients,
        num_partitions=num_clients,
        min_train_replies=config.min_train_replies,
        drift_keys=split.corrected,
        seed=config.seed,
        node_wait=config.node_wait,
        server_optimizer=optimizer,
        expected_counts=expected,
        privacy=(Privacy(config.dp_clipping_norm, config.dp_noise_multiplier,
                         private_steps(method, config, split, train_sizes),
                         clip_on_server=config.dp_clipping == "server",
                         clipping_quantile=config.dp_clipping_quantile,
                         clipping_lr=config.dp_clipping_lr,
                         count_stddev=config.dp_clipped_count_stddev,
                         reference_smoothing=config.dp_reference_smoothing,
                         min_clipping_factor=config.dp_clipping_norm_min_factor,
                         max_clipping_factor=config.dp_clipping_norm_max_factor)
                 if config.dp else None),
        learning_rates=(round_learning_rates(config) if config.lr_schedule != "constant"
                        else None),
        held_out_clients=config.held_out_clients,
    )
    try:
        return _strategy(config, method, split, common)
    except ValueError as error:  # adaptive clipping: σ_b too small for σ at this q·K
        if config.dp_clipping_quantile > 0 and "σ_b" in str(error):
            raise ConfigError(f"run-config 'dp-clipped-count-stddev': {error}") from None
        raise


def _strategy(config: RunConfig, method: Method, split: ParameterSplit,
              common: dict[str, Any]):
    """:func:`build_strategy`'s strategy from its ``common`` arguments."""
    if method.control_variates or config.fedspc:
        if config.aggregation == "krum":
            log(WARNING, "aggregation 'krum' with FedSPC: u_bar follows one client's "
                "reference a round (FedRep + FedSPC on CIFAR-100, one seed, no attacker: "
                "15.30 % with fedspc-reference 'increment', 31.89 % with "
                "'client-centre' (the centre 'auto' picks, 'server-centre', with the "
                "server keeping the u_k, was not run), 37.88 % under the mean; "
                "docs/robustness.md); 'multi-krum', 'median' or 'trimmed-mean' keep "
                "more than one client")
        if config.aggregation in ("krum", "multi-krum") and config.reference_rule == "increment":
            log(WARNING, "aggregation %r with fedspc-reference 'increment': u_bar moves by "
                "the reference changes of the clients Krum selected on their shared "
                "updates; a change also carries the client's reported step count, which "
                "Krum did not score ('auto' or a centre rule scores the u_k themselves)",
                config.aggregation)
        log(INFO, "FedSPC: u_bar by %s (fedspc-reference = %r, aggregation = %r)",
            config.reference_rule, config.fedspc_reference, config.aggregation)
        return FedSPC(corrected_keys=split.corrected, learning_rate=config.learning_rate,
                      upload=config.fedspc_upload, reference=config.reference_rule,
                      reference_dir=config.run_dir, **common)
    return PersonalizedFedAvg(**common)


def private_steps(method: Method, config: RunConfig, split: ParameterSplit,
                  sizes: Sequence[int] | None) -> int:
    """E under differential privacy: the shared steps every client takes a round
    (``expected_shared_steps``), which FedSPC's u_bar, computed from the privatized
    aggregate alone, needs to be the same for all."""
    steps = {expected_shared_steps(method, config, split, int(size))
             for size in (sizes if sizes else [1])}
    if len(steps) != 1:
        raise ConfigError("differential privacy needs every client to take the same "
                          f"number of shared steps a round, and these take {sorted(steps)} "
                          "(set 'local-steps')")
    return steps.pop()


def train_sizes(partition: Any) -> list[int]:
    """Each partition's training images, from the run's partition (a simulation's
    :class:`Partition`, or a deployment's counts as its SuperNodes reported them)."""
    if isinstance(partition, dict):
        return [int(sum(counts)) for counts in partition["train_counts"]]
    return [len(partition.client(pid)[0]) for pid in range(partition.num_clients)]


def wait_for_clients(grid: Grid, expected: int, timeout: float = 600.0) -> int:
    """Number of connected clients; with ``expected > 0`` wait until that many."""
    deadline = time.monotonic() + timeout
    while True:
        count = len(list(grid.get_node_ids()))
        if (expected and count >= expected) or (not expected and count > 0):
            return expected or count
        if time.monotonic() > deadline:
            raise FedSPCError(
                f"only {count} client(s) connected after {timeout:.0f} s "
                f"(num-clients = {expected})"
            )
        time.sleep(1.0)


@dataclass(frozen=True)
class CheckedRun:
    """What the checks before round 1 established (nothing written yet)."""

    config: RunConfig
    method: Method
    deployment: bool
    num_clients: int
    shape: DatasetShape
    sizes: dict[str, int]
    partition: dict[str, Any]
    model: nn.Module
    split: ParameterSplit
    warm_up: warm_up.WarmUp | None = None
    dataset: ImageDataset | None = None  # when the server holds the data
    nodes: Mapping[int, int] | None = None  # node id -> partition, as preflight found


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run a federated training as the run-config describes: check everything, then
    train while holding the results folder's lock (one run at a time writes it)."""
    with contextlib.ExitStack() as held:
        try:
            checked = check_run(grid, context)
            locked = time.time()  # a pause request from before this is stale
            held.enter_context(folder_lock(checked.config.run_dir,
                                           f"run {checked.config.resolved_run_name!r}"))
        except FedSPCError as error:
            log(ERROR, "Run not started: %s", error)
            raise SystemExit(f"fedspc: {error}") from None
        train(grid, checked, locked)


def check_run(grid: Grid, context: Context) -> CheckedRun:
    """Parse the run-config, check the data (or the clients' data in a deployment),
    the partition and the split; raise FedSPCError on bad input."""
    config, note = claim_run_folder(parse_run_config(context.run_config))
    if note:
        log(INFO, "%s", note)
    method = get_method(config.method)
    round_learning_rates(config)  # every round's η > 0, before anything runs
    check_tensorboard(config)  # its package, before anything runs
    check_wandb(config)
    deployment = is_deployment(grid)
    if deployment and not config.num_clients:
        raise ConfigError(
            "run-config 'num-clients' must be the number of SuperNodes in a deployment "
            "(each started with --node-config \"partition-id=i num-partitions=N\")")
    # A simulation's clients load their data while the server loads its own.
    warming = None if deployment else warm_up.start(grid, config.num_clients)
    shape, dataset = server_dataset(config, deployment)
    num_clients = wait_for_clients(grid, config.num_clients)
    if config.held_out_clients >= num_clients:
        raise ConfigError(
            f"run-config 'held-out-clients' = {config.held_out_clients} leaves no client to "
            f"train among the run's {num_clients} clients (the held-out clients are "
            "counted in them: raise the number of SuperNodes / num-supernodes)")
    nodes: dict[int, int] = {}
    if deployment:
        partition, nodes = preflight(grid, config, num_clients, shape)
        sizes = {"train": sum(map(sum, partition["train_counts"])),
                 "test": sum(map(sum, partition["test_counts"]))}
    else:
        partition = load_partition(config, num_clients)
        sizes = {"train": int(dataset.train_labels.shape[0]),
                 "test": int(dataset.test_labels.shape[0])}
    model = make_model(config, shape)
    split = parameter_split(model, method, shared_keys=config.shared_keys,
                            personal_keys=config.personal_keys,
                            local_buffers=config.dp)
    if config.dp:
        check_private_release(model, split, shape.in_chans, shape.image_size, config.seed)
    check_server_evaluation(config, split, dataset)
    return CheckedRun(config, method, deployment, num_clients, shape, sizes, partition,
                      model, split, warming, dataset, nodes)


def train(grid: Grid, checked: CheckedRun, locked: float | None = None) -> None:
    """The rounds of a checked run (resuming from its checkpoint when asked).
    ``locked``: when this process took the run folder's lock (a ``time.time()``); a
    pause request made since, during the start-up too, is honoured."""
    config, method, split, num_clients = (checked.config, checked.method, checked.split,
                                          checked.num_clients)
    deployment, shape, sizes = checked.deployment, checked.shape, checked.sizes
    traffic = TrafficGrid(grid)
    recorder = RunRecorder(config, traffic=traffic, echo=lambda line: log(INFO, "%s", line))
    identity = fingerprint(config, num_clients)
    try:
        # Where the run's K is known only now (num-clients unset), adaptive clipping's
        # σ_b > σ/2 is checked here: a ConfigError, reported as any other refusal.
        strategy = build_strategy(config, method, split, num_clients,
                                  train_sizes(checked.partition))
        num_rounds = privacy_budget(config, recorder)
        resumed = resume_point(config, identity)
        if resumed is not None:
            strategy.load_state_dict(resumed.strategy, resumed.round,
                                     global_reference=resumed.global_reference)
            resumed.global_reference.clear()  # restored: lets go of the arrays file
            strategy.load_optimizer_arrays(resumed.optimizer)
            if set(resumed.shared) != set(split.shared):
                raise ConfigError("the checkpoint's shared block does not match this model")
            check_saved_client_state(checked, resumed.strategy)
    except (FedSPCError, ValueError) as error:
        log(ERROR, "Run not started: %s", error)
        raise SystemExit(f"fedspc: {error}") from None
    if config.dp and config.min_train_replies != RunConfig.min_train_replies:
        log(WARNING, "min-train-replies = %g is not applied under differential privacy: a "
            "round releases the noised sum over q·K however many usable replies came",
            config.min_train_replies)
    precision = run_precision(config, deployment)
    made_by, code_warning = provenance(
        read_json_file(config.run_dir / CONFIG_JSON) if resumed else None,
        resumed.round if resumed else 0, precision["device"] if not deployment else "cpu")
    if code_warning:
        log(WARNING, "%s", code_warning)
    warmed = (warm_up.finish(grid, checked.warm_up, config.round_timeout)
              if checked.warm_up else None)
    # Each node replies only for the partition it named before round 1 (its preflight
    # report in a deployment, its warm-up answer in a simulation).
    for node, partition_id in (checked.nodes or {}).items():
        strategy.sampler.bind(node, partition_id)
    if checked.warm_up:
        strategy.sampler.bind_answers(checked.warm_up.answers)
    recorder.start(extra={
        "method": method.summary,
        "num-clients": num_clients,
        "runtime": "deployment" if deployment else "simulation",
        "dataset": {"name": shape.name, **sizes, "classes": shape.num_classes},
        "split": ("declared (shared-keys/personal-keys)"
                  if config.shared_keys.strip() or config.personal_keys.strip()
                  else f"the method's ({method.shared} shared)"),
        "shared-keys": list(split.shared),
        "personal-keys": list(split.personal),
        "resumed-after-round": resumed.round if resumed else 0,
        **({"held-out": {
            "clients": config.held_out_clients,
            "partition-ids": list(range(num_clients - config.held_out_clients, num_clients)),
            "epochs": config.held_out_epochs, "parts": config.held_out_parts,
            "fine-tuned-keys": list(fine_tuned_keys(method, config, split)),
        }} if config.held_out_clients else {}),
        "precision": precision,
        # How u_bar follows the clients, "auto" resolved (strategies/fedspc.py).
        **({"fedspc-reference": {"setting": config.fedspc_reference,
                                 "resolved": strategy.reference}}
           if isinstance(strategy, FedSPC) else {}),
        **({"privacy": privacy_entry(config, strategy, num_rounds, split)}
           if config.dp else {}),
        # Which code, software and machine made it (each start of the run: segments).
        **made_by,
        # The server's own settings; each client applies the same key for itself.
        "deterministic": apply_determinism(config.deterministic),
        **({"client-warm-up": warmed} if warmed else {}),
    }, rounds=resumed.rounds if resumed else None,
        elapsed=resumed.elapsed_seconds if resumed else 0.0)
    save_partition(checked.partition, recorder.run_dir)
    log(INFO, "%s | %s on %s, %s, %s, %d rounds, %s", config.label,
        config.model, config.dataset,
        f"{num_clients - config.held_out_clients} clients + {config.held_out_clients} "
        "held out" if config.held_out_clients else f"{num_clients} clients",
        f"{config.classes_per_client} classes per client" if config.partition == "classes"
        else f"alpha={config.alpha:g}", config.num_rounds,
        describe_precision(precision, config.channels_last))

    records = RoundRecords(config, strategy, recorder, identity, resumed, since=locked)
    if not strategy.run_token:  # a new run (a resumed one keeps its checkpoint's)
        strategy.run_token = secrets.token_hex(8)
    if not deployment and config.checkpoint and keeps_client_state(method, config, split):
        # The clients check they see the folder so (DurableState.check_view).
        write_view_marker(client_state_folder(config), config.resolved_run_name,
                          strategy.run_token)
    round_config = {NUM_CLIENTS: num_clients, DEPLOYMENT: deployment,
                    RUN_NAME: config.resolved_run_name}
    initial = resumed.shared if resumed else state_arrays(checked.model, split.shared)
    on_round_end = records.on_round_end
    if config.evaluate_server:
        evaluator = ServerEvaluator(config, checked.model, checked.dataset)

        def on_round_end(server_round, train_metrics, evaluate_metrics, report):
            if evaluate_metrics is not None:  # an evaluated round: the server's model too
                evaluate_metrics.update(evaluator(records.shared))
            records.on_round_end(server_round, train_metrics, evaluate_metrics, report)

    evaluate_first = resumed is not None and resumed.phase == TRAINED
    if evaluate_first and resumed.trained:
        # The round's training happened before the restart: its record keeps that
        # phase's traffic and the fate of its replies.
        traffic.sent = int(resumed.trained.get("bytes-sent") or 0)
        traffic.received = int(resumed.trained.get("bytes-received") or 0)
        if isinstance(resumed.trained.get("report"), dict):
            strategy.report = RoundReport(**resumed.trained["report"])
    try:
        run_rounds(
            strategy, traffic,
            arrays=to_record(initial),
            num_rounds=num_rounds,
            first_round=resumed.round + (0 if evaluate_first else 1) if resumed else 1,
            evaluate_first=evaluate_first,
            resumed_train_metrics=(MetricRecord(resumed.train_metrics)
                                   if evaluate_first and resumed.train_metrics else None),
            timeout=config.round_timeout,
            train_config=ConfigRecord(round_config),
            evaluate_config=ConfigRecord(round_config),
            max_failed_rounds=config.max_failed_rounds,
            evaluate_every=evaluated_every(config, num_rounds),
            evaluate_fraction=config.evaluate_fraction,
            phase_seconds=config.dp_phase_seconds if config.dp else 0.0,
            failed_streak=resumed.failed_streak if resumed else 0,
            on_trained=records.on_trained,
            on_round_end=on_round_end,
        )
    except RunPaused as paused:
        clear_pause(recorder.run_dir)
        recorder.finish(paused=paused.after_round, paused_by=paused.reason)
        return
    except FedSPCError as error:
        recorder.finish()
        log(ERROR, "Run stopped: %s", error)
        raise SystemExit(f"fedspc: {error}") from None
    clear_pause(recorder.run_dir)  # asked during the last round: nothing left to pause
    # A simulation keeps its clients' final personalized parameters (what export
    # needs), and their u_k and the rest only when asked (keep-client-state, which a
    # later extension of the run needs); a deployment's SuperNodes keep theirs.
    strip = (not deployment and not config.keep_client_state
             and keeps_client_state(method, config, split))
    recorder.finish(can_extend=config.checkpoint and not strip)
    if strip:
        # Under privacy no size: only the clients ever drawn have a file, so the sum
        # over one file's size counts them.
        kept = keep_final_personal(client_state_folder(config), record_size=not config.dp)
        log(INFO, "Kept each client's final personalized parameters for export (%sin %s); "
            "keep-client-state = true keeps u_k too, so that the run can be extended",
            "" if config.dp else f"{kept / 1e6:.1f} MB ", client_state_folder(config))


def privacy_budget(config: RunConfig, recorder: RunRecorder) -> int:
    """The rounds this run trains: ``num-rounds``, or fewer where ``dp-target-epsilon``
    would be exceeded (the run then ends cleanly before that round); under
    differential privacy the recorder reports ε after every round."""
    if not config.dp:
        return config.num_rounds

    def account(rounds: int) -> float:
        return dp_account.epsilon(config.dp_noise_multiplier, config.fraction_train, rounds,
                                  config.dp_delta, config.dp_accountant)

    recorder.dp_epsilon = account
    if not config.dp_target_epsilon:
        return config.num_rounds
    allowed = dp_account.rounds_within(config.dp_target_epsilon, config.dp_noise_multiplier,
                                       config.fraction_train, config.dp_delta,
                                       config.num_rounds, config.dp_accountant)
    if allowed == 0:
        raise ConfigError(f"dp-target-epsilon = {config.dp_target_epsilon:g} allows no round "
                          f"(one round already reaches ε {account(1):.3g})")
    if allowed < config.num_rounds:
        recorder.num_rounds = allowed
        recorder.stopped_by = (f"dp-target-epsilon {config.dp_target_epsilon:g}: round "
                               f"{allowed + 1} would reach ε {account(allowed + 1):.3g}")
        log(WARNING, "The privacy budget (dp-target-epsilon = %g, dp-delta = %g) allows %d "
            "of the %d rounds: the run ends after round %d (ε %.3g)",
            config.dp_target_epsilon, config.dp_delta, allowed, config.num_rounds, allowed,
            account(allowed))
    return allowed


def evaluated_every(config: RunConfig, num_rounds: int) -> int:
    """Every how many rounds the clients are evaluated: ``evaluate-every``, or under
    differential privacy with ``dp-evaluate = "final"`` only the last round."""
    return num_rounds if config.dp and config.dp_evaluate == "final" else config.evaluate_every


def not_covered(config: RunConfig) -> list[str]:
    """config.json's ``privacy`` ``not-covered``: what is published outside ε."""
    evaluated = ("after the last round only (dp-evaluate = final), still depending on how "
                 "often each client was drawn" if config.dp_evaluate == "final" else
                 "after every evaluated round (dp-evaluate = every-round)")
    padded = (f"padded to dp-phase-seconds = {config.dp_phase_seconds:g} but for a phase "
              "that outlasts it" if config.dp_phase_seconds > 0 else
              "not padded (dp-phase-seconds = 0)")
    evaluation = (f"evaluation metrics (accuracy, loss, held-out metrics), {evaluated}: "
                  "unnoised, on the clients' own test data, with personal parts trained in "
                  "the rounds each client was drawn")
    timing = ("timing: a training phase lasts longer the more clients it draws, seen in "
              "message, file and log times (a grid's log headers too), W&B's _runtime and "
              "the day in config.json's segments, and in a grid also in its non-private "
              "cells' own (file, log, client-state/, TensorBoard and W&B times); "
              f"{padded}; in a simulation, also when each drawn client's message is "
              "picked up by a worker")
    state = ("the checkpoint and client-state/ (the server's and the clients' own; which "
             "clients have a file there, and the files' sizes and times, tell which were "
             "ever drawn and when)")
    return [evaluation, timing, state]


def privacy_entry(config: RunConfig, strategy: PersonalizedFedAvg, num_rounds: int,
                  split: ParameterSplit) -> dict[str, Any]:
    """config.json's ``privacy``: what ε means and what the server did (the secret
    the noise and the draws come from is never written here)."""
    rate = min(config.fraction_train, 1.0)
    return {
        "guarantee": "client-level (ε, δ)-differential privacy of the released shared "
                     "blocks and u_bar",
        "adjacency": dp_account.ADJACENCY,
        "accountant": f"dp_accounting {config.dp_accountant.upper()}, "
                      + ("Gaussian" if rate >= 1.0 else
                         f"Gaussian Poisson-sampled at q = {rate:g}") + " per round",
        "sampling": ("every training client every round (no amplification)" if rate >= 1.0
                     else f"Poisson: each training client with probability {rate:g}, "
                          "drawn from a secret of the server"),
        "noise": "from a secret of the server drawn from OS entropy (kept in its "
                 "checkpoint only), not from the run-config's seed",
        "estimator": "(sum of the clipped "
                     + ("uncorrected steps θ_k + Eη(ū − u_k) − θ" if config.dp_reference == "level"
                        else "updates") + " + N(0, (σC)²)) / (q·K)",
        "expected-clients": strategy.expected_clients,
        "noise-std": noise_std(config.dp_noise_multiplier, config.dp_clipping_norm,
                               strategy.expected_clients),
        "clipping-norm": config.dp_clipping_norm, "clipping": config.dp_clipping,
        "noise-multiplier": config.dp_noise_multiplier, "delta": config.dp_delta,
        "local-steps": config.local_steps, "shared-steps": strategy.privacy.steps,
        "rounds": num_rounds, "shared-keys-released": list(split.corrected),
        "phase-seconds": config.dp_phase_seconds, "evaluate": config.dp_evaluate,
        "not-covered": not_covered(config), **adaptive_entry(config, strategy)}


def adaptive_entry(config: RunConfig, strategy: PersonalizedFedAvg) -> dict[str, Any]:
    """config.json's ``privacy`` on adaptive clipping and u_bar's smoothing (none when
    both are off)."""
    release, out = strategy.release, {}
    if release.privacy.adaptive:
        out["adaptive-clipping"] = {
            "target-quantile": config.dp_clipping_quantile,
            "learning-rate": config.dp_clipping_lr, "initial-clipping-norm":
            config.dp_clipping_norm, "clipping-norm-bounds": list(
                release.privacy.clipping_bounds), "count-stddev": release.count_stddev,
            "update-noise-multiplier": release.update_multiplier,
            "estimator": "C_{t+1} = C_t exp(−η_C (b̃ − γ)), b̃ = 1/2 + (Σ (b_k − 1/2) + "
                         "N(0, σ_b²)) / (q·K); the update's noise σ_Δ C_t with σ_Δ = "
                         "(σ^−2 − (2σ_b)^−2)^(−1/2): one Gaussian mechanism of "
                         "multiplier σ a round, as accounted"}
        out["noise-std"] = noise_std(release.update_multiplier, config.dp_clipping_norm,
                                     strategy.expected_clients)
    if config.dp_reference_smoothing > 0:
        out["reference-smoothing"] = config.dp_reference_smoothing
    if config.dp_reference != "increment":
        out["reference"] = config.dp_reference  # the clients release uncorrected steps
    return out


def client_state_folder(config: RunConfig) -> Path:
    """Where the clients of a simulation keep their state (``client-state-dir``)."""
    return simulation_folder(config.run_dir, config.resolved_run_name, config.client_state_dir)


def run_precision(config: RunConfig, deployment: bool) -> dict[str, Any]:
    """The run's precision as config.json records it, with one warning for bf16 on a
    device that emulates it. The clients of a simulation share the server's machine;
    in a deployment each SuperNode resolves ``auto`` for its own device."""
    if deployment:
        return {"setting": config.precision,
                "resolved": config.precision if config.precision != "auto"
                else "per SuperNode (bf16 where its device has native bfloat16)"}
    device = resolve_device(config)
    warning = emulation_warning(config.precision, device)
    if warning:
        log(WARNING, "%s", warning)
    return precision_report(config.precision, device)


def describe_precision(precision: dict[str, Any], channels_last: bool) -> str:
    """``bf16 (auto) + channels-last`` for the progress header."""
    text = precision["resolved"]
    if precision["setting"] == "auto":
        text = f"{text} (auto)" if text in ("fp32", "bf16") else f"precision {text}"
    return text + (" + channels-last" if channels_last else "")


def check_saved_client_state(checked: CheckedRun, strategy_state: dict) -> None:
    """A simulated run continues only where its clients' saved state still is.

    A client whose reply was aggregated has personalized parameters or u_k on disk
    (``<run folder>/client-state/``); without them the run would go on from the
    initial ones, another experiment. In a deployment the SuperNodes check theirs.
    """
    config = checked.config
    folder = client_state_folder(config)
    final_only = (folder / FINAL_MARKER).is_file()
    if (checked.deployment or (folder.is_dir() and not final_only)
            or not keeps_client_state(checked.method, config, checked.split)
            or not any(int(r) for r in strategy_state.get(ACCEPTED_ROUNDS, []))):
        return
    summary = read_summary(config.run_dir) or {}
    if summary.get("complete"):
        raise ConfigError(
            f"{config.run_dir} holds a finished run of {summary.get('rounds')} rounds whose "
            "clients kept only their final personalized parameters when it completed (u_k "
            "and the rest of their state were removed), so it cannot be extended to more "
            "rounds. Runs started with "
            "keep-client-state = true keep it; start this one again (without resume) to "
            "run all the rounds")
    raise ConfigError(
        f"the clients' saved state {folder} is missing, so the run in {config.run_dir} "
        "cannot continue: its personalized parameters and u_k are gone. Start it "
        "again without resume, or under another run-name")
