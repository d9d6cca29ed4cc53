"""The documentation agrees with the code: README.md and docs/*.md (not the result
texts under docs/results/).

* every ``python -m <module>`` and ``python scripts/<x>.py`` command in a code block
  (and ``deploy/run.sh``, which hands its arguments to ``deploy.submit``) parses: its
  module runs up to its argument parser's ``parse_args`` and stops there, so nothing
  is executed;
* every run-config key shown (``--set`` and ``--run-config`` values, TOML presets
  named there, TOML and grid YAML snippets, inline ``key = value``, the tables of
  docs/configuration.md) is a key of :class:`~fedspc_app.core.config.RunConfig` or an
  ``x-`` key, and the configuration table lists every key;
* every relative link resolves to a file, and its anchor to a heading or an
  ``<a id>`` there;
* every folder under ``results/`` named in an example has the shape runs get: a
  single run's folder is named ``<dataset>-<model>-<method>[+fedspc]-a<alpha>-s<seed>``
  (or its given ``run-name``), a grid's cells ``<method>[+fedspc]-a<alpha>-...`` lie
  inside the grid's folder, and a file named inside either is one a run or a grid
  writes; repository paths named in code (``conf/``, ``docs/results/``) exist;
* docs/extending.md's code layout has a line for every module and shell script of
  fedspc_app/, strategies/, clients/, deploy/ and scripts/ (``__init__.py`` files are
  their package's line), and no line for a file that does not exist.

A failure names the page and line, as ``README.md:87``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import sys
import tomllib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from unittest import mock

import pytest
import yaml

from fedspc_app.core.config import DATASETS, RunConfig
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import METHODS
from fedspc_app.data.partition_files import PARTITION_CSV, PARTITION_JSON
from fedspc_app.experiments.grid import expand_grid
from fedspc_app.experiments.layout import FAILURES_JSON, GRID_JSON, LOGS_DIR, REPORT_DIR
from fedspc_app.launch.runconfig import parse_assignments
from fedspc_app.runs.pause import PAUSE_REQUEST
from fedspc_app.runs.results import (
    CONFIG_JSON,
    METRICS_CSV,
    METRICS_JSON,
    SCALAR_COLUMNS,
    SUMMARY_JSON,
)
from fedspc_app.runs.runfolder import CHECKPOINT_JSON

ROOT = Path(__file__).resolve().parent.parent
README = "README.md"
PAGES = [README, *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
RUN_CONFIG_KEYS = frozenset(RunConfig().to_dict())
PROJECT_PACKAGES = ("fedspc_app", "strategies", "clients", "deploy")


def known_breaks(page: str) -> str:
    """How a failure on ``page`` is reported (README.md is rewritten as a whole, so
    its breaks are listed, not patched)."""
    return f"{page} (fix the README text)" if page == README else page


# --------------------------------------------------------------------- reading pages
@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    text: str


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` (indented fences too, as in list items)."""
    found, lines = [], (ROOT / page).read_text(encoding="utf-8").splitlines()
    start = lang = None
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        fence = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence and start is None:
            start, lang, body = number, fence.group(2).lower(), []
        elif fence and start is not None:
            indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
            found.append(Block(page, start, lang, "\n".join(b[indent:] for b in body)))
            start = None
        elif start is not None:
            body.append(line)
    return found


def prose(page: str) -> list[tuple[int, str]]:
    """``page``'s lines outside code blocks (fences blanked), numbered."""
    out, inside = [], False
    for number, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
        if re.match(r"\s*(```|~~~)", line):
            inside = not inside
            continue
        if not inside:
            out.append((number, line))
    return out


def inline_code(page: str) -> Iterator[tuple[int, str]]:
    for number, line in prose(page):
        for match in re.finditer(r"(`+)(.+?)\1", line):
            yield number, match.group(2).strip()


def shell_lines(block: Block) -> Iterator[tuple[int, str]]:
    """The block's lines with ``\\`` continuations joined, each with its first line."""
    pending, first = "", None
    for offset, line in enumerate(block.text.splitlines(), 1):
        if first is None:
            first = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield first, pending + line
        pending, first = "", None
    if pending:
        yield first, pending


