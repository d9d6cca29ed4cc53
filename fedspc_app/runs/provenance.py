"""Which code, software and machine made a run: what ``config.json`` records of it.

A result is only worth as much as one can say what produced it. Every run records

* ``code``: a SHA-256 of the app's Python source (the three packages a FAB carries:
  ``fedspc_app``, ``strategies``, ``clients``), the package version, and, when the run
  was started from a git checkout, its commit and whether the app's tracked files
  differed from it (``dirty``). Under ``flwr run`` the ServerApp runs from the installed FAB, which is
  no checkout: the launchers of this project (grid runner, ``simulate``) describe their
  checkout to it through the environment (:data:`ORIGIN_ENV`);
* ``software``: Python, flwr, torch, numpy and timm versions;
* ``machine``: the CPU model and core count, and the GPU model when one is used;
* ``segments``: one entry per start of the run (first round it trained, the date it
  started, code, software, machine), so a run resumed under other code or on another
  machine says so.

Two runs were made by the same code when their source hashes agree
(:func:`code_id`): a commit that changes only documentation or results does not
change it, an uncommitted edit of the source does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("fedspc_app", "strategies", "clients")
SOURCE_ROOT = Path(__file__).resolve().parents[2]
ORIGIN_ENV = "FEDSPC_CODE_ORIGIN"
"""JSON ``{"git-commit": ..., "dirty": ...}`` a launcher sets for the apps it starts."""


def source_hash(root: Path = SOURCE_ROOT) -> str:
    """SHA-256 over the relative paths and bytes of every ``*.py`` of :data:`PACKAGES`
    under ``root`` (sorted, so the same files give the same hash anywhere)."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_origin(root: Path = SOURCE_ROOT) -> dict[str, Any] | None:
    """``{"git-commit": <sha>, "dirty": bool}`` of the checkout holding ``root``, or
    ``None`` when it is no git checkout (or git is missing). ``dirty``: a tracked file
    of the app (:data:`PACKAGES`, or ``pyproject.toml`` with the run-config defaults)
    differs from the commit; other files, such as committed results or documentation
    edited in the checkout, and untracked files do not count."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top != root.resolve():  # the packages sit in someone else's repository
            return None
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--",
                         *PACKAGES, "pyproject.toml"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"git-commit": commit, "dirty": dirty}


def origin_env(root: Path = SOURCE_ROOT) -> dict[str, str]:
    """The environment a launcher gives the Flower processes it starts, so that a run
    from an installed FAB still records the checkout it came from."""
    origin = git_origin(root)
    return {ORIGIN_ENV: json.dumps(origin)} if origin else {}


def _origin_from_env() -> dict[str, Any] | None:
    try:
        origin = json.loads(os.environ.get(ORIGIN_ENV, ""))
    except ValueError:
        return None
    if (isinstance(origin, dict) and isinstance(origin.get("git-commit"), str)
            and isinstance(origin.get("dirty"), bool)):
        return {"git-commit": origin["git-commit"], "dirty": origin["dirty"]}
    return None


def _package_version() -> str | None:
    try:
        return metadata.version("fedspc")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def code_version() -> dict[str, Any]:
    """The running code: ``source-sha256``, ``package-version`` and, from this
    checkout or the launcher's (:data:`ORIGIN_ENV`), ``git-commit`` and ``dirty``."""
    code: dict[str, Any] = {"source-sha256": source_hash(),
                            "package-version": _package_version()}
    origin = git_origin()
    if origin is not None:
        code.update(origin, origin="checkout")
    else:
        launched = _origin_from_env()
        if launched is not None:
            # The launcher's checkout; the FAB was built from it when the launch began.
            code.update(launched, origin="launcher")
    return code


