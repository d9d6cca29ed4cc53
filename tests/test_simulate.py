"""The launch helpers (fedspc_app.launch) and the command lines built on them: process
hygiene, the environment of launched processes, error reports."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedspc_app import simulate
from fedspc_app.core.errors import ConfigError
from fedspc_app.launch import cli, superlink
from fedspc_app.launch.processes import (
    LaunchFailed,
    OwnedProcess,
    child_env,
    exit_on_termination,
    owned_processes,
    start_time,
)
from fedspc_app.launch.superlink import LocalSuperLink
from fedspc_app.runs.pause import RunPaused

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import signal, subprocess, sys, time
    from fedspc_app.launch.processes import exit_on_termination

    # the dispositions a plain shell gives, whatever this test was started with
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[2] == "nohup" else signal.SIG_DFL)

    def work():
        # stands in for the SuperLink: its own session, so the signal misses it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            print(child.pid, flush=True)  # inside try: the signal comes after this line
            time.sleep(600)
        finally:
            child.kill()
            child.wait()
            print("stopped the child", flush=True)

    if sys.argv[1] == "guarded":
        with exit_on_termination():
            work()
    else:
        work()
""")


def _start(tmp_path: Path, mode: str, hup: str = "default") -> tuple[subprocess.Popen, int]:
    """The child script running (``guarded`` or ``bare``) and its detached grandchild's PID."""
    process = _python(tmp_path, CHILD, mode, hup)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _python(tmp_path: Path, source: str, *args: str) -> subprocess.Popen:
    """``source`` run as a script of its own, importing this checkout, stdout piped."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def _terminate(tmp_path: Path, mode: str, sig: int) -> tuple[int, str, int]:
    process, child = _start(tmp_path, mode)
    process.send_signal(sig)
    out, _ = process.communicate(timeout=60)
    return process.returncode, out, child


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_termination_signals_run_cleanup_that_stops_detached_processes(tmp_path, sig):
    code, out, child = _terminate(tmp_path, "guarded", sig)
    assert code == 128 + sig
    assert "stopped the child" in out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_without_the_guard_sigterm_skips_cleanup(tmp_path):
    # Why the guard exists: Python's default SIGTERM ends the process at once.
    code, out, child = _terminate(tmp_path, "bare", signal.SIGTERM)
    try:
        assert code == -signal.SIGTERM
        assert "stopped the child" not in out
        os.kill(child, 0)  # still alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_an_ignored_sighup_stays_ignored(tmp_path):
    # Started under nohup: SIGHUP must not end the run; SIGTERM still cleans up.
    process, child = _start(tmp_path, "guarded", "nohup")
    process.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=2)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM and "stopped the child" in out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_handlers_are_restored_after_the_block():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    with exit_on_termination():
        assert signal.getsignal(signal.SIGTERM) not in before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


# --- stand-ins for flower-superlink and flwr -----------------------------------------

STANDIN = textwrap.dedent("""
    import http.server, os, subprocess, sys, time, tomllib

    SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
    mode = os.environ.get("STANDIN", "serve")
    if "--run-config" in sys.argv:  # as flwr run
        config_path = sys.argv[sys.argv.index("--run-config") + 1]
        with open(config_path, "rb") as handle:
            mode = tomllib.load(handle)["mode"]
        print("config", config_path, flush=True)
        print("home", os.environ["FLWR_HOME"],
              os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"], flush=True)
    print("path", os.environ["PATH"], flush=True)
    if mode == "crash":
        for number in range(40):
            print("line", number)
        sys.exit(3)
    # A child in a process group of its own and, below it, a process in a new session
    # (os.setsid, as the SuperLink starts its SuperExec): neither is in this group.
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; print(subprocess.Popen("
         f"{SLEEP!r}, start_new_session=True).pid, flush=True); time.sleep(600)"],
        process_group=0, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    print("pids", os.getpid(), child.pid, child.stdout.readline().strip(), flush=True)
    if mode == "serve":  # as the SuperLink: /health on --port
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

        port = int(sys.argv[sys.argv.index("--port") + 1])
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    time.sleep(600)
""")


def _standin(tmp_path: Path) -> Path:
    (tmp_path / "standin.py").write_text(STANDIN)
    script = tmp_path / "standin"  # a shell wrapper: no limit on the interpreter path's length
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "standin.py"}" "$@"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """Every console script the launchers start is the stand-in; PATH lacks this venv."""
    script = _standin(tmp_path)
    monkeypatch.setattr(superlink, "console_script", lambda name: str(script))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    return script


def _gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` has exited (a zombie left for an init that never reaps counts)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _line(log: Path, key: str, within: float = 30.0) -> list[str]:
    """The words after ``key`` on its line of ``log``, once that line is there."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith(key + " "):
                return line.split()[1:]
        time.sleep(0.05)
    raise AssertionError(f"no {key} line in {log}")


_started: dict[int, str | None] = {}  # what the stand-ins started: PID -> start time


def _pids(log: Path) -> list[int]:
    """The PIDs a stand-in logged (root, child, grandchild); killed after the test."""
    pids = [int(pid) for pid in _line(log, "pids")]
    _started.update({pid: start_time(pid) for pid in pids})
    return pids


@pytest.fixture(autouse=True)
def _no_leftovers():
    """A failed test leaves none of its stand-ins' processes running."""
    yield
    for pid, started in _started.items():
        if started is not None and start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)
    _started.clear()


# --- stopping a process with everything it started ----------------------------------

def test_stopping_an_owned_process_ends_its_group_and_other_sessions(tmp_path, standin):
    process = OwnedProcess([standin], env={**os.environ, "STANDIN": "sleep"},
                           log_file=tmp_path / "tree.log").start()
    pids = _pids(tmp_path / "tree.log")
    assert len({os.getpgid(pid) for pid in pids}) == 3
    assert os.getsid(pids[2]) == pids[2] != os.getsid(pids[0])
    process.stop(timeout=5)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid, 0)]