def commands(block: Block) -> Iterator[tuple[int, list[str], str]]:
    """Each shell command of a bash/sh/text block as words (prompt, comments and
    leading ``VAR=value`` dropped; ``&&``, ``||``, ``;`` and ``|`` split), with the
    line as written (continuations joined)."""
    if block.lang not in ("", "bash", "sh", "shell", "console", "text"):
        return
    for line_number, line in shell_lines(block):
        line = re.sub(r"^\s*\$\s+", "", line)
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
        except ValueError:  # not shell (an output line with a quote)
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word and set(word) <= set(";&|"):
                while command and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                    command.pop(0)
                if command:
                    yield line_number, command, " ".join(line.split())
                command = []
            else:
                command.append(word)


def all_commands() -> list[tuple[str, int, list[str], str]]:
    return [(block.page, number, words, text) for page in PAGES for block in blocks(page)
            for number, words, text in commands(block)]


# ------------------------------------------------------------------ commands parse
class _Parsed(Exception):
    pass


def project_cli(words: list[str]) -> tuple[str, str, list[str]] | None:
    """("module" or "path", target, arguments) of a command that runs the project's
    code, or None."""
    if words[0] in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        if words[2].split(".")[0] in PROJECT_PACKAGES:
            return "module", words[2], words[3:]
    elif words[0] in ("python", "python3") and len(words) > 1 and \
            words[1].startswith("scripts/"):
        return "path", words[1], words[2:]
    elif words[0] in ("deploy/run.sh", "./deploy/run.sh"):
        return "module", "deploy.submit", words[1:]
    return None


def dry_parse(kind: str, target: str, arguments: list[str]) -> str | None:
    """Run ``target`` up to its ``parse_args``: None when the arguments parse (or ask
    for ``--help``), else argparse's message. Nothing after the parse runs."""
    if kind == "path":
        source = ROOT / target
    else:
        spec = importlib.util.find_spec(target)
        if spec is None or spec.origin is None:
            return f"no module {target}"
        source = Path(spec.origin)
        if spec.submodule_search_locations:  # a package runs its __main__
            source = source.with_name("__main__.py")
    if not source.is_file():
        return f"no script {target}" if kind == "path" else f"{target} cannot be run with -m"
    if source.name != "__main__.py" and "parse_args(" not in source.read_text():
        # Without an argparse parse to stop at, running it would do its work.
        return f"{source.relative_to(ROOT)} has no argparse parser to check the arguments with"
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    errors = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(sys, "argv", [target, *arguments]), \
            contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / target), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as stop:
            if stop.code in (0, None):
                return None
            return " ".join(errors.getvalue().split()[-30:]) or f"exit {stop.code}"
        except ImportError as error:
            return f"cannot import {target}: {error}"
    raise AssertionError(f"{target} finished without calling parse_args")


def test_every_documented_command_parses():
    failures, checked = [], 0
    for page, line, words, text in all_commands():
        cli = project_cli(words)
        if cli is None:
            continue
        checked += 1
        problem = dry_parse(*cli)
        if problem:
            failures.append(f"{known_breaks(page)}:{line}: {text}\n    {problem}")
    assert checked >= 20, f"only {checked} commands found: is the extraction broken?"
    assert not failures, "commands that do not parse:\n" + "\n".join(failures)


# ------------------------------------------------------------------ run-config keys
def unknown_keys(keys) -> list[str]:
    return sorted(k for k in keys if k not in RUN_CONFIG_KEYS and not k.startswith("x-"))


def option_values(words: list[str], option: str) -> list[str]:
    values = []
    for i, word in enumerate(words):
        if word == option and i + 1 < len(words):
            values.append(words[i + 1])
        elif word.startswith(option + "="):
            values.append(word.split("=", 1)[1])
    return values


def command_key_problems(words: list[str]) -> list[str]:
    problems = []
    for value in option_values(words, "--set") + option_values(words, "--run-config"):
        if value.endswith(".toml"):
            preset = ROOT / value
            if not preset.is_file():
                problems.append(f"no preset {value}")
                continue
            keys = tomllib.loads(preset.read_text())
        else:
            try:
                keys = parse_assignments(value)
            except ConfigError as error:
                problems.append(str(error))
                continue
        if unknown := unknown_keys(keys):
            problems.append(f"not run-config keys: {unknown}")
    return problems


