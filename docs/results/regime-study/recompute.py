"""Recompute the regime study's numbers from the committed metrics files.

Run from the repository root (plain Python, numpy only, a second or two):

    python docs/results/regime-study/recompute.py

(``--readme`` instead writes the table of the top-level README's "When does FedSPC
help?" between its ``<!-- when-table:begin -->`` and ``<!-- when-table:end -->`` lines.)

Every number that README.md (in this folder) quotes in its tables and its
"Reading" section and that the committed runs can give is recomputed here, grouped
by the claim it supports, so the text can be held against it:

* Δ = +FedSPC − Base personalized accuracy (points) at the last round, and the
  rounds where +FedSPC is ahead / behind (all rounds; round 1 is a tie, both
  sides start from the same model), per pair and per seed; the seed mean (Δ of
  the seed-mean curves) with the sample SD of the per-seed Δ;
* the clients +FedSPC puts ahead / behind at the last round (each client against
  itself on the same seed);
* Δ by window of rounds (2–10, 11–20, ...), to see whether a lead fades or grows;
* the rounds (after the first) where the clients' train loss is higher with FedSPC;
* drift window means (dispersion, cosine, ‖ū‖, ‖mean Δ‖, train loss) and, where
  recorded, the accuracy before aggregation (the local fit) and the averaging gain;
* the 50-round and Ditto-global details, SCAFFOLD against FedAvg, and how well a
  run repeats under the same seed;
* FedRep on the ResNet-34 over 50 rounds: Δ every ten rounds against the depth
  grid's round 20 at the same seed (P5's "not turning"), then by window as below;
* the ResNet pairs per seed and window: Δ, the local cost against the averaging's
  extra (their sum is the window's Δ: an accounting, not a cause), the cut in the
  shared block's dispersion, the rounds with the higher train loss;
* LG-FedAvg at E = 5: its four runs, each seed's windows, peak and last rounds, and
  the count of cells behind the caveats of its p;
* FedRep on the CNN in every committed setting, with its seeds and the 2-point rule;
* which build of the app made each run, from the app hashes in the grids' logs
  (config.json records a code version only for the runs made since it could: the
  ResNet-18, ResNet-34 E = 5 and 50-round grids among the study's): pairs made by two
  builds, runs that changed build mid-run, every run started more than once;
* what config.json records per grid: how many runs record their code version, and the
  precision the runs trained in;
* the ResNet grids run by run: accuracy, wall time, code version (clean or dirty),
  segments, machine, each round's seconds, the shared block's dispersion range;
* round records left incomplete (a round resumed between training and evaluation);
* the wall times of the READMEs' tables against summary.json;
* the top-level README's "When does FedSPC help?" table, rendered from the runs
  (per-seed Δ with its flags: two builds, resumed, an evaluation-only round, no
  recorded code version, two kinds of CPU; mean ± SD, the horizon, the seed-mean
  curve's rounds ahead / behind) and held against the README's block between its when-table markers
  (``--readme`` rewrites that block);
* LG-FedAvg and FedRep at E = 5 over 30 rounds (P12, P13): Δ every five rounds, the
  rounds ahead / behind, the mean over rounds 21-30 with its seed spread, and the
  first ten rounds against the committed 10-round runs of the same seed (another
  machine);
* the predictions of PREDICTIONS.md (P1-P13), each scored hit / miss by the rule
  written there, from the runs committed so far (a cell not yet run says so).

A pair is a Base run folder and its +FedSPC twin: ``fedrep`` / ``fedrep+fedspc``,
``lgfedavg-s1`` / ``lgfedavg+fedspc-s1``, ``ditto-a0.1`` / ``ditto+fedspc-a0.1``.
Not recomputable: the no-augmentation row (the issue's measurement, no committed
run).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1]
SERIES = {"acc": "accuracy", "loss": "train-loss", "disp": "drift-dispersion",
          "cos": "update-cosine", "ubar": "global-reference-norm", "mean": "update-norm",
          "before": "accuracy-before-aggregation", "global": "global-accuracy"}
PERCENT = {"acc", "before", "global"}

# (setting, seed, grid folder, Base run folder); the +FedSPC twin is derived.
PAIRS = [
    ("E1", 0, "cpu-cifar100-cnn-mismatch", "fedrep"),
    ("E1", 0, "cpu-cifar100-cnn-mismatch", "lgfedavg"),
    ("E1", 0, "cpu-cifar100-cnn", "ditto-a0.1"),
    ("E1", 1, "cpu-cifar100-cnn-seeds", "fedrep-s1"),
    ("E1", 2, "cpu-cifar100-cnn-seeds", "fedrep-s2"),
    ("E1", 1, "cpu-cifar100-cnn-seeds", "lgfedavg-s1"),
    ("E1", 2, "cpu-cifar100-cnn-seeds", "lgfedavg-s2"),
    ("a0.01", 0, "cpu-cifar100-cnn", "fedrep-a0.01"),
    ("a0.01", 0, "cpu-cifar100-cnn-mismatch-a001", "lgfedavg"),
    ("a0.01", 0, "cpu-cifar100-cnn", "ditto-a0.01"),
    # FedRep's E = 5 Base rerun on the current code, against the committed +FedSPC run
    # (the first Base, made before the partition-ordered aggregation: e5_rerun()).
    ("E5", 0, "cpu-cifar100-cnn-e5-fedrep-base", "fedrep", "fedrep+fedspc", None,
     "cpu-cifar100-cnn-e5"),
    ("E5", 0, "cpu-cifar100-cnn-e5", "lgfedavg"),
    ("E5", 1, "cpu-cifar100-cnn-e5-seeds", "lgfedavg-s1"),
    ("E5", 2, "cpu-cifar100-cnn-e5-seeds", "lgfedavg-s2"),
    ("E5", 0, "cpu-cifar100-cnn-e5", "ditto"),
    ("E5-a0.01", 0, "cpu-cifar100-cnn-e5-a001", "lgfedavg"),
    ("E5-a0.01", 0, "cpu-cifar100-cnn-e5-a001", "ditto"),
    ("BN", 0, "cpu-cifar100-cnn-bn", "fedrep"),
    ("BN", 0, "cpu-cifar100-cnn-bn", "lgfedavg"),
    ("BN", 0, "cpu-cifar100-cnn-bn", "ditto"),
    ("50r", 0, "cpu-cifar100-cnn-long", "fedrep"),
    ("50r", 0, "cpu-cifar100-cnn-long", "lgfedavg"),
    ("50r", 0, "cpu-cifar100-cnn-long", "ditto"),
    ("ditto-global", 0, "cpu-cifar100-cnn-ditto-global", "ditto"),
]
METHODS = ("fedrep", "lgfedavg", "ditto")


def twin(base: str) -> str:
    method, _, rest = base.partition("-")
    return method + "+fedspc" + ("-" + rest if rest else "")


def load(grid: str, name: str) -> dict:
    """{series: {round: value}} of one run, accuracies in %; "clients": last round."""
    rounds = json.loads((RESULTS / grid / name / "metrics.json").read_text())["rounds"]
    run = {key: {r["round"]: r[col] * (100 if key in PERCENT else 1)
                 for r in rounds if r.get(col) is not None}
           for key, col in SERIES.items()}
    run["clients"] = {k: 100 * v for k, v in rounds[-1]["client-accuracy"].items()}
    return run


class Pair:
    def __init__(self, setting, seed, grid, base, spc=None, method=None, spc_grid=None):
        self.setting, self.seed, self.grid = setting, seed, grid
        self.method = method or base.split("-")[0]
        self.base, self.spc = load(grid, base), load(spc_grid or grid, spc or twin(base))
        self.rounds = sorted(set(self.base["acc"]) & set(self.spc["acc"]))
        self.last = self.rounds[-1]

    def name(self):
        return f"{self.method} {self.setting} s{self.seed}"

    def diff(self, key="acc"):
        b, s = self.base[key], self.spc[key]
        return {r: s[r] - b[r] for r in sorted(set(b) & set(s))}

    def final(self):
        return self.diff()[self.last]

    def ahead_behind(self, key="acc"):
        d = self.diff(key).values()
        return sum(v > 0 for v in d), sum(v < 0 for v in d)

    def clients(self):
        b, s = self.base["clients"], self.spc["clients"]
        return sum(s[k] > b[k] for k in b), sum(s[k] < b[k] for k in b)

    def loss_higher(self):
        d = {r: v for r, v in self.diff("loss").items() if r >= 2}
        return sum(v > 0 for v in d.values()), sum(v < 0 for v in d.values()), len(d)


def wmean(series: dict, lo: int, hi: int):
    vals = [v for r, v in series.items() if lo <= r <= hi]
    return float(np.mean(vals)) if vals else float("nan")


def windows(last: int):
    if last in (20, 30, 50):
        return [(2, 10), *((lo, lo + 9) for lo in range(11, last, 10))]
    return [(2, 9), (10, 15)]


def rounds_where(d: dict, sign: int) -> str:
    """Compact list of the rounds where sign(d) == sign, e.g. '3-15, 17'."""
    rs = [r for r, v in d.items() if np.sign(round(v, 9)) == sign]
    out, start = [], None
    for i, r in enumerate(rs):
        start = r if start is None else start
        if i + 1 == len(rs) or rs[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out) or "none"


def f(x, p=2):
    return f"{x:+.{p}f}"


def find(pairs, method, setting, seed=0):
    return next(p for p in pairs if (p.method, p.setting, p.seed) == (method, setting, seed))


def seed_group(pairs, method, setting):
    group = [p for p in pairs if p.method == method and p.setting == setting]
    curve = {r: np.mean([p.diff()[r] for p in group]) for r in group[0].rounds}
    finals = [p.final() for p in group]
    sd = float(np.std(finals, ddof=1)) if len(finals) > 1 else float("nan")
    ahead = sum(v > 0 for v in curve.values()), sum(v < 0 for v in curve.values())
    return group, curve, finals, sd, ahead


def header(text):
    print(f"\n== {text}")


def main():
    pairs = [Pair(*spec) for spec in PAIRS]

    header("Δ table: Δ at the last round (points), rounds ahead / behind, clients ahead / behind")
    for p in pairs:
        a, b = p.ahead_behind()
        ca, cb = p.clients()
        d = p.diff()
        win = ", ".join(f"{lo}-{hi} {f(wmean(d, lo, hi))}" for lo, hi in windows(p.last))
        print(f"{p.name():26s} round {p.last}: {f(p.final())} ({a} / {b}); round 1 {f(d[1])};"
              f" clients {ca} / {cb}; by window {win}; last 5 {f(wmean(d, p.last - 4, p.last))}")

    header("Seed means (Δ of the seed-mean curves; SD = sample SD of the per-seed Δ)")
    for method, setting in [("fedrep", "E1"), ("lgfedavg", "E1"), ("lgfedavg", "E5")]:
        group, curve, finals, sd, (a, b) = seed_group(pairs, method, setting)
        ca = sum(p.clients()[0] for p in group)
        cb = sum(p.clients()[1] for p in group)
        win = ", ".join(f"{lo}-{hi} {f(wmean(curve, lo, hi))}" for lo, hi in windows(20))
        tval, pval = t_two_sided(finals)
        print(f"{method} {setting}: seeds {[p.seed for p in group]} Δ {[round(x, 2) for x in finals]}"
              f" mean {f(curve[20])} SD {sd:.2f} t {tval:.2f}{f' p {pval:.3f}' if pval is not None else ''}"
              f" range {min(finals):+.2f}..{max(finals):+.2f};"
              f" seed-mean curve ahead / behind {a} / {b}; clients {ca} / {cb}; by window {win}")
    e1 = [p.final() for p in pairs if p.setting == "E1" and p.method != "ditto"]
    print(f"E1 FedRep+LG per-seed Δ spread within a method:"
          f" FedRep {np.ptp([p.final() for p in pairs if p.setting == 'E1' and p.method == 'fedrep']):.2f},"
          f" LG {np.ptp([p.final() for p in pairs if p.setting == 'E1' and p.method == 'lgfedavg']):.2f}"
          f" (all E1 values {sorted(round(x, 2) for x in e1)})")

    header("Factor against the starting point, seed 0: Δ at round 20 (does BatchNorm / E = 5 narrow every gap?)")
    for method in METHODS:
        start = find(pairs, method, "E1").final()
        print(f"{method:9s} E1 {f(start)}  BN {f(find(pairs, method, 'BN').final())}"
              f"  E5 {f(find(pairs, method, 'E5').final())}")

    header("Lead over the run: Δ by window, per pair (is an early lead that fades the rule?)")
    for p in pairs:
        d = p.diff()
        ws = [wmean(d, lo, hi) for lo, hi in windows(p.last)]
        a, _ = p.ahead_behind()
        shape = ("never ahead" if a == 0 else "ahead early, smaller later" if ws[0] > 0 and ws[-1] < ws[0]
                 else "lead grows" if ws[0] > 0 and ws[-1] >= ws[0] else "behind early")
        print(f"{p.name():26s} {' '.join(f(w) for w in ws)}  ahead in rounds {rounds_where(d, 1)}  -> {shape}")

    header("Where does it pay? head/body dispersion (Base, +FedSPC, rounds 2-10) against Δ at round 20")
    for p in sorted(pairs, key=lambda p: (p.method, -wmean(p.base["disp"], 2, 10)
                                          if p.base["disp"] else 0)):
        if p.setting in ("ditto-global",):
            continue
        db, ds = wmean(p.base["disp"], 2, 10), wmean(p.spc["disp"], 2, 10)
        print(f"{p.name():26s} dispersion {db:5.2f} -> {ds:5.2f}  Δ@{p.last} {f(p.final())}")

    header("Train loss higher with FedSPC: rounds after the first (higher / lower / of)")
    tot = [0, 0, 0]
    for p in pairs:
        h, lo, n = p.loss_higher()
        note = "  (Ditto: personal phase's loss)" if p.method == "ditto" else ""
        print(f"{p.name():26s} {h} / {lo} / {n}  higher in rounds {rounds_where({r: v for r, v in p.diff('loss').items() if r >= 2}, 1)}{note}")
        if p.method != "ditto" and p.last == 20:
            tot = [t + x for t, x in zip(tot, (h, lo, n))]
    n20 = sum(p.method != "ditto" and p.last == 20 for p in pairs)
    print(f"non-Ditto 20-round pairs ({n20}): higher in {tot[0]} of {tot[2]} rounds, lower in {tot[1]}")
    before = [p.loss_higher() for p in pairs if p.method != "ditto" and p.last == 20
              and (p.method, p.setting, p.seed) != ("lgfedavg", "E5", 2)]
    print(f"the same without LG-FedAvg E5 s2 (the {len(before)} pairs PREDICTIONS.md's R3 counts):"
          f" higher in {sum(h for h, _, _ in before)} of {sum(n for _, _, n in before)}")
    lg5 = find(pairs, "lgfedavg", "E5")
    print(f"LG-FedAvg E5 s0 train loss round 5: {lg5.spc['loss'][5]:.3f} vs {lg5.base['loss'][5]:.3f};"
          f" round 20: {lg5.spc['loss'][20]:.3f} vs {lg5.base['loss'][20]:.3f}")

    header("Local fit and averaging (runs with accuracy before aggregation; points)")
    depth = [Pair("R34", seed, DEPTH, f"{method}-s{seed}") for method in ("fedrep", "lgfedavg")
             for seed in (0, 1, 2) if _complete(RESULTS / DEPTH / f"{method}+fedspc-s{seed}")]
    for p in pairs + depth:
        if not p.base["before"]:
            continue
        for lo, hi in windows(p.last):
            fit = wmean(p.diff("before"), lo, hi)
            gb = wmean({r: p.base["acc"][r] - v for r, v in p.base["before"].items()}, lo, hi)
            gs = wmean({r: p.spc["acc"][r] - v for r, v in p.spc["before"].items()}, lo, hi)
            print(f"{p.name():26s} rounds {lo}-{hi}: before-aggregation Δ {f(fit)};"
                  f" averaging gain (after - before) Base {f(gb)}, +FedSPC {f(gs)}, extra {f(gs - gb)}")

    header("Drift window means, Base -> +FedSPC (dispersion, cosine, ‖ū‖ +FedSPC, ‖mean Δ‖, train loss)")
    for p in pairs:
        if not p.base["disp"] and not p.spc["disp"]:
            print(f"{p.name():26s} no drift columns (Base has {len(p.base['disp'])} rounds,"
                  f" +FedSPC {len(p.spc['disp'])})")
            continue
        for lo, hi in windows(p.last):
            m = {k: (wmean(p.base[k], lo, hi), wmean(p.spc[k], lo, hi))
                 for k in ("disp", "cos", "mean", "loss")}
            print(f"{p.name():26s} {lo:2d}-{hi:2d}: disp {m['disp'][0]:5.2f} -> {m['disp'][1]:5.2f}"
                  f"  cos {m['cos'][0]:.2f} -> {m['cos'][1]:.2f}  ‖ū‖ {wmean(p.spc['ubar'], lo, hi):.3f}"
                  f"  ‖meanΔ‖ {m['mean'][0]:.3f} -> {m['mean'][1]:.3f}"
                  f"  loss {m['loss'][0]:.3f} -> {m['loss'][1]:.3f}")
    for setting in ("E5",):
        g = [p for p in pairs if p.method == "lgfedavg" and p.setting == setting]
        for key in ("disp", "cos"):
            for lo, hi in windows(20):
                b = np.mean([wmean(p.base[key], lo, hi) for p in g])
                s = np.mean([wmean(p.spc[key], lo, hi) for p in g])
                print(f"lgfedavg E5 seed mean {key} {lo}-{hi}: {b:.2f} -> {s:.2f}")

    header("Per-round drift quoted in the text")
    print("lgfedavg E5 s0 ‖ū‖ rounds 3, 20: {:.3f}, {:.3f}; +FedSPC dispersion round 4, 20: {:.2f}, {:.2f};"
          " Base dispersion range rounds 2-20: {:.2f}-{:.2f}".format(
              lg5.spc["ubar"][3], lg5.spc["ubar"][20], lg5.spc["disp"][4], lg5.spc["disp"][20],
              min(v for r, v in lg5.base["disp"].items() if r >= 2),
              max(v for r, v in lg5.base["disp"].items() if r >= 2)))
    d5 = find(pairs, "ditto", "E5-a0.01")
    print("ditto E5-a0.01 ‖ū‖ round 2, 10, 11, 20: " + ", ".join(
        f"{d5.spc['ubar'][r]:.3f}" for r in (2, 10, 11, 20))
        + f"; window means 2-10 {wmean(d5.spc['ubar'], 2, 10):.3f}, 11-20 {wmean(d5.spc['ubar'], 11, 20):.3f}")
    for method in METHODS:
        p = find(pairs, method, "50r")
        dd = p.diff("disp")
        above = rounds_where({r: v for r, v in dd.items() if r >= 2}, 1)
        ub = [p.spc["ubar"][r] for r in range(21, 51)]
        print(f"{method} 50r: +FedSPC dispersion above Base in rounds {above};"
              f" ‖ū‖ rounds 21-50 {min(ub):.3f}-{max(ub):.3f}, rounds 41-50 mean {wmean(p.spc['ubar'], 41, 50):.3f}")

    header("50 rounds, details")
    dl = find(pairs, "ditto", "50r")
    d = dl.diff()
    print(f"ditto: max |Δ| rounds 1-8 {max(abs(d[r]) for r in range(1, 9)):.2f}; behind in rounds "
          f"{rounds_where(d, -1)}; final {dl.spc['acc'][50]:.2f} vs {dl.base['acc'][50]:.2f};"
          f" Δ at round 20 {f(d[20])}")
    lgl = find(pairs, "lgfedavg", "50r")
    print(f"lgfedavg: best {max(lgl.spc['acc'].values()):.2f} vs {max(lgl.base['acc'].values()):.2f};"
          f" Δ over rounds 46-50 {f(wmean(lgl.diff(), 46, 50))}")

    header("Ditto's global model (15 rounds): Δ per round, personal / global")
    dg = find(pairs, "ditto", "ditto-global")
    dp, gl = dg.diff(), dg.diff("global")
    print("round " + " ".join(f"{r:6d}" for r in dg.rounds))
    print("pers. " + " ".join(f"{dp[r]:+6.2f}" for r in dg.rounds))
    print("global" + " ".join(f"{gl[r]:+6.2f}" for r in dg.rounds))
    print(f"global ahead in rounds {rounds_where(gl, 1)}; windows 2-9 global {f(wmean(gl, 2, 9))},"
          f" personal {f(wmean(dp, 2, 9))}; 10-15 global {f(wmean(gl, 10, 15))}, personal {f(wmean(dp, 10, 15))}")

    header("SCAFFOLD against FedAvg (whole model corrected), 20 rounds, seed 0")
    for a in ("0.01", "0.1", "1"):
        p = Pair("fl", 0, "cpu-cifar100-cnn-fl", f"fedavg-a{a}", f"scaffold-a{a}", "scaffold")
        d = p.diff()
        print(f"α {a}: Δ@20 {f(p.final())} ({'/'.join(map(str, p.ahead_behind()))}); "
              f"2-10 {f(wmean(d, 2, 10))}, 11-20 {f(wmean(d, 11, 20))}; ahead in rounds {rounds_where(d, 1)}")

    header("The committed CPU grid (pre partition-ordered aggregation): Δ at round 20")
    below = 0
    for method in ("fedper", "fedrep", "fedbabu", "lgfedavg", "ditto"):
        row = []
        for a in ("0.01", "0.1", "1"):
            p = Pair("grid", 0, "cpu-cifar100-cnn", f"{method}-a{a}")
            below += p.final() < 0
            row.append(f"α {a} {f(p.final())} ({'/'.join(map(str, p.ahead_behind()))})")
        print(f"{method:9s} " + "; ".join(row))
    print(f"+FedSPC below its base in {below} of 15 pairs")

    header("Same seed run twice: max |difference| of personalized accuracy over the shared rounds")
    segments = log_segments()
    for a, b, n in [(("cpu-cifar100-cnn-long", "lgfedavg"), ("cpu-cifar100-cnn-mismatch", "lgfedavg"), 20),
                    (("cpu-cifar100-cnn-long", "lgfedavg+fedspc"), ("cpu-cifar100-cnn-mismatch", "lgfedavg+fedspc"), 20),
                    (("cpu-cifar100-cnn-long", "fedrep"), ("cpu-cifar100-cnn-mismatch", "fedrep"), 20),
                    (("cpu-cifar100-cnn-long", "fedrep+fedspc"), ("cpu-cifar100-cnn-mismatch", "fedrep+fedspc"), 20),
                    (("cpu-cifar100-cnn-mismatch", "fedrep"), ("cpu-cifar100-cnn", "fedrep-a0.1"), 20),
                    (("cpu-cifar100-cnn-mismatch", "fedrep+fedspc"), ("cpu-cifar100-cnn", "fedrep+fedspc-a0.1"), 20),
                    (("cpu-cifar100-cnn-mismatch", "lgfedavg"), ("cpu-cifar100-cnn", "lgfedavg-a0.1"), 20),
                    (("cpu-cifar100-cnn-mismatch", "lgfedavg+fedspc"), ("cpu-cifar100-cnn", "lgfedavg+fedspc-a0.1"), 20),
                    (("cpu-cifar100-cnn-long", "ditto"), ("cpu-cifar100-cnn", "ditto-a0.1"), 20),
                    (("cpu-cifar100-cnn-long", "ditto+fedspc"), ("cpu-cifar100-cnn", "ditto+fedspc-a0.1"), 20),
                    (("cpu-cifar100-cnn-long", "ditto"), ("cpu-cifar100-cnn-ditto-global", "ditto"), 15),
                    (("cpu-cifar100-cnn-long", "ditto+fedspc"), ("cpu-cifar100-cnn-ditto-global", "ditto+fedspc"), 15)]:
        x, y = load(*a)["acc"], load(*b)["acc"]
        built = " vs ".join(_builds(segments[run]) if run in segments else "no log" for run in (a, b))
        print(f"{a[0]}/{a[1]} vs {b[0]}/{b[1]}, rounds 1-{n}: {max(abs(x[r] - y[r]) for r in range(1, n + 1)):.4f}"
              f" (builds {built})")

    matched_accuracy()
    e5_rerun()
    depth_seeds()
    long_pairs()
    e5_thirty()
    e5_lgfedavg(pairs)
    fedrep_cnn()
    builds(pairs)
    records()
    wall_times()
    recorded()
    grid_runs()
    resnet34_e5()
    readme_table()
    predictions()


def matched_accuracy(lo: float = 18.0, hi: float = 29.0):
    """FedRep's Δ over the rounds whose Base accuracy lies in [lo, hi] %: the range the
    narrow ResNet-34 covers in rounds 2-20. Is its small Δ only an earlier stage of
    training than the CNN's round 20?"""
    header(f"FedRep Δ at matched accuracy: rounds after the first with Base in {lo:g}-{hi:g} %")
    specs = [("CNN", s, g, b) for s, g, b in ((0, "cpu-cifar100-cnn-mismatch", "fedrep"),
                                                (1, "cpu-cifar100-cnn-seeds", "fedrep-s1"),
                                                (2, "cpu-cifar100-cnn-seeds", "fedrep-s2"))]
    specs += [("ResNet-18", s, "cpu-cifar100-resnet18-depth", f"fedrep-s{s}") for s in (0, 1, 2)]
    specs += [("ResNet-34", s, DEPTH, f"fedrep-s{s}") for s in (0, 1, 2)]
    for model, seed, grid, base in specs:
        if not (_complete(RESULTS / grid / base) and _complete(RESULTS / grid / twin(base))):
            continue
        p = Pair(model, seed, grid, base)
        d = p.diff()
        rounds = [r for r in p.rounds if r >= 2 and lo <= p.base["acc"][r] <= hi]
        if not rounds:
            print(f"{model:9s} s{seed}: no round in the range")
            continue
        vals = [d[r] for r in rounds]
        print(f"{model:9s} s{seed}: rounds {rounds_where(dict.fromkeys(rounds, 1), 1)}"
              f" (Base {p.base['acc'][rounds[0]]:.1f}-{p.base['acc'][rounds[-1]]:.1f} %):"
              f" mean Δ {f(float(np.mean(vals)))}, range {min(vals):+.2f}..{max(vals):+.2f}")