def test_a_process_group_kill_misses_them(tmp_path, standin):
    # Why stop_tree walks the tree and the session: killpg reaches the root only.
    process = OwnedProcess([standin], env={**os.environ, "STANDIN": "sleep"},
                           log_file=tmp_path / "tree.log").start()
    pids = _pids(tmp_path / "tree.log")
    os.killpg(process.pid, signal.SIGKILL)
    process.process.wait()
    assert not any(_gone(pid, 0.5) for pid in pids[1:])
    assert set(owned_processes(process.pid, with_root=False)) == set(pids[1:])


def test_local_superlink_stops_everything_it_started(tmp_path, standin):
    link = LocalSuperLink(tmp_path / "home", startup_timeout=30).start()
    assert link.process is not None and link.process.poll() is None
    pids = _pids(link.log_file)
    link.stop()
    assert link.process is None
    assert all(_gone(pid) for pid in pids)


def test_local_superlink_is_seen_up_with_a_proxy_in_the_environment(tmp_path, standin,
                                                                    monkeypatch):
    # A proxy cannot reach this machine's loopback: the health check goes direct.
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    link = LocalSuperLink(tmp_path / "home", startup_timeout=10).start()
    pids = _pids(link.log_file)
    link.stop()
    assert all(_gone(pid) for pid in pids)


# --- the environment of launched processes ---------------------------------------------

BIN = str(Path(sys.executable).parent)


def test_children_get_this_interpreters_bin_folder_first_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = superlink.flower_env(tmp_path)
    assert env["PATH"] == f"{BIN}{os.pathsep}/usr/bin:/bin"
    assert child_env(env) == env  # once is enough
    assert env["FLWR_HOME"] == str(tmp_path)
    assert child_env({})["PATH"] == BIN


# --- launch failures quote the log ---------------------------------------------------

def test_a_superlink_that_exits_is_reported_with_the_tail_of_its_log(standin, monkeypatch):
    monkeypatch.setenv("STANDIN", "crash")
    with pytest.raises(LaunchFailed) as caught, superlink.simulation():
        pass
    # simulation() has deleted the temporary FLWR_HOME with the log: the message holds it
    message = str(caught.value)
    assert message.startswith("flower-superlink exited with code 3; last lines of ")
    assert message.splitlines()[-30:] == [f"line {n}" for n in range(10, 40)]


def test_a_superlink_that_never_answers_is_stopped_and_reported(tmp_path, standin,
                                                                 monkeypatch):
    monkeypatch.setenv("STANDIN", "sleep")
    link = LocalSuperLink(tmp_path, startup_timeout=3)
    with pytest.raises(LaunchFailed, match="did not start within 3 s") as caught:
        link.start()
    assert f"path {BIN}:/usr/bin:/bin" in str(caught.value)
    assert all(_gone(pid) for pid in _pids(tmp_path / "superlink.log"))


