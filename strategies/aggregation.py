"""How the server combines the clients' shared blocks: the mean, and rules that a few
lying clients cannot steer.

``mean`` and ``weighted`` are the paper's unweighted mean and the sample-weighted
mean (:func:`mean_arrays`). The robust rules bound what f faulty or malicious
clients among the n accepted replies can do to the aggregate:

* ``median``: the coordinate-wise median (Yin et al., 2018);
* ``trimmed-mean``: per coordinate, the mean after dropping the ``trim-fraction``
  largest and smallest values (Flower's :func:`trim_mean` cuts floor(β·n) a side),
  and never fewer than ``byzantine-clients`` f a side: max(floor(β·n), f) when
  f > 0, so that replies that drop out do not leave the attackers untrimmed
  (β = 0.2 trims nothing of n < 5). A round whose n replies cannot lose f a side
  and keep one value (n ≤ 2f) fails with the reason (:meth:`AggregationRule.shortfall`):
  the attackers may then be half the replies, and no coordinate rule bounds them;
* ``krum``: the one update closest to its n − f − 2 nearest neighbours (Blanchard et
  al., 2017); ``multi-krum``: the mean of the m updates Krum scores best (Flower's
  :func:`select_multikrum`, on copies of the updates).

Under a robust rule ``robust-norm-bound = "median"`` first scales each client's
update of the shared trainable parameters to at most the median of the round's
update norms (norm bounding, Sun et al., 2019, "Can you really backdoor federated
learning?", with the bound taken from the round's own replies: fewer than half of
them cannot raise it): :meth:`AggregationRule.bound_factors`, :func:`bounded`. A
few clients sending scaled-up updates then send, to the rule, updates of an honest
norm; the rule then deals with their direction. The mean and the weighted mean never
bound (Algorithm 1).

Krum scores the clients by their updates of the shared trainable parameters;
the selected clients' whole shared blocks are then averaged. The coordinate rules
apply to every floating-point shared entry (BatchNorm statistics too); integer
counters keep the rounded mean. Every robust rule is unweighted. With FedSPC the
update of u_bar follows the same rule, the weighted mean's too
(:func:`robust_reference_sum`, or under a robust rule the centre of the
tracked u_k of :mod:`strategies.references`, which Krum scores themselves), and
:meth:`AggregationRule.centre_rows` is the rule on one block of coordinates of many
clients, for centres computed block by block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedspc_app.core.config import AGGREGATIONS, NORM_BOUNDS, resolve_norm_bound
from fedspc_app.core.config import ROBUST_AGGREGATIONS as ROBUST
from fedspc_app.core.records import ArrayDict

__all__ = ["AGGREGATIONS", "NORM_BOUNDS", "ROBUST", "AggregationRule", "bounded",
           "krum_choice", "mean_arrays", "robust_reference_sum", "trimmed_mean"]


CHUNK = 1 << 14  # entries of a key accumulated at once (the buffers stay in cache)


def mean_arrays(updates: Sequence[ArrayDict], weights: Sequence[float]) -> ArrayDict:
    """Weighted mean of ``updates`` key by key, accumulated in float64.

    Each result keeps the dtype of the inputs; integer entries (BatchNorm's
    ``num_batches_tracked``) are rounded rather than turned into floats. Every entry
    is ``sum_k float64(update_k) * (w_k / total)`` added in the updates' order, a chunk
    of a key at a time (the same arithmetic as whole arrays, without their float64
    copies).
    """
    total = float(sum(weights))
    shares = [weight / total for weight in weights]
    out: ArrayDict = {}
    term = np.empty(CHUNK)
    for key, first in updates[0].items():
        flats = [np.ravel(update[key]) for update in updates]
        acc = np.zeros(first.size, dtype=np.float64)
        for start in range(0, first.size, CHUNK):
            stop = min(first.size, start + CHUNK)
            part, buffer = acc[start:stop], term[:stop - start]
            for flat, share in zip(flats, shares):
                np.multiply(flat[start:stop], share, out=buffer, dtype=np.float64)
                part += buffer
        acc = acc.reshape(np.shape(first))
        if np.issubdtype(first.dtype, np.integer):
            out[key] = np.rint(acc).astype(first.dtype)
        else:
            out[key] = acc.astype(first.dtype)
    return out


def trimmed_mean(values: np.ndarray, cut: int) -> np.ndarray:
    """The mean along axis 0 after cutting the ``cut`` smallest and largest values:
    Flower's :func:`trim_mean` with a count where it takes a fraction (the same
    partition and mean, so ``cut = int(β·n)`` gives its result bit for bit)."""
    count = values.shape[0]
    if not 0 <= 2 * cut < count:
        raise ValueError(f"cannot cut {cut} values at each end of {count}")
    kept = np.partition(values, (cut, count - cut - 1), axis=0)[cut:count - cut]
    return np.mean(kept, axis=0)


def krum_choice(distances: np.ndarray, byzantine: int, count: int) -> list[int]:
    """The ``count`` best-scored rows of a squared-distance matrix, as Flower's
    :func:`select_multikrum` scores them (each by the sum of its distances to its
    n − f − 2 nearest others), sorted; for distances accumulated block by block."""
    closest = max(1, len(distances) - byzantine - 2)
    scores = [np.sum(row[np.argsort(row)[1:closest + 1]]) for row in distances]
    return sorted(int(i) for i in np.argsort(scores)[:count])


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
        f, the number of faulty clients to tolerate: Krum's and Multi-Krum's f, and
        the fewest values ``trimmed-mean`` cuts at each end.
    krum_select : int (default: 0, meaning n − f)
        ``multi-krum``: how many of the best-scored updates are averaged.
    norm_bound : {"none", "median"} (default: "none")
        A robust rule's bound on each update's norm before the rule
        (:meth:`bound_factors`); the mean and the weighted mean ignore it (it reads
        ``none`` there). The run-config's ``auto`` is resolved before
        (:func:`fedspc_app.core.config.resolve_norm_bound`).
    """

    name: str = "mean"
    trim_fraction: float = 0.1
    byzantine: int = 0
    krum_select: int = 0
    norm_bound: str = "none"

    def __post_init__(self) -> None:
        if self.name not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.name!r}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.byzantine < 0 or self.krum_select < 0:
            raise ValueError("byzantine-clients and krum-select must be >= 0")
        if self.norm_bound not in NORM_BOUNDS:
            raise ValueError(f"norm bound must be one of {NORM_BOUNDS}, "
                             f"got {self.norm_bound!r}")
        # As it acts: "none" under the mean and the weighted mean.
        object.__setattr__(self, "norm_bound", resolve_norm_bound(self.norm_bound, self.name))

    @property
    def robust(self) -> bool:
        return self.name in ROBUST

    def trim_count(self, count: int) -> int:
        """``trimmed-mean``: the values cut at each end of ``count``: floor(β·n) as
        Flower's :func:`trim_mean`, and at least f when f > 0."""
        cut = int(self.trim_fraction * count)
        return max(cut, self.byzantine) if self.byzantine > 0 else cut

    def shortfall(self, count: int) -> str | None:
        """Why ``count`` values are too few for this rule to bound f faulty ones, or
        None: ``trimmed-mean`` would have to cut every value, with n ≤ 2f the
        ``median`` is the faulty clients' to set (half the values of an even n, or
        all but fewer than half of an odd one, may be theirs), and Krum needs
        n > 2f + 2."""
        if self.name == "trimmed-mean" and count <= 2 * self.trim_count(count):
            return (f"trimmed-mean cuts byzantine-clients = {self.byzantine} values at "
                    f"each end and {count} accepted replies leave none; with n ≤ 2f "
                    "the faulty clients may be half the replies, which no coordinate "
                    "rule bounds")
        if (self.name in ("krum", "multi-krum") and self.byzantine > 0
                and 0 < count <= 2 * self.byzantine + 2):
            return (f"{count} accepted replies with byzantine-clients = {self.byzantine}: "
                    "Krum's scores bound f faulty clients only when n > 2f + 2 (with "
                    "fewer they tie, and the lowest partition id wins)")
        if self.name == "median" and 0 < count <= 2 * self.byzantine:
            return (f"{count} accepted replies with byzantine-clients = {self.byzantine}: "
                    "with n ≤ 2f the faulty clients may be half the replies, and the "
                    "median is then theirs to set")
        return None

    def bound_factors(self, updates: Sequence[ArrayDict], origin: ArrayDict | None,
                      keys: Sequence[str]) -> list[float]:
        """The factor each update's change from ``origin`` over ``keys`` is scaled by
        before the rule: 1, or under a robust rule with ``norm_bound = "median"``
        min(1, m / ‖Δ_k‖), m the median of the updates' norms ‖Δ_k‖ (float64, over
        every entry of ``keys``)."""
        if (not self.robust or self.norm_bound == "none" or origin is None
                or len(updates) < 2 or not keys):
            return [1.0] * len(updates)
        norms = [float(np.sqrt(sum(float(np.sum(np.square(
            np.asarray(update[key], np.float64) - np.asarray(origin[key], np.float64))))
            for key in keys))) for update in updates]
        bound = float(np.median(norms))
        return [bound / norm if norm > bound else 1.0 for norm in norms]

    def bound_norms(self, updates: Sequence[ArrayDict], origin: ArrayDict | None,
                    keys: Sequence[str]) -> tuple[list[float], list[ArrayDict]]:
        """:meth:`bound_factors` and the updates they bound (:func:`bounded`)."""
        factors = self.bound_factors(updates, origin, keys)
        if all(factor == 1.0 for factor in factors):
            return factors, list(updates)
        return factors, bounded(updates, origin, keys, factors)

    def krum_count(self, count: int) -> int:
        """How many of ``count`` updates Krum (1) or Multi-Krum (m, or n − f) keeps."""
        chosen = 1 if self.name == "krum" else (self.krum_select or count - self.byzantine)
        return max(1, min(chosen, count))

    def selected(self, updates: Sequence[ArrayDict], keys: Sequence[str]) -> list[int]:
        """The indices of the updates that enter the aggregate: all of them, except for
        Krum and Multi-Krum, which score the updates of ``keys``. With no key to score
        (method ``local``, or a split with no shared trainable parameter) every update
        ties and all enter, as they would under the mean: Flower's scoring raises on
        an empty update."""
        if self.name not in ("krum", "multi-krum") or len(updates) == 1 or not keys:
            return list(range(len(updates)))
        count = self.krum_count(len(updates))
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
            out[key] = np.asarray(self.centre_rows(stacked), dtype=first.dtype)
        return out

    def centre_rows(self, rows: np.ndarray) -> np.ndarray:
        """The rule's centre of ``rows`` (one client a row) along axis 0: the
        coordinate-wise median or trimmed mean, else the unweighted mean as
        :func:`mean_arrays` computes it (for Krum: of the rows it selected). A centre
        taken block of coordinates by block equals the one taken at once."""
        if self.name == "median":
            return np.median(rows, axis=0)
        if self.name == "trimmed-mean":
            cut = self.trim_count(len(rows))
            if cut == int(self.trim_fraction * len(rows)):
                return trim_mean(rows, self.trim_fraction)  # Flower's own, as before
            return trimmed_mean(rows, cut)
        return mean_arrays([{"rows": row} for row in rows], [1.0] * len(rows))["rows"]


