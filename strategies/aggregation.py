"""How the server combines the clients' shared blocks: the mean, and rules that a few
lying clients cannot steer.

``mean`` and ``weighted`` are the paper's unweighted mean and the sample-weighted
mean (:func:`mean_arrays`). The robust rules bound what f faulty or malicious
clients among the n accepted replies can do to the aggregate:

* ``median``: the coordinate-wise median (Yin et al., 2018);
* ``trimmed-mean``: per coordinate, the mean after dropping the ``trim-fraction``
  largest and smallest values (Flower's :func:`trim_mean`);
* ``krum``: the one update closest to its n − f − 2 nearest neighbours (Blanchard et
  al., 2017); ``multi-krum``: the mean of the m updates Krum scores best (Flower's
  :func:`select_multikrum`, on copies of the updates).

Krum scores the clients by their updates of the shared trainable parameters;
the selected clients' whole shared blocks are then averaged. The coordinate rules
apply to every floating-point shared entry (BatchNorm statistics too); integer
counters keep the rounded mean. Every rule is unweighted. With FedSPC the update
of u_bar follows the same rule (:func:`robust_reference_sum`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedspc_app.core.records import ArrayDict

AGGREGATIONS = ("mean", "weighted", "median", "trimmed-mean", "krum", "multi-krum")
ROBUST = ("median", "trimmed-mean", "krum", "multi-krum")


def mean_arrays(updates: Sequence[ArrayDict], weights: Sequence[float]) -> ArrayDict:
    """Weighted mean of ``updates`` key by key, accumulated in float64.

    Each result keeps the dtype of the inputs; integer entries (BatchNorm's
    ``num_batches_tracked``) are rounded rather than turned into floats.
    """
    total = float(sum(weights))
    out: ArrayDict = {}
    for key, first in updates[0].items():
        acc = np.zeros(np.shape(first), dtype=np.float64)
        for update, weight in zip(updates, weights):
            acc += np.asarray(update[key], dtype=np.float64) * (weight / total)
        if np.issubdtype(first.dtype, np.integer):
            out[key] = np.rint(acc).astype(first.dtype)
        else:
            out[key] = acc.astype(first.dtype)
    return out


@dataclass(frozen=True)
class AggregationRule:
    """One of :data:`AGGREGATIONS` with its parameters.

    Parameters
    ----------
    name : str
        The rule.
    trim_fraction : float (default: 0.1)
        ``trimmed-mean``: the fraction cut at each end, in [0, 0.5).
    byzantine : int (default: 0)
        ``krum``/``multi-krum``: f, the number of faulty clients to tolerate.
    krum_select : int (default: 0, meaning n − f)
        ``multi-krum``: how many of the best-scored updates are averaged.
    """

    name: str = "mean"
    trim_fraction: float = 0.1
    byzantine: int = 0
    krum_select: int = 0

    def __post_init__(self) -> None:
        if self.name not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.name!r}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.byzantine < 0 or self.krum_select < 0:
            raise ValueError("byzantine-clients and krum-select must be >= 0")

    @property
    def robust(self) -> bool:
        return self.name in ROBUST

    def selected(self, updates: Sequence[ArrayDict], keys: Sequence[str]) -> list[int]:
        """The indices of the updates that enter the aggregate: all of them, except for
        Krum and Multi-Krum, which score the updates of ``keys``."""
        if self.name not in ("krum", "multi-krum") or len(updates) == 1:
            return list(range(len(updates)))
        count = 1 if self.name == "krum" else (self.krum_select
                                               or len(updates) - self.byzantine)
        count = max(1, min(count, len(updates)))
        # Flower's selection reads the first ArrayRecord of each RecordDict: copies
        # holding only the scored arrays, mapped back by identity.
        contents = [RecordDict({"arrays": ArrayRecord(
            {key: Array(np.ascontiguousarray(update[key])) for key in keys})})
            for update in updates]
        chosen = select_multikrum(contents, num_malicious_nodes=self.byzantine,
                                  num_nodes_to_select=count)
        index = {id(content): i for i, content in enumerate(contents)}
        return sorted(index[id(content)] for content in chosen)

    def combine(self, arrays: Sequence[ArrayDict], weights: Sequence[float]) -> ArrayDict:
        """The aggregate of ``arrays`` (already restricted to Krum's selection): the
        (weighted) mean, or the coordinate-wise median or trimmed mean."""
        if self.name in ("mean", "weighted", "krum", "multi-krum"):
            return mean_arrays(arrays, weights if self.name == "weighted"
                               else [1.0] * len(arrays))
        out: ArrayDict = {}
        for key, first in arrays[0].items():
            if not np.issubdtype(first.dtype, np.floating):
                out[key] = mean_arrays([{key: a[key]} for a in arrays],
                                       [1.0] * len(arrays))[key]
                continue
            stacked = np.stack([np.asarray(a[key]) for a in arrays])
            value = (np.median(stacked, axis=0) if self.name == "median"
                     else trim_mean(stacked, self.trim_fraction))
            out[key] = np.asarray(value, dtype=first.dtype)
        return out


def robust_reference_sum(rule: AggregationRule, changes: Sequence[ArrayDict],
                         selected: Sequence[int], count: int) -> ArrayDict:
    """What replaces ``sum_{k in S} (u_k' - u_k)`` in u_bar's update under a robust
    rule: ``count`` (the number of accepted replies) times the rule's centre of the
    reference changes: the mean of Krum's selection, or the coordinate-wise median or
    trimmed mean. For the plain mean it equals the sum."""
    chosen = [changes[i] for i in selected]
    centre = rule.combine(chosen, [1.0] * len(chosen))
    return {key: (np.asarray(value, dtype=np.float64) * count) for key, value in centre.items()}