@pytest.mark.e2e
def test_a_real_superlink_starts_when_path_lacks_this_environment(tmp_path, monkeypatch):
    # flower-superlink starts flower-superexec by name: without this environment's
    # bin folder on its PATH it exits with code 3 at once.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with LocalSuperLink(tmp_path) as link:
        time.sleep(1)
        assert link.process.poll() is None, link.log_file.read_text()[-3000:]


# --- flwr_run and run_logged -----------------------------------------------------------

def test_flwr_run_returns_the_exit_code_logs_output_and_removes_its_config(tmp_path, standin):
    log = tmp_path / "run.log"
    code = superlink.flwr_run(SimpleNamespace(flwr_home=tmp_path / "home"), {"mode": "crash"},
                              clients=2, log_file=log)
    assert code == 3
    # private FLWR_HOME, no runtime installs, this environment's console scripts on PATH
    assert _line(log, "home") == [str(tmp_path / "home"), "1"]
    assert _line(log, "path") == [f"{BIN}:/usr/bin:/bin"]
    assert not Path(_line(log, "config")[0]).exists()


def test_a_failed_run_names_the_server_apps_reason_from_this_runs_log(tmp_path):
    log = tmp_path / "cell.log"
    error = "\x1b[91mERROR \x1b[0m:     Run {}: {}\n"
    log.write_text(error.format("stopped", "an earlier attempt's reason"))
    run_config = {"run-name": "r", "output-dir": str(tmp_path / "out")}

    def refused(_merged):
        with open(log, "a") as handle:
            handle.write("INFO: starting\n" + error.format(
                "not started", "the checkpoint belongs to another run"))
        return 0

    with pytest.raises(superlink.SimulationFailed, match=(
            r"^run 'r' not started: the checkpoint belongs to another run; see .*cell\.log$")):
        superlink.submit_and_check(run_config, refused, log_file=log)
    # Nothing from this attempt in the log: the exit code is all there is to say.
    with pytest.raises(superlink.SimulationFailed,
                       match=r"^run 'r' did not complete \(flwr exit code 0\); see "):
        superlink.submit_and_check(run_config, lambda _merged: 0, log_file=log)


def test_a_run_that_paused_on_request_is_reported_as_paused(tmp_path, monkeypatch, capsys):
    run_config = {"run-name": "r", "output-dir": str(tmp_path / "out"), "num-rounds": 5}

    def paused(_merged):
        summary = {"complete": False, "rounds": 2, "paused-after-round": 2}
        (tmp_path / "out" / "r").mkdir(parents=True)
        (tmp_path / "out" / "r" / "summary.json").write_text(json.dumps(summary))
        return 0

    with pytest.raises(RunPaused, match=r"^run 'r' paused after round 2 of 5$"):
        superlink.submit_and_check(run_config, paused)

    @contextlib.contextmanager
    def no_superlink(_home):
        yield None

    def raise_paused(*_args, **_kwargs):
        raise RunPaused(2, 5, "r")

    monkeypatch.setattr(cli, "simulation", no_superlink)
    monkeypatch.setattr(cli, "run_simulation", raise_paused)
    args = SimpleNamespace(clients=2, client_cpus=1.0, client_gpus=0.0)
    assert cli.simulate_once(run_config, args) == cli.PAUSED == 3
    assert "paused after round 2 of 5; the same command with --resume continues it" in (
        capsys.readouterr().err)

    def raise_stopped_by(*_args, **_kwargs):  # its stop-by has come: say to change it
        raise RunPaused(2, 5, "r", "stop-by 2026-12-05T17:30:00+00:00")

    monkeypatch.setattr(cli, "run_simulation", raise_stopped_by)
    assert cli.simulate_once(run_config, args) == cli.PAUSED
    assert ("(stop-by 2026-12-05T17:30:00+00:00); the same command with --resume and a "
            "later stop-by (or none) continues it") in capsys.readouterr().err