def e5_rerun():
    """FedRep's E = 5 Base: the first run against its rerun on the current code."""
    header("FedRep E = 5: the first Base against its rerun (current code), and each against +FedSPC")
    grid, rerun = "cpu-cifar100-cnn-e5", "cpu-cifar100-cnn-e5-fedrep-base"
    if not _complete(RESULTS / rerun / "fedrep"):
        print("rerun not run yet")
        return
    first, again = load(grid, "fedrep"), load(rerun, "fedrep")
    d = {r: again["acc"][r] - first["acc"][r] for r in first["acc"]}
    print(f"rerun - first: round 1 {f(d[1])}, round 20 {f(d[20])}, max |difference|"
          f" {max(abs(v) for v in d.values()):.2f} (round {max(d, key=lambda r: abs(d[r]))})")
    for name, base_grid in (("first", grid), ("rerun", rerun)):
        p = Pair("E5", 0, base_grid, "fedrep", "fedrep+fedspc", spc_grid=grid)
        print(f"{name:5s} Base: Δ@20 {f(p.final())}, round 1 {f(p.diff()[1])},"
              f" last 5 {f(wmean(p.diff(), 16, 20))}, ahead / behind {'/'.join(map(str, p.ahead_behind()))},"
              f" Base drift rounds {len(p.base['disp'])}, +FedSPC drift rounds {len(p.spc['disp'])}")



