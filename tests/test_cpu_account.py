"""The CPU account of a run (``scripts/benchmark.py --cpu-account``): roles from command
lines, CPU seconds from ``/proc``-like stat lines, in a fake ``/proc`` folder."""

from __future__ import annotations

import json

import pytest

from fedspc_app.launch import cpu_account as ca

VENV = "/venv/lib/python3.11/site-packages"
SESSION = "session_2026-12-06_03-19-51_169795_312"
OTHER_SESSION = "session_2026-12-06_01-00-00_000001_99"

COMMANDS = [
    ([f"{VENV}/ray/core/src/ray/gcs/gcs_server", f"--log_dir=/tmp/ray/{SESSION}/logs"], ca.GCS),
    # raylet's arguments name the scripts it starts: the binary decides.
    ([f"{VENV}/ray/core/src/ray/raylet/raylet", f"--raylet_socket_name=/tmp/ray/{SESSION}/s",
      f"--python_worker_command=/venv/bin/python {VENV}/ray/_private/workers/default_worker.py",
      f"--dashboard_agent_command=/venv/bin/python -u {VENV}/ray/dashboard/agent.py"], ca.RAYLET),
    (["/venv/bin/python", f"{VENV}/ray/dashboard/dashboard.py", "--host=127.0.0.1"], ca.DASHBOARD),
    (["/venv/bin/python", "-u", f"{VENV}/ray/_private/log_monitor.py",
      f"--session-dir=/tmp/ray/{SESSION}"], ca.LOG_MONITOR),
    (["/venv/bin/python", "-u", f"{VENV}/ray/autoscaler/_private/monitor.py"], ca.AUTOSCALER),
    (["/venv/bin/python", "-u", f"{VENV}/ray/dashboard/agent.py"], ca.AGENT),
    (["ray::DashboardAgent"], ca.AGENT),
    (["ray::RuntimeEnvAgent"], ca.RUNTIME_ENV),
    (["/venv/bin/python", "-u", f"{VENV}/ray/_private/runtime_env/agent/main.py"],
     ca.RUNTIME_ENV),
    (["ray::ClientAppActor.run"], ca.WORKER),
    (["ray::ClientAppActor"], ca.WORKER),
    (["ray::IDLE"], ca.WORKER),
    (["/venv/bin/python", "-u", f"{VENV}/ray/_private/workers/setup_worker.py", "--x"],
     ca.WORKER),
    (["/venv/bin/python", f"{VENV}/ray/_private/workers/default_worker.py"], ca.WORKER),
    (["/venv/bin/python", f"{VENV}/ray/_private/something_new.py"], ca.RAY_OTHER),
    (["/venv/bin/python", "/venv/bin/flower-superlink", "--insecure", "--simulation"],
     ca.SUPERLINK),
    (["/venv/bin/python", "/venv/bin/flower-superexec", "--insecure"], ca.SUPEREXEC),
    (["/venv/bin/python", "/venv/bin/flwr-simulation", "--runtime-api-address", "x"],
     ca.SIMULATION),
    (["/venv/bin/flwr-serverapp", "--insecure"], ca.SERVERAPP),
    (["/venv/bin/python", "/venv/bin/flwr", "run", "/app", "fedspc-sim", "--stream"],
     ca.FLWR_RUN),
    (["/venv/bin/python3", "-c", ("from multiprocessing.spawn import spawn_main; "
      "spawn_main(tracker_fd=5, pipe_handle=7)"), "--multiprocessing-fork"], ca.PLAIN_WORKER),
    (["/venv/bin/python", "-c", "from multiprocessing.resource_tracker import main;main(4)"],
     ca.TRACKER),
    (["/venv/bin/python", "-X", "importtime", "-m", "fedspc_app.experiments", "run"], ca.OTHER),
    (["bash", "-c", "exec /venv/bin/python default_worker.py"], ca.OTHER),
    ([], ca.OTHER),
]


@pytest.mark.parametrize(("argv", "role"), COMMANDS, ids=lambda v: str(v)[:60])
def test_a_process_role_comes_from_its_command_line(argv, role):
    assert ca.role_of(argv) == role


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int = 0, *, threads: int = 1,
              start: int = 1000, rss: int = 256, state: str = "S") -> str:
    fields = [state, ppid, pid, pid, 0, -1, 0, 0, 0, 0, 0, utime, stime, 0, 0, 20, 0, threads,
              0, start, 0, rss] + [0] * 30
    return f"{pid} ({comm}) " + " ".join(str(f) for f in fields)


