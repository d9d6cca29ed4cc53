"""Score the cross-device DP grid's predictions (D1-D5 in README.md) from its runs.

Reads the runs of docs/results/cpu-cifar100-cnn-dp-cross-device (and of
docs/results/cpu-cifar100-cnn-dp-clipping for D5) and prints, in Markdown:

* the personalized accuracy at the last round of each cell, without DP, under DP and
  under DP with a smoothed u_bar, what DP cost each method, and the epsilon spent;
* accuracy against epsilon: each cell's accuracy at its evaluated rounds beside the
  epsilon the DP cells had spent by then (every 10 rounds a fifth of the clients is
  evaluated, at the last round all of them);
* adaptive clipping's C in each DP cell (the scale of what the clients release);
* the clipping sweep: accuracy at round 30 for each fixed C and for adaptive clipping
  (its C at the end);
* the deciding cells at seed 1 (docs/results/cpu-cifar100-cnn-dp-cross-device-s1);
* each prediction, hit / miss / pending, by the rule written beside it in README.md.

A run counts only when it is complete (summary.json says so). Numbers are in points of
personalized accuracy (the mean over the evaluated clients).

    python docs/results/cpu-cifar100-cnn-dp-cross-device/score.py [--results docs/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRID = "cpu-cifar100-cnn-dp-cross-device"
SWEEP = "cpu-cifar100-cnn-dp-clipping"
SEED1 = "cpu-cifar100-cnn-dp-cross-device-s1"  # the deciding cells at seed 1 (D7)
METHODS = {"fedavg": "FedAvg", "fedrep": "FedRep", "lgfedavg": "LG-FedAvg"}
SETTINGS = ("no-dp", "dp", "dp-smooth0.9", "dp-level")
FEDSPC_ONLY = ("dp-smooth0.9", "dp-level")
FIXED_C = ("c0.1", "c0.25", "c0.5", "c1.0", "c2.0")
TOLERANCE = 1.0  # points: "within 1 point", "by more than 1 point"


def load_run(folder: Path) -> dict | None:
    """A complete run's per-round metrics and summary, or None."""
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    summary = metrics.get("summary") if isinstance(metrics, dict) else None
    if not isinstance(summary, dict) or not summary.get("complete"):
        return None
    return metrics


def final(run: dict | None) -> float | None:
    """Accuracy (%) at the run's last evaluated round."""
    if run is None:
        return None
    evaluated = [r for r in run["rounds"] if r.get("accuracy") is not None]
    return 100.0 * evaluated[-1]["accuracy"] if evaluated else None


def last(run: dict | None, key: str) -> float | None:
    values = [r[key] for r in (run or {}).get("rounds", []) if r.get(key) is not None]
    return values[-1] if values else None


def name(method: str, fedspc: bool, setting: str) -> str:
    return f"{method}{'+fedspc' if fedspc else ''}-{setting}"


