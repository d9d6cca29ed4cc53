"""Export a run's trained models as plain PyTorch state dicts::

    python -m fedspc_app.export RUN_DIR --client K --out client-K.pt
    python -m fedspc_app.export RUN_DIR --global --out global.pt

Client K's model is what the run evaluated as client K: the shared block of the
server's last checkpoint and client K's personalized entries from its saved state
(Ditto: its personal model v_k; FedBABU: before the fine-tuning its evaluation
does). ``--global`` writes the server's model, where the shared block is the whole
model. Beside ``FILE`` goes ``FILE.json``, which says what the file holds.

Exit code 2: the run cannot give that model (one ``fedspc: ...`` line says why;
nothing is written).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clients.durable import DurableState, simulation_folder
from clients.local import assemble
from clients.state import COMMITTED, PENDING, ClientState
from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.files import atomic_open, atomic_write
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.protocol import ACCEPTED_ROUNDS, RUN_TOKEN
from fedspc_app.data.run_data import KNOWN_SHAPES, DatasetShape
from fedspc_app.launch.cli import BAD_INPUT, fail
from fedspc_app.models.run_model import load_arrays, make_model
from fedspc_app.models.split import ParameterSplit, parameter_split
from fedspc_app.runs.checkpoint import Checkpoint, fingerprint, read_checkpoint
from fedspc_app.runs.results import CONFIG_JSON, read_summary

FORMAT_VERSION = 1
GLOBAL = "global"


class ExportError(FedSPCError, RuntimeError):
    """The run folder cannot give the model asked for."""


@dataclass(frozen=True)
class RunFolder:
    """What exporting needs from a run folder, read and checked.

    Attributes
    ----------
    model : nn.Module
        The run's model as built from its seed (the caller loads the trained
        entries into it).
    checkpoint : Checkpoint
        The server's last checkpoint: ``checkpoint.shared`` is the trained shared block.
    record : dict
        ``config.json`` (``runtime``, ``num-clients``, ``dataset``, ...).
    """

    path: Path
    config: RunConfig
    method: Method
    shape: DatasetShape
    split: ParameterSplit
    num_clients: int
    model: nn.Module
    checkpoint: Checkpoint
    record: dict[str, Any]

    @property
    def complete(self) -> bool:
        return bool((read_summary(self.path) or {}).get("complete"))

    @property
    def deployment(self) -> bool:
        return self.record.get("runtime") == "deployment"

    @property
    def personalizes(self) -> bool:
        """Whether a client's model differs from the server's: personalized entries
        or a personal model (Ditto)."""
        return bool(self.split.personal or self.method.personal_model)

    def accepted_round(self, client: int) -> int:
        """The last round whose training reply of ``client`` the server aggregated."""
        accepted = self.checkpoint.strategy.get(ACCEPTED_ROUNDS)
        if not isinstance(accepted, list) or len(accepted) != self.num_clients:
            raise ExportError(f"the checkpoint in {self.path} does not say which training "
                              "replies of each client the server aggregated")
        return int(accepted[client])


@dataclass(frozen=True)
class ExportedModel:
    """A model of a run and what :func:`export` writes beside it."""

    model: nn.Module
    description: dict[str, Any]


def open_run(run_dir: str | Path) -> RunFolder:
    """Read ``config.json`` and the checkpoint of the run in ``run_dir``.

    Raises
    ------
    ExportError
        If ``run_dir`` is not a run folder or holds no checkpoint.
    """
    path = Path(run_dir).expanduser().resolve()
    try:
        record = json.loads((path / CONFIG_JSON).read_text())
        run_config = record["run-config"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ExportError(f"{path} is not a run folder: its {CONFIG_JSON} cannot be read "
                          f"({error}); give the folder <output-dir>/<run-name> of a run"
                          ) from None
    try:
        config = parse_run_config(run_config)
    except FedSPCError as error:
        raise ExportError(f"the run-config in {path / CONFIG_JSON}: {error}") from None
    num_clients = int(record.get("num-clients") or config.num_clients)
    checkpoint = _checkpoint(path, config, num_clients)
    method = get_method(config.method)
    shape = KNOWN_SHAPES[config.dataset]
    model = make_model(config, shape)
    split = parameter_split(model, method, shared_keys=config.shared_keys,
                            personal_keys=config.personal_keys,
                            local_buffers=config.dp)
    if set(checkpoint.shared) != set(split.shared):
        raise ExportError(f"the checkpoint in {path} does not hold this run's shared block "
                          f"({len(checkpoint.shared)} entries, the model shares "
                          f"{len(split.shared)})")
    return RunFolder(path, config, method, shape, split, num_clients, model, checkpoint,
                     record)


def _checkpoint(path: Path, config: RunConfig, num_clients: int) -> Checkpoint:
    try:
        checkpoint = read_checkpoint(path, fingerprint(config, num_clients))
    except FedSPCError as error:
        raise ExportError(f"cannot export from {path}: {error}") from None
    if checkpoint is not None:
        return checkpoint
    if not config.checkpoint:
        raise ExportError(
            f"the run in {path} kept no checkpoint (checkpoint = false), so its trained "
            "model was not saved; run it again with checkpoint = true (the default), and "
            "keep-client-state = true to export its clients' models")
    raise ExportError(f"{path} holds no checkpoint ({path / 'checkpoint.json'}): the run "
                      "wrote none yet, or only its results files were copied")


def global_model(run: RunFolder) -> ExportedModel:
    """The server's model after the checkpoint's round.

    Raises
    ------
    ExportError
        If the method shares only part of the model: the rest is each client's own.
    """
    if run.split.personal:
        raise ExportError(
            f"{run.config.label} shares only part of the model ({len(run.split.shared)} "
            f"of {len(run.split.shared) + len(run.split.personal)} state-dict entries; "
            f"{', '.join(run.split.personal[:3])}, ... stay on each client), so the run "
            "has no global model; export a client's model with --client K")
    load_arrays(run.model, run.checkpoint.shared)
    return ExportedModel(run.model, describe(run, GLOBAL, {
        "contents": f"the server's global model after round {run.checkpoint.round}"}))


def client_model(run: RunFolder, client: int,
                 client_state: str | Path | None = None) -> ExportedModel:
    """Client ``client``'s model as the run evaluated it.

    Parameters
    ----------
    client_state : path, optional
        A folder holding the clients' saved state (``partition-<K>.npz``), or a
        SuperNode's ``state-dir`` holding it under ``<run-name>/``; by default the
        run folder's ``client-state/``.

    Raises
    ------
    ExportError
        If ``client`` is not one of the run's clients or its saved state is gone.
    """
    if not 0 <= client < run.num_clients:
        raise ExportError(f"client {client} is not one of the run's clients: 0.."
                          f"{run.num_clients - 1} (num-clients = {run.num_clients} in "
                          f"{run.path / CONFIG_JSON})")
    held_out = run.config.held_out_clients
    if held_out and client >= run.num_clients - held_out:
        raise ExportError(
            f"client {client} is a held-out client (held-out-clients = {held_out}: clients "
            f"{run.num_clients - held_out}..{run.num_clients - 1}): it never trained and "
            "keeps nothing (each evaluation fine-tuned a fresh copy); export the global "
            "model (no --client) or a client that trained")
    if not run.personalizes:
        load_arrays(run.model, run.checkpoint.shared)
        return ExportedModel(run.model, describe(run, client, {
            "same-as-global": True,
            "contents": f"{run.config.label} personalizes nothing: every client's model "
                        f"is the server's global model after round {run.checkpoint.round}"}))
    state = saved_state(run, client, client_state)
    if run.method.personal_model:
        load_arrays(run.model, state.personal_model or run.checkpoint.shared)
        contents = f"client {client}'s personal model v_k (Ditto)"
    else:
        assemble(run.model, run.split, run.checkpoint.shared, state)
        contents = (f"the shared block of the checkpoint (round {run.checkpoint.round}) and "
                    f"client {client}'s personalized entries")
    extra = {"same-as-global": False, "contents": contents, "client-round": state.round}
    if run.method.finetune_before_eval:
        extra["note"] = (
            "before FedBABU's evaluation-time fine-tuning (fedbabu-finetune-epochs = "
            f"{run.config.fedbabu_finetune_epochs}, parts '{run.config.fedbabu_finetune_parts}'"
            "): the run's recorded accuracy is that of a fine-tuned copy of this model")
    return ExportedModel(run.model, describe(run, client, extra))


def saved_state(run: RunFolder, client: int,
                client_state: str | Path | None = None) -> ClientState:
    """Client ``client``'s state as the checkpoint knows it: the saved file (committed
    or still pending) of the last round whose reply the server aggregated.

    Raises
    ------
    ExportError
        If no such file is found (the message says where it went and how to keep it).
    """
    accepted = run.accepted_round(client)
    if accepted == 0:  # never aggregated: the common initial entries
        return ClientState()
    token = str(run.checkpoint.strategy.get(RUN_TOKEN) or "")  # "": written before tokens
    found = []
    for folder in state_folders(run, client_state):
        store = DurableState(folder, run.config.resolved_run_name, client)
        for slot in (COMMITTED, PENDING):
            state = store.read(slot, any_run=True)  # (another run's is named, not used)
            if state is None:
                continue
            ours = not token or store.token_of(slot) == token
            if ours and state.round == accepted:
                return state
            found.append(f"{store.path(slot)} (round {state.round}"
                         + ("" if ours else ", written by another run of this name") + ")")
    if found:
        raise ExportError(
            f"the checkpoint of {run.path} last aggregated client {client}'s training in "
            f"round {accepted}, but its saved state is from another round or run: "
            f"{', '.join(found)}; it belongs to another run of this name, or was replaced")
    raise ExportError(f"client {client}'s saved state (partition-{client}.npz) is not in "
                      f"{', '.join(map(str, state_folders(run, client_state)))}: "
                      + missing_state_reason(run, client, client_state))


def state_folders(run: RunFolder, client_state: str | Path | None) -> list[Path]:
    """Where client states may be: ``client_state`` or its ``<run-name>/`` (a copied
    state-dir); else where the simulation kept them (:func:`simulation_folder`): a
    relative ``client-state-dir`` in config.json is the run folder's (as written since
    config.json holds no absolute path), or the working directory's (as given before)."""
    name = run.config.resolved_run_name
    if client_state is not None:
        root = Path(client_state).expanduser()
        return [root, root / name]
    recorded = run.config.client_state_dir
    folders = [simulation_folder(run.path, name, recorded)]
    if recorded and not Path(recorded).expanduser().is_absolute():
        folders.insert(0, simulation_folder(run.path, name, str(run.path / recorded)))
    return list(dict.fromkeys(folders))