def bounded(updates: Sequence[ArrayDict], origin: ArrayDict, keys: Sequence[str],
            factors: Sequence[float]) -> list[ArrayDict]:
    """``origin + factor · (update − origin)`` over ``keys`` (float64, then the
    update's dtype); other entries, and an update whose factor is 1, as they are."""
    out = []
    for update, factor in zip(updates, factors):
        if factor == 1.0:
            out.append(update)
            continue
        scaled = dict(update)
        for key in keys:
            start = np.asarray(origin[key], dtype=np.float64)
            change = np.asarray(update[key], dtype=np.float64) - start
            scaled[key] = (start + factor * change).astype(np.asarray(update[key]).dtype)
        out.append(scaled)
    return out


def robust_reference_sum(rule: AggregationRule, changes: Sequence[ArrayDict],
                         selected: Sequence[int], count: int,
                         weights: Sequence[float] | None = None) -> ArrayDict:
    """What replaces ``sum_{k in S} (u_k' - u_k)`` in u_bar's update under a robust
    rule or the weighted mean: ``count`` (the number of accepted replies) times the
    rule's centre of the reference changes: the mean of Krum's selection, the
    coordinate-wise median or trimmed mean, or under ``weighted`` their mean weighted
    by ``weights`` (theta_s's, the training images), so that the correction cancels
    in theta_s's weighted aggregate as in the mean's. For the plain mean it equals the
    sum."""
    chosen = [changes[i] for i in selected]
    weights = [1.0] * len(changes) if weights is None else weights
    centre = rule.combine(chosen, [weights[i] for i in selected])
    return {key: (np.asarray(value, dtype=np.float64) * count) for key, value in centre.items()}