# ------------------------------------------------------------ which build made a run
# config.json of most runs committed here records no code version. What the logs hold:
# each start of a run ("=== <run> | <time> ..."), the SuperLink it used, and, the first
# time a build of the app is installed into that invocation's Flower home, the line
# "Successfully installed fedspc to .../apps/fedspc.fedspc.<version>.<hash>" (the first
# 8 hex digits of the SHA-256 of the FAB, which holds the Python files of fedspc_app,
# strategies and clients). A start without that line ran a build already installed in
# the same home: one that an earlier start on the same SuperLink printed.
_SEGMENT = re.compile(r"^=== (\S+) \| (\S+) ")
_PORT = re.compile(r"Using SuperLink: \S+ \((\S+)\)")
_APP = re.compile(r"/apps/fedspc\.fedspc\.[\d.]+\.([0-9a-f]+)")
_RESUMED = re.compile(r"\(resumed after round (\d+)\)")


def log_segments() -> dict:
    """{(grid, run): [segment, ...]}: each start that counts (a fresh start drops an
    earlier try), with its build ("app") and the round it resumed after."""
    segments = []
    for log in sorted(RESULTS.glob("*/logs/*.log")):
        if log.name == "superlink.log":
            continue
        current = None
        for line in log.read_text(errors="replace").splitlines():
            m = _SEGMENT.match(line)
            if m:
                current = {"grid": log.parent.parent.name, "run": log.stem, "start": m.group(2),
                           "port": None, "printed": None, "resumed": 0}
                segments.append(current)
                continue
            if current is None:
                continue
            for rx, key, conv in ((_PORT, "port", str), (_APP, "printed", str), (_RESUMED, "resumed", int)):
                m = rx.search(line)
                if m:
                    current[key] = conv(m.group(1))
    installed: dict = {}
    runs: dict = {}
    for seg in sorted(segments, key=lambda x: x["start"]):
        if seg["printed"]:
            seg["app"] = seg["printed"]
        else:
            known = sorted(installed.get(seg["port"], ()))
            seg["app"] = known[0] if len(known) == 1 else "one of " + "/".join(known) if known else "?"
        if seg["printed"]:
            installed.setdefault(seg["port"], set()).add(seg["printed"])
        key = (seg["grid"], seg["run"])
        if not seg["resumed"]:
            runs[key] = []
        runs.setdefault(key, []).append(seg)
    return runs