def missing_state_reason(run: RunFolder, client: int,
                         client_state: str | Path | None) -> str:
    """Why a client's state is not where :func:`state_folders` looks, and the fix."""
    if client_state is not None:
        return "that folder holds no state of this client"
    if run.deployment:
        return (f"this run ran in a deployment, where each SuperNode keeps its client's "
                f"state in <state-dir>/{run.config.resolved_run_name}/partition-{client}.npz "
                "(the state-dir of its --node-config; a SuperNode without one kept it in "
                "memory only). Copy that folder from the SuperNode of partition-id "
                f"{client} and pass it with --client-state DIR")
    if run.complete and not run.config.keep_client_state:
        return ("the run removed its clients' state when it completed (a simulation of "
                "an earlier version did, unless keep-client-state = true; now it keeps each "
                "client's final personalized parameters). Run it again (under another "
                "run-name, or with overwrite = true to replace this run)")
    return ("the run's client-state folder was not kept or not copied with it; pass a "
            "copy with --client-state DIR")


def describe(run: RunFolder, client: int | str, extra: dict[str, Any]) -> dict[str, Any]:
    """What :func:`export` writes beside the state dict."""
    config = run.config
    model = {"model": config.model, "model-width": config.model_width}
    if config.model == "vit":
        model["vit-embed-dim"] = config.vit_embed_dim
    return {
        "format": FORMAT_VERSION,
        **model,
        "dataset": config.dataset,
        "num-classes": run.shape.num_classes,
        "in-chans": run.shape.in_chans,
        "image-size": run.shape.image_size,
        "seed": config.seed,
        "method": config.method,
        "label": config.label,
        "client": client,
        **extra,
        "round": run.checkpoint.round,
        "phase": run.checkpoint.phase,
        "run-name": config.resolved_run_name,
        "run-complete": run.complete,
        "split": {"shared": list(run.split.shared), "personal": list(run.split.personal)},
    }