def test_flwr_run_timeout_kills_everything_it_started(tmp_path, standin):
    log = tmp_path / "run.log"
    with pytest.raises(TimeoutError, match="exceeded 2 s"):
        superlink.flwr_run(SimpleNamespace(flwr_home=tmp_path), {"mode": "sleep"}, clients=2,
                           log_file=log, timeout=2)
    assert all(_gone(pid) for pid in _pids(log))


INTERRUPTED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from types import SimpleNamespace
    from fedspc_app.launch import superlink
    from fedspc_app.launch.processes import exit_on_termination

    superlink.console_script = lambda name: sys.argv[1]
    with exit_on_termination():
        superlink.flwr_run(SimpleNamespace(flwr_home=Path(sys.argv[2])), {"mode": "sleep"},
                           clients=2, echo=True)
""")


def test_an_interrupted_flwr_run_is_killed_with_everything_it_started(tmp_path):
    process = _python(tmp_path, INTERRUPTED, str(_standin(tmp_path)), str(tmp_path))
    assert process.stdout is not None
    line = ""
    while not line.startswith("pids "):
        line = process.stdout.readline()
        assert line, "the stand-in flwr printed no pids"
    pids = [int(pid) for pid in line.split()[1:]]
    _started.update({pid: start_time(pid) for pid in pids})
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert all(_gone(pid) for pid in pids)


# --- command-line errors: one line, nothing started ------------------------------------

def _load_script(name: str = "benchmark"):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_benchmark():
    return _load_script("benchmark")


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(LocalSuperLink, "start", refuse)
    monkeypatch.setattr(OwnedProcess, "start", refuse)


BAD_TOML = "num-rounds = [\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--run-config", "missing.toml"], "run-config file missing.toml not found"),
    (["--run-config", "bad.toml"], "cannot read run-config file bad.toml"),
    (["--set", "num-rounds"], "space-separated key=value pairs"),
    (["--set", "methd='fedrep'"], "unknown run-config key 'methd' (did you mean: method?)"),
    (["--set", "num-rounds=0"], "num-rounds"),
    (["--set", "output-dir='~nosuchuser-fedspc/results'"],
     "run-config 'output-dir' = '~nosuchuser-fedspc/results': cannot expand '~'"),
    (["--set", "data-dir='~nosuchuser-fedspc'"], "run-config 'data-dir'"),
    (["--clients", "0"], "clients must be >= 1, got 0"),
    (["--client-cpus", "0"], "client-cpus must be > 0, got 0"),
    (["--client-cpus", "nan"], "client-cpus must be > 0, got nan"),
    (["--client-gpus", "-0.5"], "client-gpus must be >= 0, got -0.5"),
])
def test_simulate_reports_bad_input_in_one_line(tmp_path, monkeypatch, capsys, nothing_starts,
                                                args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    assert simulate.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedspc: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize(("main", "args", "message"), [
    ("benchmark", ["--rounds", "0"], "num-rounds"),
    ("benchmark", ["--client-gpus", "inf"], "client-gpus must be >= 0, got inf"),
    ("benchmark", ["--run-config", "bad.toml"], "cannot read run-config file"),
    ("benchmark", ["--compare", "--plain-workers", "0"], "plain-workers must be >= 1, got 0"),
    ("benchmark", ["--plain-workers", "2"], "a baseline of --compare"),
    ("benchmark", ["--cpu-account", "--account-interval", "0"], "account-interval must be > 0"),
    ("benchmark", ["--compare", "--parallel-only"], "--parallel-only keeps the --plain-workers"),
    ("loopback", ["--nodes", "0"], "clients must be >= 1, got 0"),
    ("loopback", ["--run-config", "bad.toml"], "cannot read run-config file"),
    ("loopback", ["--set", "alpha=-1"], "alpha"),
    ("submit", ["--clients", "2", "--run-config", "bad.toml"], "cannot read run-config file"),
    ("submit", ["--set", "num-rounds=2"], "--clients N"),
    ("worker_overhead", ["--modes", "thread"], "--modes: choose from process, ray"),
    ("worker_overhead", ["--calls", "1"], "--calls >= 2"),
    ("worker_overhead", ["--client", "10"], "--client must be in [0, 10)"),
    ("worker_overhead", ["--run-config", "bad.toml"], "cannot read run-config file"),
])
def test_the_other_launchers_report_bad_input_in_one_line(tmp_path, monkeypatch, capsys,
                                                          nothing_starts, main, args, message):
    from deploy import loopback, submit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("flwr was started"))
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    entry = {"benchmark": lambda: _load_benchmark().main, "loopback": lambda: loopback.main,
             "submit": lambda: submit.main,
             "worker_overhead": lambda: _load_script("worker_overhead").main}[main]()
    assert entry(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedspc: ") and err.count("\n") == 1 and message in err


def test_worker_overhead_times_the_same_client_in_plain_processes(capsys, monkeypatch):
    # The Ray mode needs Ray's processes (the end-to-end tests cover them); the
    # process mode runs the same Trainer, which the Ray actors wrap. Spawned workers
    # import the script by name, as they do when it runs as a program.
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    script = importlib.import_module("worker_overhead")
    assert script.main(["--set", "dataset='digits' model='cnn' local-epochs=1",
                        "--modes", "process", "--calls", "2", "--workers", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("process ") and "images/s per worker" in line
    assert "first calls" in line and line.count(",") >= 1  # one first call per worker
    assert script.summary([[(9.0, 100), (2.0, 100)], [(8.0, 50), (1.0, 50)]]) == (1.5, 50.0)


def test_simulated_clients_follow_num_clients_and_a_mismatch_is_refused():
    # Every simulated client refuses a run whose num-clients is not the SuperNodes'
    # number: --clients defaults to num-clients, and a contradiction is refused up front.
    parser = argparse.ArgumentParser()
    cli.add_run_config_arguments(parser)
    cli.add_resource_arguments(parser)
    for argv, clients in ((["--set", "num-clients=3"], 3), ([], 10),
                          (["--clients", "4"], 4), (["--clients", "3", "--set", "num-clients=3"], 3)):
        args = parser.parse_args(argv)
        cli.simulation_overrides(args)
        assert args.clients == clients, argv
    with pytest.raises(ConfigError, match="num-clients=3 but the simulation has 4 clients"):
        cli.simulation_overrides(parser.parse_args(["--clients", "4", "--set", "num-clients=3"]))
    with pytest.raises(ConfigError, match="num-clients=3 but the simulation has 2 clients"):
        superlink.run_simulation({"num-clients": 3}, superlink=None, clients=2)


def test_children_reach_a_loopback_grpc_server_with_a_proxy_in_the_environment(tmp_path):
    # gRPC sends even a call to 127.0.0.1 through $http_proxy / $https_proxy; Flower's
    # processes talk over the loopback, so child_env keeps it out of any proxy.
    grpc = pytest.importorskip("grpc")
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    probe = ("import grpc, sys; channel = grpc.insecure_channel(sys.argv[1]); "
             "grpc.channel_ready_future(channel).result(timeout=5)")
    proxied = {**os.environ, "http_proxy": "http://127.0.0.1:9",
               "https_proxy": "http://127.0.0.1:9", "no_proxy": "example.org", "NO_PROXY": ""}
    try:
        for env, ok in ((proxied, False), (child_env(proxied), True)):
            done = subprocess.run([sys.executable, "-c", probe, f"127.0.0.1:{port}"], env=env,
                                  check=False,
                                  capture_output=True, timeout=60)
            assert (done.returncode == 0) is ok, done.stderr[-500:]
    finally:
        server.stop(None)
    env = child_env(proxied)
    assert env["no_proxy"] == "example.org,127.0.0.1,localhost,::1"
    assert env["NO_PROXY"] == "127.0.0.1,localhost,::1"
    assert child_env(env) == env  # once is enough


def test_set_given_twice_applies_both_the_later_winning():
    parser = argparse.ArgumentParser()
    cli.add_run_config_arguments(parser)
    cli.add_resource_arguments(parser)
    args = parser.parse_args(["--set", "num-rounds=3 output-dir='out'", "--set",
                              "fedspc=true num-rounds=4"])
    assert cli.simulation_overrides(args) == {"num-rounds": 4, "output-dir": "out",
                                              "fedspc": True}
    assert parser.parse_args([]).set == ""


def test_simulate_reports_a_failed_launch_with_exit_code_1(standin, monkeypatch, capsys):
    monkeypatch.setenv("STANDIN", "crash")
    assert simulate.main(["--clients", "2", "--set", "num-rounds=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedspc: flower-superlink exited with code 3") and "line 39" in err