def _builds(segs) -> str:
    return ", ".join(f"rounds {s['resumed'] + 1}-: {s['app']}" if len(segs) > 1 else s["app"]
                     for s in segs)


def builds(pairs):
    """Per pair: the build of each run (from the logs), and whether the pair is one build."""
    header("Which build made each run (app hashes in the grids' logs)")
    runs = log_segments()
    specs = [(p.name(), (spec[2], spec[3]), (spec[6] if len(spec) > 6 and spec[6] else spec[2],
                                             spec[4] if len(spec) > 4 and spec[4] else twin(spec[3])))
             for p, spec in zip(pairs, PAIRS)]
    specs.insert(10, ("fedrep E5 s0 (first Base)", ("cpu-cifar100-cnn-e5", "fedrep"),
                      ("cpu-cifar100-cnn-e5", "fedrep+fedspc")))
    specs += [(f"{m} R34 s{s}", (DEPTH, f"{m}-s{s}"), (DEPTH, f"{m}+fedspc-s{s}"))
              for m in ("fedrep", "lgfedavg") for s in (0, 1, 2)]
    specs += [(f"fedrep R18 s{s}", ("cpu-cifar100-resnet18-depth", f"fedrep-s{s}"),
               ("cpu-cifar100-resnet18-depth", f"fedrep+fedspc-s{s}")) for s in (0, 1, 2)]
    specs += [(f"scaffold α {a}", ("cpu-cifar100-cnn-fl", f"fedavg-a{a}"),
               ("cpu-cifar100-cnn-fl", f"scaffold-a{a}")) for a in ("0.01", "0.1", "1")]
    specs += [(f"{m} grid α {a}", ("cpu-cifar100-cnn", f"{m}-a{a}"), ("cpu-cifar100-cnn", f"{m}+fedspc-a{a}"))
              for a in ("0.01", "0.1", "1") for m in ("fedper", "fedrep", "fedbabu", "lgfedavg", "ditto")]
    specs += [(f"{m} bf16", ("cpu-cifar100-cnn-bf16", m), ("cpu-cifar100-cnn-bf16", m + "+fedspc"))
              for m in ("fedrep", "lgfedavg")]
    specs += [(f"fedrep references {s}", ("cpu-cifar100-cnn-references", f"fedrep-{s}"),
               ("cpu-cifar100-cnn-references", f"fedrep+fedspc-{s}")) for s in ("a0.1", "c5")]
    counts = {"one build": 0, "two builds": 0, "not known": 0}
    seen = set()
    for name, base, spc in specs:
        if (base, spc) in seen:  # the same two runs under another name
            continue
        seen.add((base, spc))
        b, c = runs.get(base), runs.get(spc)
        if b is None or c is None:
            print(f"{name:28s} {'/'.join(base)}: {'no log' if b is None else _builds(b)};"
                  f" {'/'.join(spc)}: {'not run' if c is None else _builds(c)}")
            continue
        apps = [s["app"] for s in b + c]
        mid = [r for r in (b, c) if len({s["app"] for s in r}) > 1]
        verdict = ("not known" if any(a.startswith(("one of", "?")) for a in apps)
                   else "one build" if len(set(apps)) == 1 else "two builds")
        counts[verdict] += 1
        note = "; changed build mid-run: " + ", ".join(r[0]["run"] for r in mid) if mid else ""
        print(f"{name:28s} Base {_builds(b)}; +FedSPC {_builds(c)} -> {verdict}{note}")
    print(f"distinct pairs: {counts['one build']} one build, {counts['two builds']} two builds,"
          f" {counts['not known']} not known from the logs")
    print("runs started more than once (segments: first round, build; config.json's resumed-after-round):")
    for (grid, run), segs in sorted(runs.items()):
        if len(segs) > 1:
            config = json.loads((RESULTS / grid / run / "config.json").read_text())
            print(f"  {grid}/{run}: " + ", ".join(f"from round {s['resumed'] + 1} ({s['start'][:16]}) {s['app']}"
                                                   for s in segs)
                  + f"; resumed-after-round {config.get('resumed-after-round')}")