def test_every_run_config_key_in_a_command_exists():
    failures, checked = [], 0
    for page, line, words, text in all_commands():
        if "--set" in words or "--run-config" in words:
            checked += 1
        failures += [f"{known_breaks(page)}:{line}: {text}\n    {problem}"
                     for problem in command_key_problems(words)]
    assert checked >= 10, f"only {checked} commands with run-config values found"
    assert not failures, "\n".join(failures)


def snippet_key_problems(block: Block) -> list[str]:
    """A TOML snippet's keys (a run-config preset, or pyproject's app config table),
    or a grid file's run-config keys, checked by the grid's own expansion."""
    if block.lang == "toml":
        data = tomllib.loads(block.text)
        if "tool" in data:
            data = data["tool"].get("flwr", {}).get("app", {}).get("config", {})
        scalars = {k for k, v in data.items() if not isinstance(v, dict)}
        return [f"not run-config keys: {bad}"] if (bad := unknown_keys(scalars)) else []
    if block.lang in ("yaml", "yml"):
        spec = yaml.safe_load(block.text)
        if isinstance(spec, dict) and "axes" in spec:
            try:
                expand_grid(spec, name="docs", base_dir=ROOT, output_dir="results")
            except ConfigError as error:
                return [f"the grid does not expand: {error}"]
    return []


def test_every_run_config_key_in_a_snippet_exists():
    failures, checked = [], 0
    for page in PAGES:
        for block in blocks(page):
            if block.lang in ("toml", "yaml", "yml"):
                checked += 1
                failures += [f"{known_breaks(page)}:{block.line}: {problem}"
                             for problem in snippet_key_problems(block)]
    assert checked >= 3
    assert not failures, "\n".join(failures)


# Inline ``name = value`` that are not run-config settings: a metrics column, Python.
NOT_SETTINGS = set(SCALAR_COLUMNS)


def test_every_inline_setting_names_a_run_config_key():
    failures, checked = [], 0
    for page in PAGES:
        for line, code in inline_code(page):
            match = re.fullmatch(r"([a-z][a-z0-9-]*) = (.+)", code)
            if not match or match.group(2) == "None" or match.group(1) in NOT_SETTINGS:
                continue
            checked += 1
            if unknown_keys([match.group(1)]):
                failures.append(f"{known_breaks(page)}:{line}: `{code}`: "
                                f"{match.group(1)} is not a run-config key")
    assert checked >= 50
    assert not failures, "\n".join(failures)


def configuration_table() -> dict[str, int]:
    """The keys in the first column of docs/configuration.md's tables, with their line."""
    keys = {}
    for line, text in prose("docs/configuration.md"):
        cells = text.split("|")
        if text.startswith("|") and len(cells) > 2 and "`" in cells[1]:
            for key in re.findall(r"`([^`]+)`", cells[1]):
                keys[key] = line
    return keys


def test_the_configuration_table_lists_every_key_and_only_keys():
    table = configuration_table()
    wrong = [f"docs/configuration.md:{line}: `{key}` is not a run-config key"
             for key, line in table.items() if unknown_keys([key])]
    missing = sorted(RUN_CONFIG_KEYS - set(table))
    assert not wrong, "\n".join(wrong)
    assert not missing, f"docs/configuration.md's table omits {missing}"


# ------------------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links as their text, markup and punctuation
    dropped, lower case, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = page.read_text(encoding="utf-8")
    relative = str(page.relative_to(ROOT))
    for _, line in prose(relative):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']", text))
    return found


def links(page: str) -> Iterator[tuple[int, str]]:
    for line, text in prose(page):
        text = re.sub(r"(`+).+?\1", "", text)  # code spans are not links
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
            yield line, target
        ref = re.match(r"\s*\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)", text)
        if ref:
            yield line, ref.group(1)