def f(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def verdict(ok: bool | None) -> str:
    return "pending" if ok is None else ("hit" if ok else "miss")


def all_of(*checks: bool | None) -> bool | None:
    if any(c is None for c in checks):
        return None
    return all(checks)


def within(a: float | None, b: float | None) -> bool | None:
    gap = minus(a, b)
    return None if gap is None else abs(gap) <= TOLERANCE


def above(a: float | None, b: float | None, margin: float = TOLERANCE) -> bool | None:
    """``a > b + margin`` for a margin above 0 ("more than"), else ``a >= b + margin``
    ("at most |margin| below"); None if either is missing."""
    if a is None or b is None:
        return None
    return a > b + margin if margin > 0 else a >= b + margin


def below(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a < b


class Scores:
    """The runs of the two grids under one results folder, read once."""

    def __init__(self, results: Path):
        names = [name(m, s, setting) for m in METHODS for s in (False, True)
                 for setting in SETTINGS if s or setting not in FEDSPC_ONLY]
        self.runs = {n: load_run(results / GRID / n) for n in names}
        self.sweep = {f"{m}-{c}": load_run(results / SWEEP / f"{m}-{c}")
                      for m in ("fedrep", "lgfedavg") for c in (*FIXED_C, "adaptive")}
        self.seed1 = {n: load_run(results / SEED1 / n) for n in names
                      if not n.startswith("fedavg")}

    def acc1(self, method: str, fedspc: bool, setting: str) -> float | None:
        """Seed 1's accuracy of a cell (D7)."""
        return final(self.seed1.get(name(method, fedspc, setting)))

    def seed1_table(self) -> list[str]:
        lines = ["| Method | no DP | DP (base) / DP, ū level (FedSPC) | Lost to DP |",
                 "| --- | ---: | ---: | ---: |"]
        for m in ("fedrep", "lgfedavg"):
            for s in (False, True):
                dp = self.acc1(m, s, "dp-level" if s else "dp")
                lines.append(f"| {METHODS[m]}{'+FedSPC' if s else ''} | "
                             f"{f(self.acc1(m, s, 'no-dp'))} | {f(dp)} | "
                             f"{f(minus(self.acc1(m, s, 'no-dp'), dp))} |")
        return lines

    def acc(self, method: str, fedspc: bool, setting: str) -> float | None:
        return final(self.runs.get(name(method, fedspc, setting)))

    def dp_cost(self, method: str, fedspc: bool = False) -> float | None:
        return minus(self.acc(method, fedspc, "no-dp"), self.acc(method, fedspc, "dp"))

    def final_table(self) -> list[str]:
        lines = [("| Method | no DP | DP | DP, ū smoothed 0.9 | DP, ū level | Lost to DP"
                  " | ε at the end |"), "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for m, label in METHODS.items():
            for s in (False, True):
                smooth, level = ((f(self.acc(m, s, "dp-smooth0.9")),
                                  f(self.acc(m, s, "dp-level"))) if s else ("n/a", "n/a"))
                eps = last(self.runs.get(name(m, s, "dp")), "dp-epsilon")
                lines.append(
                    f"| {label}{'+FedSPC' if s else ''} | {f(self.acc(m, s, 'no-dp'))} | "
                    f"{f(self.acc(m, s, 'dp'))} | {smooth} | {level} | "
                    f"{f(self.dp_cost(m, s))} | "
                    f"{f(eps)} |")
        return lines

    def clipping_table(self) -> list[str]:
        """Adaptive clipping's C in each DP cell, every 20 rounds and at the end (the
        median update norm it tracks: the released vectors' scale)."""
        cells = [(n, run) for n, run in self.runs.items()
                 if run is not None and not n.endswith("-no-dp")]
        if not cells:
            return ["(no DP run is complete yet)"]
        marks = (1, 20, 40, 60, 80, 100)
        lines = ["| Cell | " + " | ".join(f"C at {r}" for r in marks) + " |",
                 "| --- | " + " | ".join("---:" for _ in marks) + " |"]
        for n, run in cells:
            by_round = {r["round"]: r.get("dp-clipping-norm") for r in run["rounds"]}
            lines.append(f"| {n} | " + " | ".join(f(by_round.get(r), 3) for r in marks) + " |")
        return lines

    def epsilon_table(self) -> list[str]:
        cells = [(n, run) for n, run in self.runs.items() if run is not None]
        if not cells:
            return ["(no run is complete yet)"]
        rounds = sorted({r["round"] for _, run in cells for r in run["rounds"]
                         if r.get("accuracy") is not None})
        lines = ["| Round | ε | " + " | ".join(n for n, _ in cells) + " |",
                 "| ---: | ---: | " + " | ".join("---:" for _ in cells) + " |"]
        for rnd in rounds:
            row, eps = [], None
            for _, run in cells:
                hit = next((r for r in run["rounds"] if r["round"] == rnd), {})
                eps = hit.get("dp-epsilon", eps)
                acc = hit.get("accuracy")
                row.append(f(None if acc is None else 100.0 * acc))
            lines.append(f"| {rnd} | {f(eps)} | " + " | ".join(row) + " |")
        return lines

    def sweep_table(self) -> list[str]:
        lines = ["| Method | " + " | ".join(f"C = {c[1:]}" for c in FIXED_C)
                 + " | adaptive | adaptive's C at the end |",
                 "| --- | " + " | ".join("---:" for _ in FIXED_C) + " | ---: | ---: |"]
        for m in ("fedrep", "lgfedavg"):
            accs = [f(final(self.sweep[f"{m}-{c}"])) for c in (*FIXED_C, "adaptive")]
            c_end = last(self.sweep[f"{m}-adaptive"], "dp-clipping-norm")
            lines.append(f"| {METHODS[m]} | " + " | ".join(accs) + f" | {f(c_end, 3)} |")
        return lines

    def predictions(self) -> dict[str, tuple[str, bool | None]]:
        a = self.acc
        cost = {m: self.dp_cost(m) for m in METHODS}
        d1 = all_of(below(cost["lgfedavg"], cost["fedrep"]),
                    below(cost["lgfedavg"], cost["fedavg"]))
        d2 = all_of(below(a("fedavg", False, "dp"), a("fedrep", False, "dp")),
                    below(a("fedavg", False, "dp"), a("lgfedavg", False, "dp")))
        d3 = all_of(*(below(a(m, True, "dp"), a(m, False, "dp"))
                      for m in ("fedrep", "lgfedavg")))
        d4 = all_of(*(check for m in ("fedrep", "lgfedavg") for check in (
            below(a(m, True, "dp"), a(m, True, "dp-smooth0.9")),
            within(a(m, True, "dp-smooth0.9"), a(m, False, "dp")))))
        d6 = all_of(*(check for m in ("fedrep", "lgfedavg") for check in (
            above(a(m, True, "dp-level"), a(m, True, "dp")),
            above(a(m, True, "dp-level"), a(m, False, "dp"), -TOLERANCE))))
        a1 = self.acc1
        d7 = all_of(*(check for m in ("fedrep", "lgfedavg") for check in (
            below(a1(m, True, "dp-level"), a1(m, False, "dp")),
            above(a1(m, True, "dp-level"), a1(m, False, "dp"), -2.0),
            below(minus(a1(m, False, "no-dp"), a1(m, False, "dp")), 2.0))))
        goal = {setting: above(a("fedrep", True, setting), a("fedrep", False, "dp"), 0.0)
                for setting in FEDSPC_ONLY}
        d5_checks = []
        for m in ("fedrep", "lgfedavg"):
            fixed = [final(self.sweep[f"{m}-{c}"]) for c in FIXED_C]
            adaptive = final(self.sweep[f"{m}-adaptive"])
            if adaptive is None or any(x is None for x in fixed):
                d5_checks.append(None)
                continue
            d5_checks.append(max(fixed) - adaptive <= TOLERANCE
                             and adaptive - min(fixed) > TOLERANCE)
        return {
            "D1": ("LG-FedAvg's loss to DP below FedRep's and FedAvg's", d1),
            "D2": ("FedAvg under DP below FedRep and LG-FedAvg under DP", d2),
            "D3": ("+FedSPC under DP below its base under DP, FedRep and LG-FedAvg", d3),
            "D4": (("ū smoothed 0.9 above plain FedSPC under DP, and within 1 point of"
                    " the base under DP, FedRep and LG-FedAvg"), d4),
            "D6": (("ū level more than 1 point above plain FedSPC under DP, and at most 1"
                    " point below the base under DP, FedRep and LG-FedAvg"), d6),
            "D7": (("seed 1: ū level under DP below its base under DP by less than 2"
                    " points, and DP costing each base less than 2, FedRep and LG-FedAvg"),
                   d7),
            "goal": ("FedRep+FedSPC (ū smoothed) under DP ≥ FedRep under DP",
                     goal["dp-smooth0.9"]),
            "goal, level": ("FedRep+FedSPC (ū level) under DP ≥ FedRep under DP",
                            goal["dp-level"]),
            "D5": (("adaptive within 1 point below the best fixed C or above it, and"
                    " more than 1 point above the worst, FedRep and LG-FedAvg"),
                   all_of(*d5_checks)),
        }

    def report(self) -> str:
        out = ["## Personalized accuracy at the last round (%)", "", *self.final_table(), "",
               ("## Accuracy against ε (%) at the evaluated rounds: the DP cells, and the runs"
                " without DP beside them"), "",
               *self.epsilon_table(), "",
               "## Adaptive clipping's C in the DP cells", "", *self.clipping_table(), "",
               "## Clipping sweep: accuracy at round 30 (%)", "", *self.sweep_table(), "",
               "## Seed 1, the deciding cells: accuracy at round 100 (%)", "",
               *self.seed1_table(), "",
               "## Predictions", "", "| | Rule | Verdict |", "| --- | --- | --- |"]
        out += [f"| {pid} | {rule} | {verdict(ok)} |"
                for pid, (rule, ok) in sorted(self.predictions().items())]
        return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE.parent,
                        help="the folder that holds both grids' folders (default: %(default)s)")
    args = parser.parse_args(argv)
    print(Scores(args.results).report(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