def load_client_model(run_dir: str | Path, client: int, *,
                      client_state: str | Path | None = None) -> nn.Module:
    """Client ``client``'s trained model of the run in ``run_dir`` (see :func:`client_model`)."""
    return client_model(open_run(run_dir), client, client_state).model


def load_global_model(run_dir: str | Path) -> nn.Module:
    """The server's trained model of the run in ``run_dir`` (see :func:`global_model`)."""
    return global_model(open_run(run_dir)).model


def export(run_dir: str | Path, out: str | Path, client: int | None = None, *,
           client_state: str | Path | None = None) -> dict[str, Any]:
    """Write a model's ``state_dict`` to ``out`` and its description to ``<out>.json``.

    Parameters
    ----------
    client : int | None
        The client whose model to write; ``None``: the global model.
    client_state : path, optional
        Where the clients' saved state is (see :func:`client_model`).

    Returns
    -------
    dict
        The description written to ``<out>.json``.

    Raises
    ------
    ExportError
        If the run cannot give that model; nothing is written then.
    """
    run = open_run(run_dir)
    exported = (global_model(run) if client is None
                else client_model(run, client, client_state))
    out = Path(out).expanduser()
    description = {"file": out.name, **exported.description}
    with atomic_open(out) as handle:
        torch.save(exported.model.state_dict(), handle)
    atomic_write(description_path(out), json.dumps(description, indent=2) + "\n")
    return description


def description_path(out: str | Path) -> Path:
    """``<out>.json``, the description beside an exported state dict."""
    out = Path(out)
    return out.with_name(out.name + ".json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder "
                        "(<output-dir>/<run-name>)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--client", type=int, metavar="K", help="client K's model (0..K-1)")
    which.add_argument("--global", dest="global_model", action="store_true",
                       help="the server's model (methods that share the whole model)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="where to write the state dict (and FILE.json beside it)")
    parser.add_argument("--client-state", metavar="DIR",
                        help="the clients' saved state, copied from elsewhere (a "
                             "SuperNode's state-dir, or a run's client-state/)")
    args = parser.parse_args(argv)
    try:
        description = export(args.run_dir, args.out, args.client,
                             client_state=args.client_state)
    except FedSPCError as error:
        return fail(error, BAD_INPUT)
    which_model = ("the global model" if description["client"] == GLOBAL
                   else f"client {description['client']}'s model")
    print(f"Wrote {which_model} ({description['label']}, round {description['round']}) "
          f"to {args.out} and {description_path(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