def link_problem(page: str, target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    if not file.exists():
        return f"no file {path}"
    if anchor and file.suffix == ".md" and file.is_file() and anchor not in anchors(file):
        return f"no heading or <a id> #{anchor} in {file.relative_to(ROOT)}"
    return None


def test_every_relative_link_resolves():
    failures, checked = [], 0
    for page in PAGES:
        for line, target in links(page):
            checked += 1
            if problem := link_problem(page, target):
                failures.append(f"{known_breaks(page)}:{line}: ({target}) {problem}")
    assert checked >= 50
    assert not failures, "broken links:\n" + "\n".join(failures)


# -------------------------------------------------------------------- run folders
# What a run folder holds (fedspc_app/runs/, the partition files, the clients' state
# in a simulation, TensorBoard and W&B, a pause request), and what a grid folder holds
# besides its cells (fedspc_app/experiments/layout.py).
RUN_FILES = (CONFIG_JSON, METRICS_JSON, METRICS_CSV, SUMMARY_JSON, PARTITION_JSON,
             PARTITION_CSV, CHECKPOINT_JSON, "checkpoint-r*.npz", "client-state",
             "tensorboard", "wandb", "wandb-run.json", PAUSE_REQUEST)
GRID_FILES = (GRID_JSON, FAILURES_JSON, LOGS_DIR, REPORT_DIR, PAUSE_REQUEST)
_NUMBER = r"\d+(?:\.\d+)?(?:e-?\d+)?"
_LABEL = r"[\w.]+(?:\+fedspc)?"
# <dataset>-<model>-<label>-a<alpha>|c<S>-s<seed>[-<n>] (RunConfig.resolved_run_name,
# and the next free folder's -2, -3, ... from fedspc_app/runs/runfolder.py)
RUN_NAME = re.compile(rf"(?:{'|'.join(DATASETS)})-[\w.-]+?-{_LABEL}-(?:a{_NUMBER}|c\d+)"
                      rf"-s\d+(?:-\d+)?")
# <method>[+fedspc][-a<alpha>][-s<seed>][-<axis value>...] (experiments/grid.py)
CELL_NAME = re.compile(rf"(?:{'|'.join(map(re.escape, METHODS))}|[\w.]+\+fedspc)"
                       rf"(?:\+fedspc)?(?:-[as]{_NUMBER}|-[\w.=+]+)*")


def is_run_file(name: str) -> bool:
    return any(fnmatch(name, pattern) for pattern in RUN_FILES)


def folder_problem(parts: list[str], run_names: set[str]) -> str | None:
    """What is wrong with ``results/<parts>``, or None."""
    parts = [p for p in parts if p]
    if not parts or any(re.search(r"[<>*{]", p) for p in parts[:2]):
        return None
    first, rest = parts[0], parts[1:]
    if RUN_NAME.fullmatch(first) or first in run_names:  # a single run's folder
        if rest and not is_run_file(rest[0]):
            return f"a run folder holds no {rest[0]}"
        return None
    if CELL_NAME.fullmatch(first):
        return (f"{first} is named like a grid cell, but a cell's folder lies inside its "
                "grid's folder (results/<grid>/<cell>), and a single run's is named "
                "<dataset>-<model>-<method>[+fedspc]-a<alpha>-s<seed>")
    if not rest or rest[0] in GRID_FILES:  # a grid's folder or a report's
        return None
    if CELL_NAME.fullmatch(rest[0]):
        if len(rest) > 1 and not is_run_file(rest[1]):
            return f"a run folder holds no {rest[1]}"
        return None
    return f"{rest[0]} is neither a grid's file nor a cell named like the grid's cells"


RESULTS_PATH = re.compile(r"(?<![\w.~/-])((?:~?/)?(?:[\w.~-]+/)*)results/([\w.+=<>*{},-]+"
                          r"(?:/[\w.+=<>*{},-]*)*)")
PLACEHOLDER_RUN = re.compile(r"<(?:run folder|output-dir>/<run-name)>/([\w.*-]+)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:conf|docs/results)/[\w./+*<>-]+)")


def code_texts(page: str) -> Iterator[tuple[int, str]]:
    """Every code block line and inline code span of ``page``, with its line."""
    for block in blocks(page):
        for offset, line in enumerate(block.text.splitlines(), 1):
            yield block.line + offset, line
    yield from inline_code(page)


def given_run_names(page: str) -> set[str]:
    """``run-name`` values a page sets (a run folder may have any name given)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return set(re.findall(r"run-name\s*=\s*['\"]([^'\"]+)['\"]", text))


def test_every_run_folder_in_an_example_has_the_shape_runs_get():
    failures, checked = [], 0
    for page in PAGES:
        run_names = given_run_names(page)
        for line, text in code_texts(page):
            for match in RESULTS_PATH.finditer(text):
                if match.group(1).endswith("docs/"):
                    continue
                checked += 1
                if problem := folder_problem(match.group(2).split("/"), run_names):
                    failures.append(f"{known_breaks(page)}:{line}: "
                                    f"results/{match.group(2)}: {problem}")
            for match in PLACEHOLDER_RUN.finditer(text):
                checked += 1
                if not is_run_file(match.group(1)):
                    failures.append(f"{known_breaks(page)}:{line}: {match.group(0)}: a run "
                                    f"folder holds no {match.group(1)}")
            for match in REPO_PATH.finditer(text):
                path = match.group(1).rstrip(".,")
                if re.search(r"[<>*{]", path):
                    continue
                checked += 1
                if not (ROOT / path).exists():
                    failures.append(f"{known_breaks(page)}:{line}: no {path} in the repository")
    assert checked >= 20
    assert not failures, "\n".join(failures)


def test_the_folder_shapes_tell_runs_from_cells():
    assert folder_problem(["cifar100-cnn-fedrep+fedspc-a0.1-s0", "summary.json"], set()) is None
    assert folder_problem(["digits-my_models.build_net-fedrep-a0.1-s0-2"], set()) is None
    assert folder_problem(["table3", "fedrep+fedspc-a0.1-s0-C-R34", "config.json"],
                          set()) is None
    assert folder_problem(["table3", "report", "table3.md"], set()) is None
    assert "grid cell" in folder_problem(["fedrep+fedspc-a0.1"], set())
    assert "holds no" in folder_problem(["cifar100-cnn-fedavg-a1-s0", "model.pt"], set())
    assert "neither" in folder_problem(["table3", "cifar100"], set())


# ---------------------------------------------------------------------- code layout
LAYOUT_FOLDERS = ("fedspc_app", "strategies", "clients", "deploy", "scripts")


def layout_entries() -> dict[str, int]:
    """The files docs/extending.md's code layout names, as repository paths, with
    their line: a line is an entry when its name starts before the description column
    (indented two spaces a level); continuation lines start in that column."""
    section = next(b for b in blocks("docs/extending.md")
                   if b.text.startswith("fedspc_app/"))
    entries, folders = {}, []
    for offset, line in enumerate(section.text.splitlines(), 1):
        match = re.match(r"( *)(\S+)", line)
        if not match or len(match.group(1)) >= 20:
            continue
        level = len(match.group(1)) // 2
        names = re.match(r"( *)((?:[\w.-]+/?)(?:, [\w.-]+/?)*)(?:\s|$)", line).group(2)
        folders = folders[:level]
        for name in names.split(", "):
            path = "/".join([*folders, name.rstrip("/")])
            entries[path] = section.line + offset
        if names.endswith("/"):
            folders.append(names.rstrip("/"))
    return entries


def test_the_code_layout_lists_every_module_and_only_files_that_exist():
    entries = layout_entries()
    listed = {path for path in entries if path.endswith((".py", ".sh"))}
    modules = {str(p.relative_to(ROOT)) for folder in LAYOUT_FOLDERS
               for pattern in ("*.py", "*.sh") for p in (ROOT / folder).rglob(pattern)
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    missing = sorted(modules - listed)
    problems = [f"docs/extending.md's code layout omits {path}" for path in missing]
    problems += sorted(f"docs/extending.md:{line}: the code layout names {path}, which "
                       "does not exist" for path, line in entries.items()
                       if not (ROOT / path).exists())
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
