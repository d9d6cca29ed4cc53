"""A CPU-time account of a run's processes by role, sampled from ``/proc``.

``scripts/benchmark.py --cpu-account`` runs a :class:`CpuAccount` beside the Flower
simulation (and beside the plain loop's worker processes): every ``interval`` seconds
it reads, for every process of the run, ``/proc/<pid>/stat`` (user + system CPU
time, threads, resident memory), ``/proc/<pid>/schedstat`` (the main thread's time
on a CPU and waiting in the run queue for one) and ``/proc/<pid>/status`` (context
switches, the CPUs it may run on); for the client workers and the processes that
drive the rounds, each thread's CPU time (``/proc/<pid>/task/*/stat``); for the
client workers, the thread settings of the environment they started with
(``/proc/<pid>/environ``) and the OpenMP runtime they loaded (``/proc/<pid>/maps``);
and the whole machine's busy time (``/proc/stat``).

The run's processes are the root's (this process's) descendants, and any process
whose command line names the Ray session of one of them: Ray's processes outlive
the driver that started them at shutdown. A process takes its role from its command line
(:func:`role_of`), read again when the name in its stat line changes (a forked child
that execs its program: Ray's raylet shows the simulation process's command line
first; a Ray worker renaming itself) and at every sample while its role is unknown.

A process first seen after the first sample counts from zero CPU at the sample
before; what a process spends after its last sample (under one interval, as it
exits) is not counted. :func:`summarize` turns the samples into per-role CPU
seconds over the whole run, per round, in the steady rounds and in their training
phases, given the rounds' end times.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

ROOT = "benchmark process"
WORKER = "ray worker (ClientApp)"
AGENT = "ray dashboard agent"
RUNTIME_ENV = "ray runtime-env agent"
GCS = "ray gcs_server"
RAYLET = "ray raylet"
DASHBOARD = "ray dashboard"
LOG_MONITOR = "ray log_monitor"
AUTOSCALER = "ray autoscaler monitor"
RAY_OTHER = "ray, other"
SUPERLINK = "flower-superlink"
SUPEREXEC = "flower-superexec"
SIMULATION = "flwr-simulation (ServerApp)"
SERVERAPP = "flwr-serverapp"
CLIENTAPP = "flwr-clientapp"
FLWR_RUN = "flwr run (log stream)"
PLAIN_WORKER = "plain worker"
TRACKER = "multiprocessing resource tracker"
OTHER = "other"

# Processes that do the clients' work, and the ones whose threads are listed too.
WORKER_ROLES = frozenset((WORKER, CLIENTAPP, PLAIN_WORKER))
THREAD_ROLES = WORKER_ROLES | {SIMULATION, SERVERAPP, SUPERLINK, SUPEREXEC, ROOT}

# The program (a binary, or the script after the interpreter) -> role, by the end of
# its path. The binaries come first: raylet's arguments name the scripts it starts.
PROGRAMS = (
    ("/gcs_server", GCS), ("/raylet", RAYLET),
    ("ray/dashboard/dashboard.py", DASHBOARD), ("ray/dashboard/agent.py", AGENT),
    ("runtime_env/agent/main.py", RUNTIME_ENV), ("ray/_private/log_monitor.py", LOG_MONITOR),
    ("autoscaler/_private/monitor.py", AUTOSCALER),
    ("ray/_private/workers/default_worker.py", WORKER),
    ("ray/_private/workers/setup_worker.py", WORKER),  # execs default_worker.py
    ("/flower-superlink", SUPERLINK), ("/flower-superexec", SUPEREXEC),
    ("/flwr-simulation", SIMULATION), ("/flwr-serverapp", SERVERAPP),
    ("/flwr-clientapp", CLIENTAPP),
)
# Ray renames its workers' and agents' processes ``ray::<class or task>``.
RAY_TITLES = {"DashboardAgent": AGENT, "RuntimeEnvAgent": RUNTIME_ENV}
# Interpreter options that take the next argument.
OPTION_ARGUMENTS = frozenset(("-X", "-W", "-Q"))
SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")
THREAD_ENV = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|NUMEXPR_|TORCH_.*THREADS|"
                        r"RAY_num_server_call_thread)")
OPENMP_LIBRARIES = re.compile(r"lib(gomp|iomp5|omp)[-.\w]*\.so[.\d]*")


def _program(argv: Sequence[str]) -> str:
    """The program a command runs: the script or ``-m``/``-c`` after an interpreter."""
    if not Path(argv[0]).name.startswith("python"):
        return argv[0]
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg in ("-m", "-c"):
            return f"{arg} {rest[0] if rest else ''}"
        if arg in OPTION_ARGUMENTS:
            rest = rest[1:]
        elif not arg.startswith("-"):
            return arg
    return argv[0]


def role_of(argv: Sequence[str]) -> str:
    """The role of a process with command line ``argv`` in a Flower simulation, or in
    the plain loop (``multiprocessing`` spawned workers and their resource tracker)."""
    if not argv or not argv[0]:
        return OTHER
    if argv[0].startswith("ray::"):
        title = argv[0][5:].split()[0].split(".")[0] if argv[0][5:].strip() else ""
        return RAY_TITLES.get(title, WORKER)
    program = _program(argv)
    if program.startswith("-c "):
        if "resource_tracker" in program:
            return TRACKER
        if "spawn_main" in program or "forkserver" in program:
            return PLAIN_WORKER
        return OTHER
    for suffix, role in PROGRAMS:
        if program.endswith(suffix) or Path(program).name == suffix.lstrip("/"):
            return role
    if Path(program).name == "flwr" and "run" in argv[1:]:
        return FLWR_RUN
    if "/ray/" in program:
        return RAY_OTHER
    return OTHER


# ------------------------------------------------------------------ /proc readers
@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the account uses."""
    comm: str
    state: str
    ppid: int
    ticks: int  # user + system CPU time, in clock ticks
    threads: int
    start: int  # start time after boot, in clock ticks: with the PID it names a process
    rss_pages: int