def test_a_stat_line_gives_cpu_ticks_threads_and_start():
    stat = ca.parse_stat(stat_line(7, "ray::Client (App)", 3, 120, 30, threads=22, start=555,
                                   rss=10))
    assert stat == ca.Stat(comm="ray::Client (App)", state="S", ppid=3, ticks=150, threads=22,
                           start=555, rss_pages=10)
    assert ca.parse_stat(stat_line(7, "x", 3, 1, state="Z")) is None  # a zombie
    assert ca.parse_stat("garbage") is None
    assert ca.parse_machine("cpu  10 1 5 100 4 2 3 1 0 0\ncpu0 1 2 3 4\n") == (22, 126)


class FakeProc:
    """A /proc folder: per process stat, cmdline, status, schedstat, environ, maps and
    its threads' stat; and the machine's stat."""

    def __init__(self, root):
        self.root = root

    def process(self, pid, argv, ppid, ticks, *, comm=None, start=1000, threads=None,
                env=None, maps="", on_cpu=0, waiting=0):
        folder = self.root / str(pid)
        (folder / "task").mkdir(parents=True, exist_ok=True)
        comm = comm or (argv[0].rsplit("/", 1)[-1][:15] if argv else "x")
        threads = threads or {pid: ticks}
        (folder / "stat").write_text(stat_line(pid, comm, ppid, ticks, threads=len(threads),
                                               start=start))
        (folder / "cmdline").write_text("\0".join(argv) + "\0")
        (folder / "status").write_text("Name:\tx\nvoluntary_ctxt_switches:\t5\n"
                                       "nonvoluntary_ctxt_switches:\t9\n"
                                       "Cpus_allowed_list:\t0-1\n")
        (folder / "schedstat").write_text(f"{on_cpu} {waiting} 3\n")
        (folder / "environ").write_text("".join(f"{k}={v}\0" for k, v in (env or {}).items()))
        (folder / "maps").write_text(maps)
        for tid, tid_ticks in threads.items():
            (folder / "task" / str(tid)).mkdir(exist_ok=True)
            name = comm if tid == pid else f"worker.io{tid}"[:15]
            (folder / "task" / str(tid) / "stat").write_text(
                stat_line(tid, name, ppid, tid_ticks, start=start))

    def gone(self, pid):
        for path in sorted((self.root / str(pid)).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (self.root / str(pid)).rmdir()

    def machine(self, busy, idle):
        (self.root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\n")


def seconds(value: float) -> int:
    """CPU seconds as clock ticks."""
    return round(value * ca.TICKS)


def test_the_account_attributes_cpu_seconds_to_roles(tmp_path):
    proc = FakeProc(tmp_path)
    py = "/venv/bin/python"
    worker_env = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "MKL_NUM_THREADS": "1"}

    def tree(t, worker=True):
        """The run at time t: the root, the SuperLink, the simulation process, Ray's
        raylet and GCS (the GCS re-parented to init, found by its session), a worker
        started after the first sample, and a process of another Ray session."""
        proc.process(100, [py, "scripts/benchmark.py"], 1, seconds(1 + 0.1 * t))
        proc.process(101, [py, "/venv/bin/flower-superlink", "--simulation"], 100,
                     seconds(2 + 0.05 * t))
        proc.process(102, [py, "/venv/bin/flwr-simulation"], 101, seconds(3 + 0.2 * t),
                     threads={102: seconds(3 + 0.15 * t), 110: seconds(0.05 * t)})
        proc.process(103, [f"{VENV}/ray/raylet/raylet", f"--session_dir=/tmp/ray/{SESSION}"],
                     102, seconds(0.5 + 0.02 * t))
        proc.process(104, [f"{VENV}/ray/gcs/gcs_server", f"--log_dir=/tmp/ray/{SESSION}/logs"],
                     1, seconds(0.2 + 0.01 * t))
        proc.process(300, [f"{VENV}/ray/gcs/gcs_server", f"--log_dir=/tmp/ray/{OTHER_SESSION}"],
                     1, seconds(50 + 0.5 * t))
        if worker and t >= 1:  # the worker starts between the samples at t = 0 and t = 1
            proc.process(105, ["ray::ClientAppActor.run"], 103, seconds(0.9 * (t - 0.5)),
                         start=2000, env=worker_env, maps=f"7f00 r-xp {VENV}/libgomp.so.1\n",
                         threads={105: seconds(0.85 * (t - 0.5)), 106: seconds(0.05 * (t - 0.5))},
                         on_cpu=int(0.85e9 * (t - 0.5)), waiting=int(0.1e9 * (t - 0.5)))
        proc.machine(busy=seconds(2 * t), idle=seconds(0))

    account = ca.CpuAccount(root=100, proc=tmp_path, scan_every=1, threads_every=1)
    for t in range(5):
        tree(t)
        account.sample(now=1000.0 + t)
    proc.gone(105)  # the worker exits: its CPU up to its last sample stays counted
    tree(5, worker=False)
    account.sample(now=1005.0)

    roles = {p.pid: p.role for p in account.processes.values()}
    assert roles == {100: ca.ROOT, 101: ca.SUPERLINK, 102: ca.SIMULATION, 103: ca.RAYLET,
                     104: ca.GCS, 105: ca.WORKER}  # not the other session's GCS (300)

    # Rounds 1-3 end at t = 2, 3, 4; round 1 took 2 s, the others 1 s, half of it training.
    rows = [{"round": 1, "round-seconds": 2.0, "train-seconds": 1.0},
            {"round": 2, "round-seconds": 1.0, "train-seconds": 0.5},
            {"round": 3, "round-seconds": 1.0, "train-seconds": 0.5}]
    summary = ca.summarize(account, rows, {1: 1002.0, 2: 1003.0, 3: 1004.0})
    by_role = {row["role"]: row for row in summary["roles"]}
    assert by_role[ca.SIMULATION]["cpu-seconds"] == pytest.approx(1.0)  # 0.2/s over 5 s
    assert by_role[ca.SIMULATION]["steady-cpu-seconds-per-round"] == pytest.approx(0.2)
    assert by_role[ca.SIMULATION]["train-cpu-seconds-per-round"] == pytest.approx(0.1)
    # The worker counts from zero at the sample before it was seen: 0.9/s from t = 0.5,
    # sampled until t = 4 (3.15 s), linear from 0 at t = 0 to 0.45 s at t = 1.
    assert by_role[ca.WORKER]["cpu-seconds"] == pytest.approx(3.15)
    assert by_role[ca.WORKER]["steady-cores"] == pytest.approx(0.9)
    assert by_role[ca.GCS]["cpu-seconds"] == pytest.approx(0.05)
    assert summary["cpu-seconds"] == pytest.approx(sum(r["cpu-seconds"] for r in summary["roles"]),
                                                   abs=0.02)
    assert sum(r["share"] for r in summary["roles"]) == pytest.approx(1.0, abs=0.01)
    assert by_role[ca.SIMULATION]["max-threads"] == 2
    assert by_role[ca.WORKER]["nonvoluntary-switches"] == 9

    # The machine was busy 2 cores in the steady rounds (4 CPU s), the run 1.38 CPU s a
    # second of it (0.1 + 0.05 + 0.2 + 0.02 + 0.01 + 0.9 + ...); the rest is outside.
    machine = summary["machine"]
    assert machine["steady-busy-cpu-seconds"] == pytest.approx(4.0)
    assert machine["steady-run-cpu-seconds"] == pytest.approx(2 * 1.28)
    assert machine["steady-outside-run-cpu-seconds"] == pytest.approx(4.0 - 2 * 1.28)

    [worker] = summary["workers"]
    assert worker["train-cpu-seconds"] == pytest.approx(0.9)  # 2 phases of 0.5 s
    assert worker["cores"] == pytest.approx(0.9)
    assert worker["main-thread-on-cpu"] == pytest.approx(0.85)
    assert worker["main-thread-waiting-for-cpu"] == pytest.approx(0.1)
    assert worker["main-thread-asleep"] == pytest.approx(0.05)
    assert worker["env"] == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert worker["openmp"] == ["libgomp.so.1"] and worker["cpus-allowed"] == "0-1"
    assert worker["threads"] == 2 and worker["busy-threads"] == 1

    threads = {(row["role"], row["thread"]): row["cpu-seconds"] for row in summary["threads"]}
    assert threads[(ca.WORKER, "ray::ClientAppA (main)")] == pytest.approx(0.85 * 3.5, abs=0.01)
    assert threads[(ca.SIMULATION, "python (main)")] == pytest.approx(0.15 * 5, abs=0.01)
    steady = {(row["role"], row["thread"]): row["steady-cpu-seconds-per-round"]
              for row in summary["threads"]}
    assert steady[(ca.SIMULATION, "worker.io110")] == pytest.approx(0.05, abs=0.01)
    [simulation] = [row for row in summary["processes"] if row["pid"] == 102]
    assert [(t["tid"], t["cpu-seconds"]) for t in simulation["threads"]] == [(102, 0.75),
                                                                           (110, 0.25)]
    json.dumps(summary)
    text = ca.format_account("the test", summary)
    assert ca.WORKER in text and "waiting for one 0.100" in text


def test_a_process_that_execs_takes_its_new_role(tmp_path):
    proc = FakeProc(tmp_path)
    simulation = ["/venv/bin/python", "/venv/bin/flwr-simulation", "--token", "x"]
    proc.process(100, ["/venv/bin/python", "bench.py"], 1, 0)
    proc.process(101, ["bash", "-c", "exec python default_worker.py"], 100, 0)
    proc.process(102, simulation, 100, 0, comm="flwr-simulation")
    proc.process(103, simulation, 102, 0, comm="flwr-simulation")  # forked, not exec'd yet
    proc.machine(0, 0)
    account = ca.CpuAccount(root=100, proc=tmp_path)
    account.sample(now=1.0)
    assert {p.pid: p.role for p in account.processes.values()}[103] == ca.SIMULATION
    proc.process(101, ["ray::IDLE"], 100, seconds(1))
    proc.process(103, [f"{VENV}/ray/raylet/raylet", f"--x=/tmp/ray/{SESSION}"], 102, 0)
    account.sample(now=2.0)
    roles = {p.pid: p.role for p in account.processes.values()}
    assert roles == {100: ca.ROOT, 101: ca.WORKER, 102: ca.SIMULATION, 103: ca.RAYLET}
    assert account.sessions == {SESSION}


def test_new_processes_are_looked_for_every_few_samples(tmp_path):
    proc = FakeProc(tmp_path)
    proc.process(100, ["/venv/bin/python", "bench.py"], 1, 0)
    proc.machine(0, 0)
    account = ca.CpuAccount(root=100, proc=tmp_path, scan_every=2)
    account.sample(now=0.0)  # a full scan
    proc.process(101, ["ray::IDLE"], 100, seconds(1))
    account.sample(now=1.0)  # only the known processes: not found yet
    assert [p.pid for p in account.processes.values()] == [100]
    proc.process(101, ["ray::IDLE"], 100, seconds(2))
    account.sample(now=2.0)  # found: counted from zero at the sample before
    [worker] = [p for p in account.processes.values() if p.pid == 101]
    assert worker.samples[0][:2] == (1.0, 0) and worker.samples[-1][:2] == (2.0, seconds(2))


def test_round_ends_come_from_metrics_json(tmp_path):
    path = tmp_path / "metrics.json"
    watch = ca.MetricsWatch(path)
    watch(0.0)  # not there yet
    path.write_text(json.dumps({"rounds": [{"round": 1}]}))
    watch(1.0)
    first = watch.ends[1]
    path.write_text("{")  # half written: read again next time
    watch(2.0)
    path.write_text(json.dumps({"rounds": [{"round": 1}, {"round": 2}]}))
    watch(3.0)
    assert watch.ends[1] == first and watch.ends[2] == path.stat().st_mtime
    rows = [{"round": 1, "round-seconds": 5.0, "train-seconds": 4.0},
            {"round": 2, "round-seconds": 2.0, "train-seconds": 1.5}]
    assert ca.round_windows(rows, {1: 10.0, 2: 12.0}) == ([(10.0, 12.0)], [(10.0, 11.5)])
    assert ca.round_windows(rows[:1], {1: 10.0}) == ([(5.0, 10.0)], [(5.0, 9.0)])
