"""Peak server memory of ``fedspc-reference = "client-centre"`` as K grows.

The server tracks K clients' u_k of the corrected block (d floats each). Each
measurement runs in a fresh Python process and reports its peak resident memory
(``ru_maxrss``) above what it held after its imports and its first reply-sized
array: the memory the tracked u_k cost, not the replies of a round (those are m × d
for m sampled clients whatever the rule).

* ``store``: :class:`strategies.references.ClientReferences` (the u_k on disk): add K
  changes one at a time, take the rule's centre block by block, and with
  ``--checkpoint`` write the u_k into a checkpoint and restore them from it;
* ``memory``: the u_k in a dict and the rule's centre over all of them at once, as the
  server did before (K × d floats, and the rule's stacked copy).

    python scripts/bench_reference_memory.py                      # K = 100 and 1,000
    python scripts/bench_reference_memory.py --clients 100 --width 1000000 --rules krum

Writes K × d × 4 bytes into ``--folder`` (8.4 GB at K = 1,000, d = 2 M).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def child(mode: str, clients: int, width: int, rule_name: str, folder: str,
          checkpoint: bool) -> dict:
    """One measurement (in its own process)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from fedspc_app.runs.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
    from strategies import AggregationRule, FedSPC
    from strategies.references import ClientReferences

    rule = AggregationRule(rule_name, trim_fraction=0.1, byzantine=2)
    shapes = {"body.weight": (width - 1000,), "body.bias": (1000,)}
    rng = np.random.default_rng(0)

    def change(pid: int) -> dict:
        values = rng.standard_normal(width, dtype=np.float32) * np.float32(1 + pid % 7)
        return {"body.weight": values[:-1000], "body.bias": values[-1000:]}

    change(0)  # one reply's worth, as the server holds anyway
    base = peak_mb()
    started = time.perf_counter()
    timings = {}
    if mode == "memory":
        tracked = {pid: change(pid) for pid in range(clients)}
        chosen = [tracked[pid] for pid in rule.selected(list(tracked.values()), list(shapes))]
        centre = rule.combine(chosen, [1.0] * len(chosen))
    else:
        store = ClientReferences(shapes, clients, folder=folder)
        for pid in range(clients):
            store.add(pid, change(pid))
        timings["add-seconds"] = time.perf_counter() - started
        mark = time.perf_counter()
        centre = store.centre(rule, clients)
        timings["centre-seconds"] = time.perf_counter() - mark
        if checkpoint:
            mark = time.perf_counter()
            run_dir = Path(folder) / "run"
            run_dir.mkdir()
            write_checkpoint(run_dir, Checkpoint(
                round=1, phase="trained", shared={}, strategy={},
                global_reference={**centre, **store.deferred("client/")}), {},
                new_arrays=True)
            timings["checkpoint-write-seconds"] = time.perf_counter() - mark
            mark = time.perf_counter()
            saved = read_checkpoint(run_dir, {})
            restored = FedSPC(shared_keys=list(shapes), corrected_keys=list(shapes),
                              learning_rate=0.1, num_partitions=clients,
                              reference="client-centre", reference_dir=folder)
            restored.load_state_dict({"accepted-rounds": [1] * clients}, 1,
                                     global_reference=saved.global_reference)
            assert len(restored.client_references) == clients
            timings["checkpoint-read-seconds"] = time.perf_counter() - mark
    norm = float(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in centre.values()))
    return {"mode": mode, "clients": clients, "width": width, "rule": rule_name,
            "peak-mb": peak_mb(), "base-mb": base, "u-k-mb": clients * width * 4 / 2**20,
            "seconds": time.perf_counter() - started, "centre-norm2": norm, **timings}


def measure(mode: str, clients: int, width: int, rule: str, folder: Path,
            checkpoint: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-references-", dir=folder))
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(clients), str(width), rule,
             str(work), str(int(checkpoint))], capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--width", type=int, default=2 * 2**20,
                        help="d, floats in the corrected block (default: 2 Mi)")
    parser.add_argument("--rules", nargs="+", default=["median"])
    parser.add_argument("--memory-up-to", type=int, default=100,
                        help="also measure the in-memory u_k up to this K")
    parser.add_argument("--checkpoint-up-to", type=int, default=100,
                        help="also write and restore a checkpoint up to this K")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, clients, width, rule, folder, checkpoint = args.child
        print(json.dumps(child(mode, int(clients), int(width), rule, folder,
                               checkpoint == "1")))
        return 0
    print(f"client-centre, d = {args.width:,} floats ({args.width * 4 / 2**20:.0f} MiB a "
          "client); peak RSS above the process's own after one reply-sized array")
    print("| u_k kept | rule | K | K × d (MiB) | peak above base (MiB) | seconds | "
          "centre ‖·‖² |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rule in args.rules:
        for clients in args.clients:
            modes = [("store", clients <= args.checkpoint_up_to)]
            if clients <= args.memory_up_to:
                modes.append(("memory", False))
            for mode, checkpoint in modes:
                row = measure(mode, clients, args.width, rule, args.folder, checkpoint)
                label = ("on disk" + (" + checkpoint write/restore" if checkpoint else "")
                         if mode == "store" else "in memory (before)")
                print(f"| {label} | {rule} | {clients:,} | {row['u-k-mb']:,.0f} | "
                      f"{row['peak-mb'] - row['base-mb']:,.0f} | {row['seconds']:.1f} | "
                      f"{row['centre-norm2']:.6g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