def parse_stat(text: str) -> Stat | None:
    """``/proc/<pid>/stat`` (or ``task/<tid>/stat``); None for a zombie or a bad line."""
    head, paren, tail = text.rpartition(")")
    fields = tail.split()
    if not paren or "(" not in head or len(fields) < 22 or fields[0] in ("Z", "X"):
        return None
    try:
        return Stat(comm=head.split("(", 1)[1], state=fields[0], ppid=int(fields[1]),
                    ticks=int(fields[11]) + int(fields[12]), threads=int(fields[17]),
                    start=int(fields[19]), rss_pages=int(fields[21]))
    except ValueError:
        return None


def parse_machine(text: str) -> tuple[int, int]:
    """Busy and total clock ticks of all CPUs from ``/proc/stat``'s ``cpu`` line (busy:
    everything but idle and I/O wait; guest time is already in user time)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:9]]
            values += [0] * (8 - len(values))
            user, nice, system, idle, iowait, irq, softirq, steal = values
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    return 0, 0


def parse_status(text: str) -> dict[str, str]:
    return {key.strip(): value.strip() for key, _, value in
            (line.partition(":") for line in text.splitlines()) if value}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


# ------------------------------------------------------------------ the sampler
@dataclass
class Process:
    """One process of the run and its samples: (time, CPU ticks, main thread's ns on a
    CPU, main thread's ns waiting for one)."""
    pid: int
    start: int
    role: str
    command: str
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    max_threads: int = 0
    max_rss_pages: int = 0
    switches: tuple[int, int] = (0, 0)  # voluntary, nonvoluntary (the last sample's)
    cpus_allowed: str = ""
    env: dict[str, str] | None = None
    openmp: list[str] | None = None
    threads: dict[int, list[Any]] = field(default_factory=dict)  # tid -> [comm, samples]
    threads_read: float | None = None  # when its threads were last read
    new: bool = True  # started after the account's first sample: counts from zero
    comm: str = ""  # the name in its stat line: it changes when the process execs


class CpuAccount:
    """Samples the processes of a run every ``interval`` s in a thread between
    ``start`` and ``stop``; ``hooks`` are called with the time after each sample.

    The sampler shares the machine with what it measures, so it reads less than it
    could: all of ``/proc`` (to find new processes) every ``scan_every`` samples, the
    known processes in between, and threads every ``threads_every`` samples. A new
    process found late counts from zero at the sample before it was found.
    """

    def __init__(self, root: int | None = None, *, interval: float = 0.5,
                 proc: str | os.PathLike[str] = "/proc",
                 hooks: Iterable[Callable[[float], None]] = (), scan_every: int = 4,
                 threads_every: int = 2) -> None:
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.scan_every = max(1, scan_every)
        self.threads_every = max(1, threads_every)
        self.proc = Path(proc)
        self.hooks = list(hooks)
        self.processes: dict[tuple[int, int], Process] = {}
        self.machine: list[tuple[float, int, int]] = []
        self.times: list[float] = []
        self.sessions: set[str] = set()
        self.sampler_seconds = 0.0
        self._commands: dict[tuple[int, int], list[str]] = {}
        self._alive: set[int] = {self.root}
        self._full = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading
    def _command(self, pid: int, start: int) -> list[str]:
        key = (pid, start)
        if key not in self._commands:
            raw = _read(self.proc / str(pid) / "cmdline") or ""
            self._commands[key] = [part for part in raw.split("\0") if part]
        return self._commands[key]

    def _table(self, full: bool) -> dict[int, Stat]:
        """Every process's stat line, or (not ``full``) the root's and the run's
        processes' of the last sample."""
        table = {}
        try:
            entries = os.listdir(self.proc) if full else [str(pid) for pid in self._alive]
        except OSError:
            return table
        for name in entries:
            if name.isdigit():
                stat = parse_stat(_read(self.proc / name / "stat") or "")
                if stat is not None:
                    table[int(name)] = stat
        return table

    def _members(self, table: Mapping[int, Stat]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, stat in table.items():
            children.setdefault(stat.ppid, []).append(pid)
        seeds = {self.root} | {pid for pid, start in self.processes
                               if pid in table and table[pid].start == start}
        if self.sessions:
            seeds |= {pid for pid, stat in table.items() if pid not in seeds and any(
                s in arg for arg in self._command(pid, stat.start) for s in self.sessions)}
        members, todo = set(), [pid for pid in seeds if pid in table]
        while todo:
            pid = todo.pop()
            if pid not in members:
                members.add(pid)
                todo.extend(children.get(pid, ()))
        return members

    def _threads(self, record: Process, now: float) -> None:
        folder = self.proc / str(record.pid) / "task"
        try:
            tids = os.listdir(folder)
        except OSError:
            return
        for name in tids:
            stat = parse_stat(_read(folder / name / "stat") or "")
            if stat is None:
                continue
            tid = int(name)
            entry = record.threads.get(tid)
            if entry is None:
                entry = record.threads[tid] = ["", []]
                # Started since its threads were last read (or with the process): from zero.
                since = record.threads_read if record.threads_read is not None else (
                    record.samples[0][0] if record.new else None)
                if since is not None:
                    entry[1].append((since, 0))
            entry[0] = stat.comm + (" (main)" if tid == record.pid else "")
            entry[1].append((now, stat.ticks))
        record.threads_read = now

    def _details(self, record: Process, stat: Stat, now: float) -> None:
        folder = self.proc / str(record.pid)
        sched = (_read(folder / "schedstat") or "0 0").split()
        on_cpu, waiting = (int(v) for v in (sched + ["0", "0"])[:2])
        if record.samples and record.samples[-1][1] > stat.ticks:  # cannot go back
            return
        record.samples.append((now, stat.ticks, on_cpu, waiting))
        record.max_threads = max(record.max_threads, stat.threads)
        record.max_rss_pages = max(record.max_rss_pages, stat.rss_pages)
        status = parse_status(_read(folder / "status") or "")
        record.switches = (int(status.get("voluntary_ctxt_switches", 0)),
                           int(status.get("nonvoluntary_ctxt_switches", 0)))
        record.cpus_allowed = status.get("Cpus_allowed_list", record.cpus_allowed)
        if record.role in THREAD_ROLES and (
                self._full or len(self.times) % self.threads_every == 0):
            self._threads(record, now)
        # A worker's environment and libraries, until it has loaded an OpenMP runtime
        # (with torch; by then a Ray worker has exec'd its final program).
        if record.role in WORKER_ROLES and not record.openmp and len(record.samples) % 4 == 2:
            raw = _read(folder / "environ")
            if raw is not None:
                pairs = (item.partition("=") for item in raw.split("\0") if item)
                record.env = {k: v for k, _, v in pairs if THREAD_ENV.match(k)}
            maps = _read(folder / "maps") or ""
            record.openmp = sorted({m.group(0) for m in OPENMP_LIBRARIES.finditer(maps)})

    def _sample_process(self, pid: int, stat: Stat, now: float, previous: float | None) -> None:
        record = self.processes.get((pid, stat.start))
        if record is None:
            argv = self._command(pid, stat.start)
            role = ROOT if pid == self.root else role_of(argv)
            record = Process(pid, stat.start, role, " ".join(argv)[:200] or stat.comm,
                             new=previous is not None and pid != self.root)
            if record.new:
                record.samples.append((previous, 0, 0, 0))
            self.processes[(pid, stat.start)] = record
            self.sessions.update(SESSION.findall(" ".join(argv)))
        elif pid != self.root and (stat.comm != record.comm
                                   or record.role in (OTHER, RAY_OTHER)):
            # A forked child that has exec'd (it showed its parent's command line) or
            # renamed itself (Ray's workers), or one whose program was not known yet.
            raw = _read(self.proc / str(pid) / "cmdline") or ""
            argv = [part for part in raw.split("\0") if part]
            role = role_of(argv)
            if role != OTHER or stat.comm != record.comm:
                record.role, record.command = role, " ".join(argv)[:200] or stat.comm
                self.sessions.update(SESSION.findall(" ".join(argv)))
        record.comm = stat.comm
        self._details(record, stat, now)

    def sample(self, now: float | None = None, *, full: bool = False) -> None:
        """Read the run's processes once (the sampling thread calls it); ``full``:
        look for new ones and read every thread, whatever the sample's number."""
        now = time.time() if now is None else now
        self._full = full or len(self.times) % self.scan_every == 0
        table = self._table(self._full)
        previous = self.times[-1] if self.times else None
        done: set[int] = set()
        while True:  # again when a new process names a Ray session: its orphans join
            sessions = len(self.sessions)
            for pid in sorted(self._members(table) - done):
                done.add(pid)
                self._sample_process(pid, table[pid], now, previous)
            if len(self.sessions) == sessions:
                break
        self._alive = done | {self.root}
        self.machine.append((now, *parse_machine(_read(self.proc / "stat") or "")))
        self.times.append(now)
        for hook in self.hooks:
            hook(now)

    # -- the thread
    def _loop(self) -> None:
        started = time.thread_time()
        try:
            self.sample(full=True)
            while not self._stop.wait(self.interval):
                self.sample()
            self.sample(full=True)
        finally:
            self.sampler_seconds = time.thread_time() - started

    def start(self) -> CpuAccount:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="cpu-account", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> CpuAccount:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self


class MetricsWatch:
    """A hook for :class:`CpuAccount`: the end time of each round of a run, taken as
    the modification time of its ``metrics.json`` when a new round first shows."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.ends: dict[int, float] = {}
        self._mtime: float | None = None

    def __call__(self, now: float) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        try:
            rows = json.loads(self.path.read_text())["rounds"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # written just now: read it again next time
        self._mtime = mtime
        for row in rows:
            self.ends.setdefault(int(row["round"]), mtime)


# ------------------------------------------------------------------ the account
def _at(samples: Sequence[tuple], t: float, index: int) -> float:
    """Field ``index`` of a process's cumulative ``samples`` at time ``t``, linear
    between samples, the first value before them and the last after them."""
    if t <= samples[0][0]:
        return samples[0][index]
    if t >= samples[-1][0]:
        return samples[-1][index]
    lo, hi = 0, len(samples) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if samples[mid][0] <= t else (lo, mid)
    (t0, *a), (t1, *b) = samples[lo], samples[hi]
    weight = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
    return a[index - 1] + weight * (b[index - 1] - a[index - 1])


def spent(samples: Sequence[tuple], windows: Iterable[tuple[float, float]],
          index: int = 1) -> float:
    """How much of field ``index`` (1: CPU ticks) ``samples`` gained in ``windows``."""
    return sum(_at(samples, b, index) - _at(samples, a, index) for a, b in windows) \
        if samples else 0.0


def _overlap(samples: Sequence[tuple], windows: Iterable[tuple[float, float]]) -> float:
    """Seconds of ``windows`` the process was sampled alive in."""
    if not samples:
        return 0.0
    first, last = samples[0][0], samples[-1][0]
    return sum(max(0.0, min(b, last) - max(a, first)) for a, b in windows)


def round_windows(rows: Sequence[Mapping[str, Any]], ends: Mapping[int, float]
                  ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The steady rounds' (all rounds' when there is one) windows and their training
    phases' windows: a round ends at ``ends[round]`` and lasted ``round-seconds``, its
    training phase is its first ``train-seconds``."""
    timed = [row for row in rows if int(row["round"]) in ends]
    steady = timed[1:] or timed
    rounds, trains = [], []
    for row in steady:
        end = ends[int(row["round"])]
        begin = end - float(row["round-seconds"])
        rounds.append((begin, end))
        trains.append((begin, begin + float(row.get("train-seconds") or 0.0)))
    return rounds, trains


def summarize(account: CpuAccount, rows: Sequence[Mapping[str, Any]],
              ends: Mapping[int, float]) -> dict[str, Any]:
    """Per-role CPU seconds of ``account``'s run, with ``rows`` (the rounds'
    ``round``, ``round-seconds``, ``train-seconds``) ending at ``ends``."""
    times = account.times
    whole = [(times[0], times[-1])] if times else []
    wall = times[-1] - times[0] if times else 0.0
    rounds, trains = round_windows(rows, ends)
    steady_wall = sum(b - a for a, b in rounds)
    train_wall = sum(b - a for a, b in trains)
    n_rounds, n_steady = max(1, len(rows)), max(1, len(rounds))
    by_role: dict[str, list[Process]] = {}
    for record in account.processes.values():
        by_role.setdefault(record.role, []).append(record)
    total = sum(spent(r.samples, whole) for r in account.processes.values()) / TICKS
    roles = []
    for role, records in by_role.items():
        cpu = sum(spent(r.samples, whole) for r in records) / TICKS
        steady = sum(spent(r.samples, rounds) for r in records) / TICKS
        train = sum(spent(r.samples, trains) for r in records) / TICKS
        roles.append({
            "role": role, "processes": len(records), "cpu-seconds": round(cpu, 2),
            "share": round(cpu / total, 4) if total else 0.0,
            "cpu-seconds-per-round": round(cpu / n_rounds, 3),
            "steady-cpu-seconds-per-round": round(steady / n_steady, 3),
            "steady-cores": round(steady / steady_wall, 4) if steady_wall else 0.0,
            "train-cpu-seconds-per-round": round(train / n_steady, 3),
            "max-threads": max(r.max_threads for r in records),
            "max-rss-mb": round(sum(r.max_rss_pages for r in records) * PAGE / 2**20, 1),
            "nonvoluntary-switches": sum(r.switches[1] for r in records),
            "voluntary-switches": sum(r.switches[0] for r in records),
        })
    roles.sort(key=lambda row: -row["cpu-seconds"])
    machine = account.machine
    busy = (spent(machine, rounds) / TICKS) if machine else 0.0
    capacity = (spent(machine, rounds, 2) / TICKS) if machine else 0.0
    run_steady = sum(spent(r.samples, rounds) for r in account.processes.values()) / TICKS
    return {
        "interval-seconds": account.interval, "samples": len(times),
        "wall-seconds": round(wall, 2), "rounds": len(rows), "steady-rounds": len(rounds),
        "steady-wall-seconds": round(steady_wall, 2), "train-wall-seconds": round(train_wall, 2),
        "cpu-seconds": round(total, 2), "sampler-cpu-seconds": round(account.sampler_seconds, 2),
        "roles": roles,
        "machine": {
            "cores": round(capacity / steady_wall, 2) if steady_wall else None,
            "steady-busy-cpu-seconds": round(busy, 2),
            "steady-run-cpu-seconds": round(run_steady, 2),
            "steady-outside-run-cpu-seconds": round(busy - run_steady, 2),
        },
        "workers": _workers(account, trains),
        "threads": _thread_table(account, whole, rounds),
        "processes": sorted((_process_row(r, whole, rounds)
                             for r in account.processes.values()),
                            key=lambda row: -row["cpu-seconds"]),
    }


def _process_row(record: Process, whole: list[tuple[float, float]],
                 rounds: list[tuple[float, float]], threads: int = 12) -> dict[str, Any]:
    """One process: its CPU seconds, and its busiest threads by thread id (which
    ``py-spy dump`` names for a Python process)."""
    def seconds(samples: Sequence[tuple]) -> dict[str, float]:
        return {"cpu-seconds": round(spent(samples, whole) / TICKS, 2),
                "steady-cpu-seconds-per-round": round(
                    spent(samples, rounds) / TICKS / max(1, len(rounds)), 3)}

    rows = sorted(({"tid": tid, "name": comm, **seconds(samples)}
                   for tid, (comm, samples) in record.threads.items()),
                  key=lambda row: -row["cpu-seconds"])
    return {"pid": record.pid, "role": record.role, "command": record.command,
            **seconds(record.samples),
            "max-rss-mb": round(record.max_rss_pages * PAGE / 2**20, 1), "threads": rows[:threads]}


def _workers(account: CpuAccount, trains: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Each client worker in the training phases: CPU seconds, wall seconds, and its
    main thread's time on a CPU and waiting for one."""
    out = []
    for record in sorted(account.processes.values(), key=lambda r: (r.role, r.pid)):
        if record.role not in WORKER_ROLES:
            continue
        alive = _overlap(record.samples, trains)
        cpu = spent(record.samples, trains) / TICKS
        compute = sorted(((samples[-1][1] - samples[0][1]) / TICKS
                          for _, samples in record.threads.values()), reverse=True)
        busy_threads = sum(1 for seconds in compute if compute and seconds > 0.1 * compute[0])
        on_cpu, waiting = ((spent(record.samples, trains, index) / 1e9 / alive if alive else 0.0)
                           for index in (2, 3))
        out.append({
            "pid": record.pid, "role": record.role, "command": record.command[:80],
            "train-cpu-seconds": round(cpu, 2), "train-wall-seconds": round(alive, 2),
            "cores": round(cpu / alive, 3) if alive else 0.0,
            # The main thread's share of the wall time on a CPU, runnable but waiting for
            # one, and neither (asleep: waiting for a message, or for the server).
            "main-thread-on-cpu": round(on_cpu, 3),
            "main-thread-waiting-for-cpu": round(waiting, 3),
            "main-thread-asleep": round(max(0.0, 1.0 - on_cpu - waiting), 3) if alive else 0.0,
            "threads": record.max_threads, "busy-threads": busy_threads,
            "env": record.env or {}, "openmp": record.openmp or [],
            "cpus-allowed": record.cpus_allowed,
            "nonvoluntary-switches": record.switches[1],
            "voluntary-switches": record.switches[0],
        })
    return out


def _thread_table(account: CpuAccount, whole: list[tuple[float, float]],
                  rounds: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """CPU seconds by role and thread name over the run and per steady round, the
    busiest first (Python's threads carry their process's name)."""
    table: dict[tuple[str, str], list[float]] = {}
    for record in account.processes.values():
        for comm, samples in record.threads.values():
            entry = table.setdefault((record.role, comm), [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += spent(samples, whole) / TICKS
            entry[2] += spent(samples, rounds) / TICKS
    rows = [{"role": role, "thread": comm, "threads": count, "cpu-seconds": round(cpu, 2),
             "steady-cpu-seconds-per-round": round(steady / max(1, len(rounds)), 3)}
            for (role, comm), (count, cpu, steady) in table.items()]
    return sorted(rows, key=lambda row: -row["cpu-seconds"])


def format_account(title: str, summary: Mapping[str, Any], *, threads: int = 12) -> str:
    """The account as text: the roles, the machine, the workers and the busiest threads."""
    lines = [(f"\nCPU account: {title} ({summary['samples']} samples every "
             f"{summary['interval-seconds']:g} s over {summary['wall-seconds']:.1f} s; "
             f"{summary['rounds']} rounds, steady = the last {summary['steady-rounds']}, "
             f"{summary['steady-wall-seconds']:.1f} s, their training phases "
             f"{summary['train-wall-seconds']:.1f} s)"),
             (f"{'role':36} {'procs':>5} {'CPU s':>8} {'share':>6} {'s/round':>8} "
             f"{'steady s/rd':>11} {'cores':>6} {'train s/rd':>10} {'threads':>7} "
             f"{'RSS MB':>7} {'invol. sw':>9}")]
    for row in summary["roles"]:
        lines.append(f"{row['role']:36} {row['processes']:>5} {row['cpu-seconds']:>8.2f} "
                     f"{100 * row['share']:>5.1f}% {row['cpu-seconds-per-round']:>8.2f} "
                     f"{row['steady-cpu-seconds-per-round']:>11.2f} "
                     f"{row['steady-cores']:>6.3f} {row['train-cpu-seconds-per-round']:>10.2f} "
                     f"{row['max-threads']:>7} {row['max-rss-mb']:>7.0f} "
                     f"{row['nonvoluntary-switches']:>9}")
    machine = summary["machine"]
    lines.append(f"{'all of the run':36} {'':>5} {summary['cpu-seconds']:>8.2f} (of it the "
                 f"sampler thread {summary['sampler-cpu-seconds']:.2f} s)")
    if machine["cores"]:
        lines.append(f"machine in the steady rounds: {machine['cores']:g} cores, busy "
                     f"{machine['steady-busy-cpu-seconds']:.1f} CPU s, the run "
                     f"{machine['steady-run-cpu-seconds']:.1f}, everything else "
                     f"{machine['steady-outside-run-cpu-seconds']:.1f} (other work, kernel)")
    for worker in summary["workers"]:
        if worker["train-wall-seconds"] <= 0 and worker["train-cpu-seconds"] <= 0:
            continue
        env = " ".join(f"{k}={v}" for k, v in sorted(worker["env"].items())) or "none"
        lines.append(f"  {worker['role']} {worker['pid']}: training {worker['train-cpu-seconds']:.2f}"
                     f" CPU s in {worker['train-wall-seconds']:.2f} s = {worker['cores']:.3f} "
                     f"cores; main thread on a CPU {worker['main-thread-on-cpu']:.3f}, waiting "
                     f"for one {worker['main-thread-waiting-for-cpu']:.3f}, asleep "
                     f"{worker['main-thread-asleep']:.3f}; threads "
                     f"{worker['threads']} ({worker['busy-threads']} busy); thread env: {env}; "
                     f"OpenMP {', '.join(worker['openmp']) or 'not loaded'}; CPUs "
                     f"{worker['cpus-allowed'] or '?'}")
    lines.append("busiest threads (CPU s over the run, per steady round): " + "; ".join(
        f"{row['role']} / {row['thread']} x{row['threads']} {row['cpu-seconds']:.2f}, "
        f"{row['steady-cpu-seconds-per-round']:.3f}" for row in summary["threads"][:threads]))
    return "\n".join(lines)