def records():
    """Rounds whose record is incomplete: no failed / dropped fields, or next to no
    bytes received (a round resumed between its training and its evaluation)."""
    header("Incomplete round records (no failed/dropped fields, or under a tenth of the usual bytes received)")
    found = 0
    for path in sorted(RESULTS.glob("*/*/metrics.json")):
        rounds = json.loads(path.read_text()).get("rounds", [])
        if not any("failed" in r for r in rounds):
            continue
        received = sorted(r.get("bytes-received", 0) for r in rounds)
        usual = received[len(received) // 2]
        for r in rounds:
            if "failed" not in r or r.get("bytes-received", 0) < usual / 10:
                found += 1
                print(f"{path.parent.parent.name}/{path.parent.name} round {r['round']}: bytes received"
                      f" {r.get('bytes-received'):,} (usual {usual:,}), sent {r.get('bytes-sent'):,},"
                      f" round-seconds {r.get('round-seconds')}, train-seconds {r.get('train-seconds')},"
                      f" images/s {r.get('images-per-second')}, failed {r.get('failed', 'blank')},"
                      f" train-dropped {r.get('train-dropped', 'blank')},"
                      f" evaluate-dropped {r.get('evaluate-dropped', 'blank')}")
    print(f"{found} such round(s) in the committed runs")


def wall_times():
    """The wall times in the grids' README tables against summary.json's wall-seconds."""
    header("Wall times in the README tables against summary.json (differences over 1 s)")
    checked, off = 0, 0
    for readme in sorted(RESULTS.glob("*/README.md")):
        for number, line in enumerate(readme.read_text().splitlines(), 1):
            link = re.search(r"\[run\]\(([^)]+)\)", line)
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            times = [c for c in cells if re.fullmatch(r"(\d+:)?\d+:\d\d", c)]
            if link and re.fullmatch(r"(\d+:)?\d+:\d\d", cells[-1]):
                run, quoted_text = (readme.parent / link.group(1)).resolve(), cells[-1]
            elif times and line.startswith("|") and (readme.parent / cells[0] / "summary.json").is_file():
                run, quoted_text = readme.parent / cells[0], times[0]  # | run | ... | h:mm:ss |
            else:
                continue
            quoted = sum(int(x) * 60 ** i for i, x in enumerate(reversed(quoted_text.split(":"))))
            recorded = json.loads((run / "summary.json").read_text())["wall-seconds"]
            checked += 1
            if abs(quoted - recorded) > 1:
                off += 1
                w = int(round(recorded))
                hms = f"{w // 3600}:{w % 3600 // 60:02d}:{w % 60:02d}" if w >= 3600 else f"{w // 60}:{w % 60:02d}"
                print(f"{readme.parent.name}/README.md line {number}: {run.parent.name}/{run.name}"
                      f" quoted {quoted_text}, recorded {hms}")
    print(f"{checked} wall times checked, {off} differ by more than 1 s")


def t_two_sided(values) -> tuple[float, float | None]:
    """One-sample t statistic of ``values`` against 0 and its two-sided p. The p is
    given for three values only (2 degrees of freedom, where Student's CDF is
    1/2 + t / (2 sqrt(2 + t^2))); None otherwise."""
    x = np.asarray(values, dtype=float)
    t = float(x.mean() / (x.std(ddof=1) / np.sqrt(len(x))))
    return t, (1 - abs(t) / np.sqrt(2 + t * t)) if len(x) == 3 else None


def depth_seeds():
    """The ResNet pairs at three seeds: mean, SD, t, seed-mean windows, late rounds."""
    header("ResNet pairs by seed: Δ at round 20, mean ± SD, t against 0; seed-mean curve")
    for model, grid in (("ResNet-34", DEPTH), ("ResNet-18", "cpu-cifar100-resnet18-depth")):
        for method in ("fedrep", "lgfedavg"):
            pairs, _ = cell_pairs([(grid, f"{method}-s{s}", None, None) for s in (0, 1, 2)])
            if len(pairs) < 2:
                continue
            _, curve, finals, sd, ahead = seed_group(pairs, method, "cell")
            t, pval = t_two_sided(finals)
            late = ", ".join(f(wmean(p.diff(), 16, 20)) for p in pairs)
            clients = [sum(p.clients()[i] for p in pairs) for i in (0, 1)]
            print(f"{model} {method:8s} seeds {[p.seed for p in pairs]} Δ {[round(v, 2) for v in finals]}"
                  f" mean {f(float(np.mean(finals)))} SD {sd:.2f} t {t:.2f}"
                  f"{f' p {pval:.2f}' if pval is not None else ''}; seed-mean curve ahead / behind"
                  f" {ahead[0]} / {ahead[1]}, 2-10 {f(wmean(curve, 2, 10))}, 11-20"
                  f" {f(wmean(curve, 11, 20))}; rounds 16-20 per seed {late};"
                  f" clients {clients[0]} / {clients[1]}")
            for p in pairs:
                depth_pair(model, p)


LONG = "cpu-cifar100-resnet34-long"


def long_pairs():
    """FedRep on the ResNet-34 over 50 rounds (P5, P11): Δ every ten rounds against the
    same seed's round-20 Δ of the depth grid (P5: "roughly as at round 20, not turning"),
    then the pair by window as depth_pair() prints it."""
    header("ResNet-34 FedRep over 50 rounds (P5, P11): Δ every ten rounds, then by window")
    pairs, missing = cell_pairs([(LONG, f"fedrep-s{s}", None, None) for s in (0, 1, 2)])
    if not pairs:
        print(f"no pair complete yet ({', '.join(missing)})")
        return
    depth = {q.seed: q for q in cell_pairs(CELLS["P3"])[0]}
    for p in pairs:
        d = p.diff()
        marks = ", ".join(f"r{r} {f(d[r])}" for r in range(10, p.last + 1, 10) if r in d)
        same = depth.get(p.seed)
        ref = (f"; the depth grid's round 20 at this seed {f(same.final())}, its round 20"
               f" here {f(d[20]) if 20 in d else 'missing'} (the same setting, run again)"
               if same else "")
        print(f"fedrep s{p.seed}: Base {p.base['acc'][p.last]:.2f} -> +FedSPC"
              f" {p.spc['acc'][p.last]:.2f} at round {p.last}; Δ {marks}; ahead / behind"
              f" {'/'.join(map(str, p.ahead_behind()))}{ref}")
        depth_pair("ResNet-34 50r", p)
    if missing:
        print(f"not complete: {', '.join(missing)}")


def depth_pair(model: str, p: Pair):
    """One ResNet pair by window: Δ, the local cost against the averaging's extra
    (Δ of a window = local fit Δ + extra, an accounting identity, not a cause), the
    cut in the shared block's dispersion, and the train-loss count."""
    d = p.diff()
    lo_r, hi_r = min(d, key=d.get), max(d, key=d.get)
    print(f"  {model} {p.method} s{p.seed}: Δ round 2 {f(d[2])}, largest {f(d[hi_r])} (round {hi_r}),"
          f" lowest {f(d[lo_r])} (round {lo_r}), max |Δ| {max(abs(v) for v in d.values()):.2f};"
          f" rounds within 1 point of Base: {sum(abs(v) <= 1 for v in d.values())} of {len(d)}")
    for lo, hi in windows(p.last):
        cost = -wmean(p.diff("before"), lo, hi)
        gb = wmean({r: p.base["acc"][r] - v for r, v in p.base["before"].items()}, lo, hi)
        gs = wmean({r: p.spc["acc"][r] - v for r, v in p.spc["before"].items()}, lo, hi)
        extra = gs - gb
        db, ds = wmean(p.base["disp"], lo, hi), wmean(p.spc["disp"], lo, hi)
        print(f"    rounds {lo}-{hi}: Δ {f(wmean(d, lo, hi))}; local cost {cost:.2f} vs averaging"
              f" extra {extra:.2f} -> extra {'larger' if extra > cost else 'smaller'} by"
              f" {abs(extra - cost):.2f}; dispersion {db:.2f} -> {ds:.2f}, cut {db / ds:.1f}x;"
              f" cosine {wmean(p.base['cos'], lo, hi):.2f} -> {wmean(p.spc['cos'], lo, hi):.2f}")
    h, lo_n, n = p.loss_higher()
    print(f"    train loss higher with FedSPC in {h} of the {n} rounds after the first (lower in {lo_n})")


def e5_lgfedavg(pairs):
    """LG-FedAvg at E = 5: every run, the seeds' windows, peaks and last rounds, and
    what the p of the three seeds rests on."""
    header("LG-FedAvg at E = 5: the four runs, the three seeds by window, and the p's caveats")
    runs = [p for p in pairs if p.method == "lgfedavg" and p.setting.startswith("E5")]
    print(f"E = 5 LG-FedAvg runs ({len(runs)}): "
          + ", ".join(f"{p.setting} s{p.seed} {f(p.final())}" for p in runs)
          + f"; ahead at round 20 in {sum(p.final() > 0 for p in runs)} of {len(runs)}")
    group = [p for p in runs if p.setting == "E5"]
    for p in group:
        d = p.diff()
        peak = max(d, key=d.get)
        w = [wmean(d, lo, hi) for lo, hi in windows(20)]
        print(f"  s{p.seed}: 2-10 {f(w[0])} -> 11-20 {f(w[1])} ({'up' if w[1] > w[0] else 'down'});"
              f" largest {f(d[peak])} (round {peak}); rounds 16-20 {f(wmean(d, 16, 20))};"
              f" round 20 {f(d[20])}")
    curve = {r: np.mean([p.diff()[r] for p in group]) for r in group[0].rounds}
    print(f"  seed mean: 2-10 {f(wmean(curve, 2, 10))} -> 11-20 {f(wmean(curve, 11, 20))};"
          f" rounds 16-20 {f(wmean(curve, 16, 20))}; round 20 {f(curve[20])}")
    cells = {(p.method, p.setting) for p in pairs if p.setting not in ("ditto-global",)}
    cells |= {(p.method, "ditto-global") for p in pairs if p.setting == "ditto-global"}
    cells |= {(m, "R34") for m in ("fedrep", "lgfedavg")}
    print(f"  cells (method x setting) the study has measured: {len(cells)}"
          f" ({len(cells) - 2} on the CNN, 2 on the ResNet-34); this one was followed up"
          f" after seed 0; seeds 0 and 1 came before the reading R2, seed 2 after it (P1);"
          f" the 30 clients are 3 runs' clients, not 30 independent draws")


def fedrep_cnn():
    """FedRep + FedSPC against FedRep on the CNN in every setting committed: is it
    behind in each, and on how many seeds, against the texts' 2-point rule?"""
    header("FedRep on the CNN, every setting committed: Δ at the last round, seeds, the 2-point rule")
    rows = [("starting point, E = 1, α = 0.1", [("cpu-cifar100-cnn-mismatch", "fedrep"),
                                                ("cpu-cifar100-cnn-seeds", "fedrep-s1"),
                                                ("cpu-cifar100-cnn-seeds", "fedrep-s2")]),
            ("Table 3 grid, α = 0.01", [("cpu-cifar100-cnn", "fedrep-a0.01")]),
            ("Table 3 grid, α = 0.1", [("cpu-cifar100-cnn", "fedrep-a0.1")]),
            ("Table 3 grid, α = 1", [("cpu-cifar100-cnn", "fedrep-a1")]),
            ("E = 5 (Base rerun)", [("cpu-cifar100-cnn-e5-fedrep-base", "fedrep", "fedrep+fedspc",
                                     None, "cpu-cifar100-cnn-e5")]),
            ("BatchNorm", [("cpu-cifar100-cnn-bn", "fedrep")]),
            ("50 rounds", [("cpu-cifar100-cnn-long", "fedrep")]),
            ("bf16 + channels-last", [("cpu-cifar100-cnn-bf16", "fedrep")]),
            ("5 classes per client, bf16", [("cpu-cifar100-cnn-references", "fedrep-c5")])]
    for name, specs in rows:
        ps = [Pair("cnn", 0, spec[0], *spec[1:]) for spec in specs]
        ds = [p.final() for p in ps]
        seeds = "three seeds" if len(ds) == 3 else "one seed"
        rule = "" if len(ds) > 1 else (" (under the 2-point rule)" if abs(ds[0]) < 2 else " (2 points or more)")
        print(f"{name:32s} {', '.join(f(d) for d in ds)} at round {ps[0].last}; {seeds}{rule}")
    first = [json.loads((RESULTS / "fedrep-cifar100-cnn-cpu" / run / "summary.json").read_text())
             for run in ("fedrep", "fedrep+fedspc")]
    d30 = 100 * (first[1]["final-accuracy"] - first[0]["final-accuracy"])
    print(f"{'30 rounds (the first pair)':32s} {f(d30)} at round {first[0]['final-round']}; one seed"
          f" ({'under the 2-point rule' if abs(d30) < 2 else '2 points or more'}; metrics.csv only)")
    loc = Pair("ref", 0, "cpu-cifar100-cnn-references", "fedrep-a0.1", "local-a0.1")
    print(f"local against FedRep, α = 0.1 (bf16, one seed): {loc.spc['acc'][20]:.2f} vs"
          f" {loc.base['acc'][20]:.2f} ({f(loc.final())}), ahead in {loc.ahead_behind()[0]} of 20 rounds")


# The cells of PREDICTIONS.md: (id, grid, Base, +FedSPC, grid of the +FedSPC run).
DEPTH = "cpu-cifar100-resnet34-depth"
CELLS = {
    "P1": [("cpu-cifar100-cnn-e5-seeds", "lgfedavg-s2", None, None)],
    "P2": [("cpu-cifar100-cnn-e5-fedrep-base", "fedrep", "fedrep+fedspc", "cpu-cifar100-cnn-e5")],
    "P3": [(DEPTH, f"fedrep-s{s}", None, None) for s in (0, 1, 2)],
    "P4": [(DEPTH, f"lgfedavg-s{s}", None, None) for s in (0, 1, 2)],
    "P5": [("cpu-cifar100-resnet34-long", "fedrep-s0", None, None)],
    "P6": [("cpu-cifar100-resnet34-e5", "fedrep-s0", None, None)],
    "P8": [("cpu-cifar100-resnet18-depth", f"fedrep-s{s}", None, None) for s in (0, 1, 2)],
    "P9": [("cpu-cifar100-resnet34-e5", f"fedrep-s{s}", None, None) for s in (1, 2)],
    "P10": [("cpu-cifar100-resnet34-e5", f"lgfedavg-s{s}", None, None) for s in (0, 1, 2)],
    "P11": [("cpu-cifar100-resnet34-long", f"fedrep-s{s}", None, None) for s in (1, 2)],
    "P12": [("cpu-cifar100-resnet34-e5-30", f"lgfedavg-s{s}", None, None) for s in (0, 1, 2)],
    "P13": [("cpu-cifar100-resnet34-e5-30", "fedrep-s0", None, None)],
}


def late_window(p) -> float:
    """P12, P13: the mean Δ over rounds 21-30."""
    return wmean(p.diff(), 21, 30)


def e5_thirty():
    """E = 5 over 30 rounds (P12, P13): Δ every five rounds, the rounds ahead / behind,
    windows, where the gap settles (rounds 21-30, with the seeds' spread); and each run's
    first ten rounds against the committed 10-round run of the same cell and seed."""
    header("ResNet-34 at E = 5 over 30 rounds (P12, P13): Δ every five rounds, the"
           " rounds 21-30 mean, the first ten rounds against the 10-round runs")
    for pid in ("P12", "P13"):
        pairs, missing = cell_pairs(CELLS[pid])
        for p in pairs:
            d = p.diff()
            marks = ", ".join(f"r{r} {f(d[r])}" for r in (5, 10, 15, 20, 25, 30) if r in d)
            print(f"{p.method} s{p.seed}: Base {p.base['acc'][p.last]:.2f} -> +FedSPC"
                  f" {p.spc['acc'][p.last]:.2f} at round {p.last}; Δ {marks}; ahead / behind"
                  f" {'/'.join(map(str, p.ahead_behind()))}; rounds 21-30 {f(late_window(p))}")
            depth_pair("ResNet-34 E5 30r", p)
            ten = RESULTS / "cpu-cifar100-resnet34-e5"
            for name, run in ((f"{p.method}-s{p.seed}", p.base),
                              (twin(f"{p.method}-s{p.seed}"), p.spc)):
                if _complete(ten / name):
                    old = load("cpu-cifar100-resnet34-e5", name)["acc"]
                    gaps = [abs(run["acc"][r] - old[r]) for r in range(1, 11)]
                    print(f"    {name} rounds 1-10 against the 10-round run: round 10"
                          f" {run['acc'][10]:.2f} vs {old[10]:.2f}, largest difference"
                          f" {max(gaps):.2f} (round {1 + int(np.argmax(gaps))})")
        if len(pairs) > 1:
            late = [late_window(p) for p in pairs]
            print(f"  {pid} rounds 21-30 by seed: {', '.join(f(v) for v in late)};"
                  f" mean {f(float(np.mean(late)))}, SD {np.std(late, ddof=1):.2f}")
        if missing:
            print(f"  {pid} not complete: {', '.join(missing)}")


def cell_pairs(specs):
    """The pairs of one prediction whose two runs are complete; the names of the missing."""
    done, missing = [], []
    for spec in specs:
        grid, base, spc, spc_grid = spec
        paths = _spec_paths(spec)
        if all(_complete(path) for path in paths):
            done.append(Pair("cell", _seed(base), grid, base, spc, spc_grid=spc_grid))
        else:
            state = ["committed" if _complete(path) else "not run" for path in paths]
            missing.append(f"{grid}/{base} {state[0]}, {spc or twin(base)} {state[1]}")
    return done, missing


def _spec_paths(spec) -> list:
    grid, base, spc, spc_grid = spec
    return [RESULTS / grid / base, RESULTS / (spc_grid or grid) / (spc or twin(base))]


def _seed(base: str) -> int:
    return int(base.rpartition("-s")[2]) if "-s" in base else 0


def _complete(path: Path) -> bool:
    summary = path / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("complete") is True


def _verdict(ok: bool | None) -> str:
    """None: the rule needs seeds that are not run yet."""
    return "waits for three seeds" if ok is None else "HIT" if ok else "MISS"


# ------------------------------------------------------------ what config.json records
def run_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def code_of(config: dict) -> str:
    """The code version a run's config.json records, in the grids' READMEs' words."""
    code = config.get("code")
    if not code:
        return "not recorded"
    return (f"git {code['git-commit'][:8]}, source {code['source-sha256'][:8]},"
            f" {'dirty' if code['dirty'] else 'clean'}")


def precision_of(config: dict) -> str:
    """The precision a run trained in: the resolved one where config.json records it,
    else the run-config's setting; a run-config without the key predates the option
    (fp32 was the only precision then)."""
    rc = config.get("run-config", {})
    rec = config.get("precision")
    value = (rec.get("resolved") if isinstance(rec, dict) else None) or rc.get("precision")
    if value in (None, "auto"):
        value = "fp32 (before the precision option)" if value is None else "auto, not resolved"
    return value + (" + channels-last" if rc.get("channels-last") else "")


def recorded():
    """Per grid: how many runs' config.json records the code version, and the precision
    the runs trained in."""
    header("What config.json records, per grid: code version (runs with it / runs), precision")
    total, with_code = 0, 0
    for grid in sorted(d for d in RESULTS.iterdir() if d.is_dir()):
        runs = sorted(r for r in grid.iterdir() if (r / "config.json").is_file())
        if not runs:
            continue
        configs = [run_config(r) for r in runs]
        coded = [r.name for r, c in zip(runs, configs) if c.get("code")]
        precisions = sorted({precision_of(c) for c in configs})
        codes = sorted({code_of(c) for c in configs if c.get("code")})
        total += len(runs)
        with_code += len(coded)
        print(f"{grid.name:32s} {len(coded):2d} / {len(runs):2d} with a code version"
              f"{' (' + '; '.join(codes) + ')' if codes else ''}; precision {', '.join(precisions)}")
        dirty = [r.name for r, c in zip(runs, configs) if c.get("code", {}).get("dirty")]
        if dirty and len(dirty) < len(coded):
            print(f"{'':32s} dirty: {', '.join(dirty)}; clean:"
                  f" {', '.join(n for n in coded if n not in dirty)}")
    print(f"{with_code} of the {total} committed runs record their code version in config.json")


def _seconds(w: float) -> str:
    w = int(round(w))
    return f"{w // 3600}:{w % 3600 // 60:02d}:{w % 60:02d}" if w >= 3600 else f"{w // 60}:{w % 60:02d}"


RESNET_GRIDS = ("cpu-cifar100-resnet18-depth", DEPTH, "cpu-cifar100-resnet34-e5", LONG)


def grid_runs():
    """Each run of the ResNet grids, as their READMEs' tables and machine notes give it:
    the last round's accuracy, wall time, code version, segments, machine, the seconds
    of each round, and the shared block's update dispersion over rounds 2 to the last."""
    header("ResNet grids, run by run (config.json, summary.json, metrics.json, logs)")
    segments = log_segments()
    for grid in RESNET_GRIDS:
        for run in sorted(r for r in (RESULTS / grid).iterdir() if (r / "summary.json").is_file()):
            config, summary = run_config(run), json.loads((run / "summary.json").read_text())
            rounds = json.loads((run / "metrics.json").read_text())["rounds"]
            segs = segments.get((grid, run.name), [])
            starts = ", ".join(str(s["resumed"] + 1) for s in segs) or "no log"
            disp = [r["drift-dispersion"] for r in rounds
                    if r["round"] >= 2 and r.get("drift-dispersion") is not None]
            low = min(range(len(disp)), key=disp.__getitem__) + 2 if disp else None
            print(f"{grid}/{run.name}: round {summary['final-round']}"
                  f" {100 * summary['final-accuracy']:.2f} %, wall {_seconds(summary['wall-seconds'])};"
                  f" {code_of(config)}; resumed-after-round {config.get('resumed-after-round')};"
                  f" segments from rounds {starts}; machine"
                  f" {config.get('machine', {}).get('cpu', 'not recorded')}")
            print("    seconds a round: " + " ".join(f"r{r['round']} {r['round-seconds']:.0f}"
                                                     for r in rounds))
            if disp:
                print(f"    dispersion rounds 2-{rounds[-1]['round']}: {min(disp):.2f}-{max(disp):.2f}"
                      f" (mean {np.mean(disp):.2f}; lowest at round {low}, last {disp[-1]:.2f})")


def resnet34_e5():
    """The ResNet-34 E = 5 pairs round by round: Δ each round, the clients ahead /
    behind at the last round with their range, accuracy before aggregation there."""
    header("ResNet-34 at E = 5, pair by pair: Δ each round, clients, accuracy before aggregation")
    for pid in ("P6", "P9", "P10"):
        for p in cell_pairs(CELLS[pid])[0]:
            d = p.diff()
            client = {k: p.spc["clients"][k] - v for k, v in p.base["clients"].items()}
            ahead, behind = p.clients()
            before = (f"; before aggregation at round {p.last} {p.spc['before'][p.last]:.2f} vs"
                      f" {p.base['before'][p.last]:.2f}" if p.last in p.base["before"] else "")
            print(f"{pid} {p.method} s{p.seed}: Δ " + ", ".join(f"r{r} {f(v)}" for r, v in d.items())
                  + f"; clients ahead / behind {ahead} / {behind} ({min(client.values()):+.2f} to"
                  f" {max(client.values()):+.2f}){before}")


# ------------------------------------------------------------ the README's table
# The rows of the top-level README's "When does FedSPC help?" table, in its order:
# (model, the shared block's words, E) -> the pair of each seed 0, 1, 2 as (grid, Base,
# +FedSPC, grid of the +FedSPC run). A row is rendered once all three pairs are complete.
# The rows of the README's table: (model, shared block, E) and the pairs of its seeds in
# seed order. Rows of one setting at two horizons are two rows. A row shows once two of
# its seeds are complete, naming the seeds still to run.
README_CELLS = [
    (("small CNN", "body (FedRep)", 1), [("cpu-cifar100-cnn-mismatch", "fedrep", None, None),
                                         ("cpu-cifar100-cnn-seeds", "fedrep-s1", None, None),
                                         ("cpu-cifar100-cnn-seeds", "fedrep-s2", None, None)]),
    (("small CNN", "head (LG-FedAvg)", 1), [("cpu-cifar100-cnn-mismatch", "lgfedavg", None, None),
                                            ("cpu-cifar100-cnn-seeds", "lgfedavg-s1", None, None),
                                            ("cpu-cifar100-cnn-seeds", "lgfedavg-s2", None, None)]),
    (("small CNN", "head (LG-FedAvg)", 5), [("cpu-cifar100-cnn-e5", "lgfedavg", None, None),
                                            ("cpu-cifar100-cnn-e5-seeds", "lgfedavg-s1", None, None),
                                            ("cpu-cifar100-cnn-e5-seeds", "lgfedavg-s2", None, None)]),
    (("ResNet-34, ¼ width", "body (FedRep)", 1), CELLS["P3"]),
    (("ResNet-34, ¼ width", "body (FedRep)", 1), CELLS["P5"] + CELLS["P11"]),
    (("ResNet-34, ¼ width", "body (FedRep)", 5), [("cpu-cifar100-resnet34-e5", f"fedrep-s{s}", None, None)
                                                 for s in (0, 1, 2)]),
    (("ResNet-34, ¼ width", "head (LG-FedAvg)", 1), CELLS["P4"]),
    (("ResNet-34, ¼ width", "head (LG-FedAvg)", 5), CELLS["P10"]),
    (("ResNet-34, ¼ width", "head (LG-FedAvg)", 5), CELLS["P12"]),
    (("ResNet-18, ¼ width", "body (FedRep)", 1), CELLS["P8"]),
]
# The flags a reader needs beside a seed's Δ, with the legend's words.
FLAGS = {
    "b": "the pair was made by two builds of the app",
    "r": "a run of the pair was paused and resumed",
    "e": "a run of the pair has a round that was only evaluated after a resume",
    "n": "config.json records no code version (the logs give the app's hash)",
    "u": "the logs cannot tell which build made the pair",
    "m": "the pair's runs were made on two kinds of CPU",
}
SUPERSCRIPT = {"b": "ᵇ", "r": "ʳ", "e": "ᵉ", "n": "ⁿ", "u": "ᵘ", "m": "ᵐ"}
README = RESULTS.parents[1] / "README.md"
BEGIN, END = "<!-- when-table:begin -->", "<!-- when-table:end -->"


def _evaluation_only(path: Path) -> list:
    """Rounds recorded with under a tenth of the run's usual bytes received and no
    failure: trained before a stop, only evaluated by the resumed run."""
    rounds = json.loads((path / "metrics.json").read_text())["rounds"]
    received = sorted(r.get("bytes-received", 0) for r in rounds)
    usual = received[len(received) // 2]
    return [r["round"] for r in rounds
            if not r.get("failed") and r.get("bytes-received", 0) < usual / 10]


def pair_flags(grid, base, spc, spc_grid, segments=None) -> str:
    """The flags of one pair (letters of FLAGS), from config.json, metrics.json and logs."""
    segments = log_segments() if segments is None else segments
    keys = [(grid, base), (spc_grid or grid, spc or twin(base))]
    paths = [RESULTS / g / r for g, r in keys]
    configs = [run_config(p) for p in paths]
    flags = ""
    codes = [c.get("code") for c in configs]
    apps = [s["app"] for k in keys for s in segments.get(k, [])]
    # A build is known from config.json where both runs record it, else from the logs.
    unknown = not all(codes) and (not apps or any(a.startswith(("one of", "?")) for a in apps))
    two = (all(codes) and len({(c["git-commit"], c["source-sha256"]) for c in codes}) > 1) or (
        not unknown and len({a for a in apps if not a.startswith(("one of", "?"))}) > 1)
    flags += "b" if two else ""
    if any(c.get("resumed-after-round") or len(segments.get(k, [])) > 1
           for c, k in zip(configs, keys)):
        flags += "r"
    flags += "e" if any(_evaluation_only(p) for p in paths) else ""
    flags += "n" if not all(codes) else ""
    flags += "u" if unknown else ""
    flags += "m" if len(set().union(*(_cpus(c) for c in configs))) > 1 else ""
    return flags


def _cpus(config: dict) -> set:
    """The CPU models a run was made on, from config.json's segments (or its one machine
    where it records no segments); empty where it records neither."""
    machines = [s.get("machine") for s in config.get("segments", [])] or [config.get("machine")]
    return {m["cpu"] for m in machines if m and m.get("cpu")}


def _minus(text: str) -> str:
    return text.replace("-", "−")


def when_table() -> str:
    """The README's "When does FedSPC help?" table, rendered from the runs: per cell the
    horizon, Δ at the last round (mean ± sample SD, then each seed's Δ with its flags)
    and the seed-mean curve's rounds ahead / behind; a legend of the flags used."""
    segments = log_segments()
    lines = ["| Model | Shared block | E | α | Rounds | Δ ± SD (seeds 0, 1, 2) | Rounds ahead / behind |",
             "|---|---|---:|---:|---:|---|---:|"]
    used = set()
    for (model, block, epochs), specs in README_CELLS:
        done = [spec for spec in specs if all(_complete(path) for path in _spec_paths(spec))]
        if len(done) < 2:
            continue
        pairs, _ = cell_pairs(done)
        _, _, finals, sd, (a, b) = seed_group(pairs, pairs[0].method, "cell")
        alphas = {run_config(RESULTS / spec[0] / spec[1])["run-config"]["alpha"] for spec in done}
        seeds = []
        for p, spec in zip(pairs, done):
            flags = pair_flags(*spec, segments=segments)
            used |= set(flags)
            seeds.append(f(p.final()) + "".join(SUPERSCRIPT[x] for x in flags))
        todo = [str(_seed(spec[1])) for spec in specs if spec not in done]
        todo = f"; seed{'s' * (len(todo) > 1)} {', '.join(todo)} to run" if todo else ""
        lines.append(f"| {model} | {block} | {epochs} | {'/'.join(f'{x:g}' for x in sorted(alphas))}"
                     f" | {pairs[0].last} | {_minus(f(float(np.mean(finals))))} ± {sd:.2f}"
                     f" ({_minus(', '.join(seeds))}{todo}) | {a} / {b} |")
    legend = "; ".join(f"{SUPERSCRIPT[x]} {FLAGS[x]}" for x in FLAGS if x in used)
    return "\n".join(lines) + ("\n\n" + legend[0].upper() + legend[1:] + "." if legend else "")


def readme_block(text: str) -> str:
    """The text between the README's when-table markers (stripped)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers around the"
                         f" 'When does FedSPC help?' table")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write_readme_table():
    """Replace the README's block between the markers with the rendered table."""
    text = README.read_text()
    readme_block(text)
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + BEGIN + "\n" + when_table() + "\n" + END + rest.split(END, 1)[1])


def readme_table():
    """The README's "When does FedSPC help?" table against the one the runs give."""
    header("README.md, 'When does FedSPC help?': the table the runs give, and the README's block")
    table = when_table()
    print(table)
    try:
        block = readme_block(README.read_text())
    except ValueError as err:
        print(err)
        return
    print("README.md's block " + ("matches" if block == table else
                                  "DIFFERS (python docs/results/regime-study/recompute.py --readme rewrites it)"))


def predictions():
    """Score each prediction by the rule PREDICTIONS.md states, on the runs there are."""
    header("Predictions (PREDICTIONS.md), scored on the committed runs")
    # Each rule: (the prediction's words, {verdict name: test of the per-seed Δ list}).
    rules = {
        "P1": ("positive, +0.5 to +3", {"sign": lambda ds: all(d > 0 for d in ds),
                                        "size": lambda ds: all(0.5 <= d <= 3 for d in ds)}),
        "P2": ("negative, -2 to -4", {"sign": lambda ds: all(d < 0 for d in ds),
                                      "size": lambda ds: all(-4 <= d <= -2 for d in ds)}),
        "P3": ("negative at every seed, -0.5 to -3",
               {"sign": lambda ds: all(d < 0 for d in ds),
                "size": lambda ds: all(-3 <= d <= -0.5 for d in ds)}),
        "P4": ("no detectable effect: mean within ±1, signs mixed across seeds",
               {"effect": lambda ds: abs(np.mean(ds)) <= 1
                and (len(ds) < 3 or min(ds) < 0 < max(ds))}),
        "P5": ("negative at round 50", {"sign": lambda ds: all(d < 0 for d in ds)}),
        "P6": ("negative, not smaller in size than at E = 1 (same seed)", {}),
        "P8": ("no effect: within ±0.5 at every seed",
               {"size": lambda ds: all(abs(d) <= 0.5 for d in ds)}),
        "P9": ("negative, and at or below the same seed's E = 1 Δ (P6's rule at each seed)", {}),
        "P10": ("positive at every seed, +0.5 to +3, seed mean above the E = 1 mean",
                {"sign": lambda ds: all(d > 0 for d in ds),
                 "size": lambda ds: all(0.5 <= d <= 3 for d in ds),
                 "mean": lambda ds: None if len(ds) < 3 else np.mean(ds) > np.mean(
                     [q.final() for q in cell_pairs(CELLS["P4"])[0]])}),
        "P11": ("no effect: within ±0.5 at round 50 at each seed",
                {"size": lambda ds: all(abs(d) <= 0.5 for d in ds)}),
        "P12": (("the mean Δ over rounds 21-30 in (0, +1.5] at each seed, below the same"
                 " run's round-10 Δ"), {}),
        "P13": ("the mean Δ over rounds 21-30 in [-1, 0)", {}),
    }
    for pid, specs in CELLS.items():
        pairs, missing = cell_pairs(specs)
        text, tests = rules[pid]
        if not pairs:
            print(f"{pid}: predicted {text}; no pair complete yet ({', '.join(missing)})")
            continue
        ds = [p.final() for p in pairs]
        sd = f", SD {np.std(ds, ddof=1):.2f}" if len(ds) > 1 else " (one seed)"
        measured = ", ".join(f"s{p.seed} {f(p.final())} at round {p.last}"
                             f" ({'/'.join(map(str, p.ahead_behind()))} rounds ahead/behind)"
                             for p in pairs)
        verdicts = {name: test(ds) for name, test in tests.items()}
        if pid in ("P6", "P9"):
            e1 = {q.seed: q.final() for q in cell_pairs(CELLS["P3"])[0]}
            verdicts = {"sign": all(d < 0 for d in ds),
                        "size": all(q.seed in e1 and q.final() <= e1[q.seed] for q in pairs)}
            measured += "; E = 1 at the same seed: " + ", ".join(
                f"s{q.seed} {f(e1[q.seed]) if q.seed in e1 else 'not run'}" for q in pairs)
        if pid in ("P12", "P13"):
            late = [late_window(q) for q in pairs]
            verdicts = ({"sign": all(v > 0 for v in late), "size": all(v <= 1.5 for v in late),
                         "narrows": all(late_window(q) < q.diff()[10] for q in pairs)}
                        if pid == "P12" else
                        {"sign": all(v < 0 for v in late), "size": all(v >= -1 for v in late)})
            measured += "; rounds 21-30: " + ", ".join(
                f"s{q.seed} {f(late_window(q))} (round 10 {f(q.diff()[10])})" for q in pairs)
        status = "partial (" + ", ".join(missing) + "); " if missing else ""
        scored = ", ".join(f"{name} {_verdict(ok)}" for name, ok in verdicts.items())
        print(f"{pid}: predicted {text}. {status}measured {measured}; mean {f(float(np.mean(ds)))}{sd}"
              f" -> {scored}{' so far' if missing else ''}")
    print("P7: the correction lowers the shared block's update dispersion in rounds 2-10, and"
          " +FedSPC's train loss is higher in at least 90 % of the rounds after the first")
    scored = {"P7": [], "P8": [], "later": []}
    for pid in ("P3", "P4", "P5", "P6", "P8", "P9", "P10", "P11", "P12", "P13"):
        if pid == "P9":
            print("  P7's rule on the ResNet-34 pairs written after it (not part of P7's score):")
        for p in cell_pairs(CELLS[pid])[0]:
            db, ds_ = wmean(p.base["disp"], 2, 10), wmean(p.spc["disp"], 2, 10)
            h, _, n = p.loss_higher()
            ok = ds_ < db and h >= 0.9 * n
            scored["P7" if pid in ("P3", "P4", "P5", "P6") else pid if pid == "P8" else "later"].append(ok)
            print(f"  {pid} {p.method} s{p.seed}: dispersion rounds 2-10 {db:.2f} -> {ds_:.2f};"
                  f" train loss higher in {h} of {n} rounds -> {_verdict(ok)}")
    print("  P7 hits on {} of the {} ResNet-34 pairs it covers (P3-P6); its rule holds on {} of the"
          " {} ResNet-18 pairs (P8) and {} of the {} ResNet-34 pairs written after it".format(
              *(x for k in ("P7", "P8", "later") for x in (sum(scored[k]), len(scored[k])))))


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--readme"]:
        write_readme_table()
    else:
        main()