def software_versions() -> dict[str, str | None]:
    """Python and the libraries a result depends on."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("flwr", "torch", "numpy", "timm"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> dict[str, Any]:
    """The machine a run trains on: CPU model and cores, and the GPU's model when
    ``device`` is ``cuda``."""
    described: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                                 "platform": platform.platform(terse=True)}
    if device == "cuda":
        import torch  # only here: strategies-side callers never load torch

        described["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() \
            else None
    return described


def code_id(code: Mapping[str, Any] | None) -> str | None:
    """What identifies code across runs: its source hash (``None`` when unrecorded)."""
    if not isinstance(code, Mapping):
        return None
    value = code.get("source-sha256")
    return value if isinstance(value, str) else None


def describe_code(code: Mapping[str, Any] | None) -> str:
    """``git 1a2b3c4d (dirty), source 9f8e7d6c`` or ``unrecorded``."""
    if not isinstance(code, Mapping) or not code_id(code):
        return "unrecorded"
    parts = []
    if isinstance(code.get("git-commit"), str):
        parts.append(f"git {code['git-commit'][:8]}" + (" (dirty)" if code.get("dirty")
                                                         else ""))
    elif code.get("package-version"):
        parts.append(f"fedspc {code['package-version']}")
    parts.append(f"source {code_id(code)[:8]}")
    return ", ".join(parts)


def segment(first_round: int, device: str) -> dict[str, Any]:
    """One start of a run: from ``first_round`` on, the UTC date it started (no time of
    day), this code, software and machine. A time would give a run's time by difference
    with the next start in a grid, and a private run's time grows with how many clients
    its rounds drew: from a private cell's own start (correlation 0.72 with its draws),
    and from a non-private cell's before and after it (0.73), so no run keeps one."""
    return {"first-round": first_round,
            "started": datetime.now(UTC).date().isoformat(),
            "code": code_version(), "software": software_versions(),
            "machine": machine(device)}


def run_segments(previous: Sequence[Mapping[str, Any]] | None, resumed_after: int,
                 current: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The segments of a run that (re)starts after round ``resumed_after`` with segment
    ``current``: the earlier ones that started at or before that round, then this one.

    A resumed run whose earlier ``config.json`` predates segments gets one segment of
    unrecorded code for the rounds before it.
    """
    kept = [dict(s) for s in previous or ()
            if isinstance(s, Mapping) and isinstance(s.get("first-round"), int)
            and s["first-round"] <= resumed_after]
    if resumed_after > 0 and not kept:
        kept = [{"first-round": 1, "code": None, "software": None, "machine": None}]
    return [*kept, dict(current)]


def code_changes(segments: Sequence[Mapping[str, Any]] | None) -> list[int]:
    """The first rounds of the segments whose code differs from the segment before
    (an unrecorded code counts as different from a recorded one)."""
    changed = []
    for before, after in zip(segments or (), list(segments or ())[1:], strict=False):
        if code_id(before.get("code")) != code_id(after.get("code")):
            changed.append(int(after.get("first-round", 0)))
    return changed


def run_code_ids(config: Mapping[str, Any] | None) -> list[str | None]:
    """The code identities of a run's segments, in order (from its ``config.json``);
    ``[None]`` for a run that recorded none."""
    if not isinstance(config, Mapping):
        return [None]
    segments = config.get("segments")
    if isinstance(segments, list) and segments:
        return [code_id(s.get("code")) if isinstance(s, Mapping) else None
                for s in segments]
    return [code_id(config.get("code"))]


def provenance(previous_config: Mapping[str, Any] | None, resumed_after: int,
               device: str) -> tuple[dict[str, Any], str | None]:
    """What ``config.json`` records of this start of a run (``code``, ``software``,
    ``machine``, ``segments``), and a warning line when it resumes under other code
    than its last segment's (``None`` otherwise).

    ``previous_config``: the run folder's ``config.json`` before this start (read only
    when resuming: a new run has no earlier segments).
    """
    current = segment(resumed_after + 1, device)
    previous = (previous_config or {}).get("segments") if resumed_after else None
    segments = run_segments(previous if isinstance(previous, list) else None,
                            resumed_after, current)
    warning = None
    if len(segments) > 1 and code_id(segments[-2].get("code")) != code_id(current["code"]):
        warning = (f"this run resumes after round {resumed_after} under other code than "
                   f"it ran before ({describe_code(segments[-2].get('code'))} -> "
                   f"{describe_code(current['code'])}); config.json records both segments")
    record = {"code": current["code"], "software": current["software"],
              "machine": current["machine"], "segments": segments}
    return record, warning
