"""Label-skew partitions of a labelled dataset over federated clients.

Two schemes (the run-config's ``partition``), both described by client proportions
``p_c`` per class ``c``: the class's training images are split over the ``K``
clients by ``p_c`` and the *same* ``p_c`` splits that class's official test images.
Each client's test split therefore follows its own training label distribution,
and since train and test indices come from different sets nothing leaks between
them. The draw is repeated (all classes at once) until every client has at least
``min_samples`` training images and at least one test image.

* ``dirichlet`` (:func:`dirichlet_partition`), the FedSPC paper's scheme:
  ``p_c ~ Dir(alpha * 1_K)``. Small ``alpha`` gives strong label skew (each class
  lands almost entirely on one client); large ``alpha`` approaches an IID split.
* ``classes`` (:func:`class_partition`), the "pathological" split: each client
  holds ``S`` classes, every class is held by about the same number of clients,
  and ``p_c`` splits a class equally among its holders.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedspc_app.core.errors import ConfigError, DataError

__all__ = [
    "SCHEMES",
    "Partition",
    "class_partition",
    "dirichlet_partition",
    "make_partition",
    "partition_summary",
]


# The run-config's ``partition`` values and the ``scheme`` partition.json names them by.
SCHEMES = {"dirichlet": "dirichlet-label-skew", "classes": "class-count"}


def _check_scheme(scheme: Any) -> str:
    if scheme not in SCHEMES:
        raise ConfigError(
            f"partition must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}"
        )
    return scheme


def _frozen_index_array(values: Any, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ConfigError(f"{what} must be a 1-D index array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"{what} must hold integers, got dtype {array.dtype}")
    array = np.array(array, dtype=np.int64, copy=True)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Partition:
    """A label-skew partition of a training and a test set.

    Produced by :func:`dirichlet_partition` (the FedSPC paper's scheme) or
    :func:`class_partition`: class ``c``'s training and test images are both
    split over the clients by the same proportions ``proportions[c]``.

    Attributes
    ----------
    num_clients : int
        Number of clients ``K``.
    num_classes : int
        Number of classes ``C``.
    alpha : float or None
        Dirichlet concentration used for every class (``None`` for ``classes``).
    seed : int
        Seed of the ``numpy.random.Generator`` the partition was drawn with.
    train_indices : tuple of numpy.ndarray
        One sorted ``int64`` array per client of indices into the training set.
    test_indices : tuple of numpy.ndarray
        One sorted ``int64`` array per client of indices into the test set.
    proportions : numpy.ndarray
        ``[num_classes, num_clients]`` accepted draw; row ``c`` is the share of
        class ``c`` given to each client (all zero for a class nobody holds).
    tries : int
        Number of draws made, the accepted one included.
    scheme : str, default "dirichlet"
        The run-config's ``partition`` this was drawn with (a key of ``SCHEMES``).
    classes_per_client : int or None
        ``S`` of the ``classes`` scheme; ``None`` for ``dirichlet``.
    held_out : int, default 0
        The last ``held_out`` clients never train (``held-out-clients``; see
        :func:`hold_out`).

    Notes
    -----
    Instances are immutable: the index and proportion arrays are stored as
    read-only copies. Equality compares all fields element-wise; instances are
    not hashable.
    """

    num_clients: int
    num_classes: int
    alpha: float | None
    seed: int
    train_indices: tuple[np.ndarray, ...]
    test_indices: tuple[np.ndarray, ...]
    proportions: np.ndarray
    tries: int
    scheme: str = "dirichlet"
    classes_per_client: int | None = None
    held_out: int = 0
    # Per-client, per-class counts, recorded by the partitioners so that
    # train_counts()/test_counts() need no labels.
    _train_counts: np.ndarray | None = field(default=None, repr=False)
    _test_counts: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_scheme(self.scheme)
        train = tuple(
            _frozen_index_array(a, f"train_indices[{k}]") for k, a in enumerate(self.train_indices)
        )
        test = tuple(
            _frozen_index_array(a, f"test_indices[{k}]") for k, a in enumerate(self.test_indices)
        )
        if len(train) != self.num_clients or len(test) != self.num_clients:
            raise ConfigError(
                f"Partition has num_clients={self.num_clients} but {len(train)} train and "
                f"{len(test)} test index arrays"
            )
        proportions = np.array(self.proportions, dtype=np.float64, copy=True)
        if proportions.shape != (self.num_classes, self.num_clients):
            raise ConfigError(
                f"proportions must have shape (num_classes, num_clients) = "
                f"({self.num_classes}, {self.num_clients}), got {proportions.shape}"
            )
        proportions.setflags(write=False)
        object.__setattr__(self, "train_indices", train)
        object.__setattr__(self, "test_indices", test)
        object.__setattr__(self, "proportions", proportions)
        for name in ("_train_counts", "_test_counts"):
            counts = getattr(self, name)
            if counts is None:
                continue
            counts = np.array(counts, dtype=np.int64, copy=True)
            if counts.shape != (self.num_clients, self.num_classes):
                raise ConfigError(
                    f"{name.lstrip('_')} must have shape (num_clients, num_classes) = "
                    f"({self.num_clients}, {self.num_classes}), got {counts.shape}"
                )
            counts.setflags(write=False)
            object.__setattr__(self, name, counts)

    def __repr__(self) -> str:
        train = [int(a.size) for a in self.train_indices]
        test = [int(a.size) for a in self.test_indices]
        return (
            f"Partition(num_clients={self.num_clients}, num_classes={self.num_classes}, "
            f"scheme={self.scheme!r}, alpha={self.alpha!r}, "
            f"classes_per_client={self.classes_per_client!r}, seed={self.seed}, tries={self.tries}, "
            + (f"held_out={self.held_out}, " if self.held_out else "") +
            f"train_sizes={train}, test_sizes={test})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return (
            self.num_clients == other.num_clients
            and self.num_classes == other.num_classes
            and self.scheme == other.scheme
            and self.alpha == other.alpha
            and self.classes_per_client == other.classes_per_client
            and self.seed == other.seed
            and self.tries == other.tries
            and self.held_out == other.held_out
            and np.array_equal(self.proportions, other.proportions)
            and all(np.array_equal(a, b) for a, b in zip(self.train_indices, other.train_indices))
            and all(np.array_equal(a, b) for a, b in zip(self.test_indices, other.test_indices))
        )

    def _counts(self, which: str) -> np.ndarray:
        counts = self._train_counts if which == "train" else self._test_counts
        if counts is None:
            raise DataError(
                f"This Partition was built without {which} counts; construct it with "
                "make_partition(), which records them"
            )
        return counts.copy()

    def train_counts(self) -> np.ndarray:
        """Training images per client and class, ``int64 [num_clients, num_classes]``."""
        return self._counts("train")

    def test_counts(self) -> np.ndarray:
        """Test images per client and class, ``int64 [num_clients, num_classes]``."""
        return self._counts("test")

    def client(self, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(train_indices, test_indices)`` of client ``partition_id`` (sorted,
        read-only ``int64``); ConfigError unless it is an integer in ``[0, num_clients)``."""
        if (
            isinstance(partition_id, bool)
            or not isinstance(partition_id, numbers.Integral)
            or not 0 <= int(partition_id) < self.num_clients
        ):
            raise ConfigError(
                f"partition-id must be an integer in [0, {self.num_clients - 1}] "
                f"for num_clients={self.num_clients}, got {partition_id!r}"
            )
        pid = int(partition_id)
        return self.train_indices[pid], self.test_indices[pid]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable summary (counts, not the index lists).

        Returns
        -------
        dict
            :func:`partition_summary` of this partition.
        """
        return partition_summary(
            self.scheme, alpha=self.alpha, classes_per_client=self.classes_per_client,
            seed=self.seed, tries=self.tries,
            train_counts=self.train_counts(), test_counts=self.test_counts(),
            held_out=self.held_out,
        )


def partition_summary(
    scheme: str,
    *,
    alpha: float | None,
    classes_per_client: int | None,
    seed: int,
    tries: int,
    train_counts: Any,
    test_counts: Any,
    held_out: int = 0,
) -> dict[str, Any]:
    """The ``partition.json`` form of a partition, from its per-client class counts.

    Used for a :class:`Partition` and for the counts a deployment's clients report.

    Parameters
    ----------
    scheme : str
        The run-config's ``partition`` (a key of ``SCHEMES``).
    alpha : float or None
        The Dirichlet concentration (read for ``dirichlet`` only).
    classes_per_client : int or None
        ``S`` (read for ``classes`` only).
    seed, tries : int
        The partition's seed and number of draws.
    train_counts, test_counts : array-like
        Images per client and class, ``[num_clients, num_classes]``.
    held_out : int, default 0
        How many of the last clients never train (recorded as ``held_out_clients``
        when positive).

    Returns
    -------
    dict
        Keys ``scheme`` (``SCHEMES[scheme]``), ``num_clients``, ``num_classes``,
        the scheme's own keys, ``seed``, ``tries``, ``train_counts`` and
        ``test_counts`` (nested lists ``[client][class]`` of ints). ``dirichlet``
        adds ``alpha``; ``classes`` adds ``classes_per_client``,
        ``client_classes`` (each client's classes), ``class_holders`` (clients
        per class) and ``unused_classes`` (classes no client holds, whose images
        no client gets).
    """
    train = np.asarray(train_counts, dtype=np.int64)
    test = np.asarray(test_counts, dtype=np.int64)
    data: dict[str, Any] = {
        "scheme": SCHEMES[_check_scheme(scheme)],
        "num_clients": int(train.shape[0]),
        "num_classes": int(train.shape[1]),
    }
    if scheme == "dirichlet":
        data["alpha"] = float(alpha)
    else:
        held = train > 0
        data["classes_per_client"] = int(classes_per_client)
        data["client_classes"] = [np.flatnonzero(row).tolist() for row in held]
        data["class_holders"] = held.sum(axis=0).tolist()
        data["unused_classes"] = np.flatnonzero(~held.any(axis=0)).tolist()
    data.update(seed=int(seed), tries=int(tries), train_counts=train.tolist(),
                test_counts=test.tolist())
    if held_out:
        data["held_out_clients"] = int(held_out)
    return data



# --------------------------------------------------------------------------- #
# Partitioning
# --------------------------------------------------------------------------- #


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_labels(name: str, labels: Any) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1:
        raise DataError(f"{name} must be a 1-D array of class ids, got shape {array.shape}")
    if array.size == 0:
        raise DataError(f"{name} is empty")
    if not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"{name} must hold integer class ids, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.min() < 0:
        raise DataError(f"{name} contains a negative class id ({int(array.min())})")
    return array


def _split_counts(proportions: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
    """Images of each class per client, ``int64 [num_classes, num_clients]``: class ``c``
    is cut at ``rint(cumsum(p_c) * n_c)``, so every image goes to one client and client
    ``k`` receives within 1 image of ``p_ck * n_c``. A class whose row ``p_c`` is all
    zero (no client holds it) goes to nobody."""
    sizes = class_sizes.astype(np.int64)[:, None]
    bounds = np.rint(np.cumsum(proportions, axis=1) * sizes).astype(np.int64)
    bounds = np.minimum(bounds, sizes)
    bounds[:, -1] = np.where(proportions.any(axis=1), sizes[:, 0], 0)
    return np.diff(bounds, axis=1, prepend=0)


def _equal_shares(proportions: np.ndarray, class_sizes: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray:
    """As :func:`_split_counts` for proportions ``1/h`` over each class's ``h`` holders:
    each holder gets ``n_c // h`` images, and the ``n_c % h`` left over go one each to
    holders drawn at random (by ``rng``), not to the same positions in every class."""
    holders = proportions > 0
    count = holders.sum(axis=1)
    sizes = class_sizes.astype(np.int64)
    base = np.divide(sizes, count, out=np.zeros(len(sizes)), where=count > 0).astype(np.int64)
    left = sizes - base * count
    keys = np.where(holders, rng.random(holders.shape), np.inf)
    rank = np.argsort(np.argsort(keys, axis=1), axis=1)
    return np.where(holders, base[:, None] + (rank < left[:, None]), 0)


def _assign(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Hand out indices by ``counts[c, k]`` after shuffling within each class.

    One global permutation followed by a stable sort on the label gives every
    class's indices in uniformly random order, grouped by class, without a
    Python loop over classes. Images beyond a class's row sum go to nobody.
    """
    num_classes, num_clients = counts.shape
    unassigned = np.bincount(labels, minlength=num_classes) - counts.sum(axis=1)
    table = np.column_stack([counts, unassigned])
    perm = rng.permutation(labels.size)
    grouped = perm[np.argsort(labels[perm], kind="stable")]
    # grouped is class 0's block, then class 1's, ...; within a block, clients
    # take consecutive runs in order 0..K-1 (then K: nobody), matching table's
    # row-major layout.
    owner = np.repeat(np.tile(np.arange(num_clients + 1), num_classes), table.ravel())
    by_owner = grouped[np.argsort(owner, kind="stable")]
    splits = np.cumsum(table.sum(axis=0))[:-1]
    return [np.sort(part) for part in np.split(by_owner, splits)[:num_clients]]


@dataclass(frozen=True)
class _Inputs:
    """Checked arguments shared by the partitioners."""

    train: np.ndarray
    test: np.ndarray
    num_clients: int
    num_classes: int
    seed: int
    min_samples: int
    max_tries: int

    @property
    def train_sizes(self) -> np.ndarray:
        return np.bincount(self.train, minlength=self.num_classes)

    @property
    def test_sizes(self) -> np.ndarray:
        return np.bincount(self.test, minlength=self.num_classes)


def _check_inputs(train_labels: Any, test_labels: Any, *, num_clients: Any, seed: Any,
                  min_samples: Any, max_tries: Any, num_classes: Any) -> _Inputs:
    """Validate what every scheme takes; ConfigError or DataError naming the problem."""
    num_clients = _check_int("num_clients", num_clients, 1)
    min_samples = _check_int("min_samples", min_samples, 1)
    max_tries = _check_int("max_tries", max_tries, 1)
    seed = _check_int("seed", seed, 0)

    train = _check_labels("train_labels", train_labels)
    test = _check_labels("test_labels", test_labels)
    largest = int(max(train.max(), test.max()))
    if num_classes is None:
        num_classes = largest + 1
    else:
        num_classes = _check_int("num_classes", num_classes, 1)
        if largest >= num_classes:
            raise ConfigError(
                f"num_classes={num_classes} but the labels contain class id {largest}"
            )

    n_train, n_test = train.size, test.size
    if num_clients > n_train:
        raise ConfigError(
            f"num_clients={num_clients} exceeds the {n_train} training images"
        )
    if num_clients * min_samples > n_train:
        raise ConfigError(
            f"num_clients={num_clients} x min_samples={min_samples} = "
            f"{num_clients * min_samples} exceeds the {n_train} training images; "
            "use fewer clients or a smaller min-samples"
        )
    if num_clients > n_test:
        raise ConfigError(
            f"num_clients={num_clients} exceeds the {n_test} test images, so some client "
            "would get no test image"
        )
    return _Inputs(train, test, num_clients, num_classes, seed, min_samples, max_tries)


def _draw_partition(
    inputs: _Inputs,
    draw: Callable[[np.random.Generator], np.ndarray],
    *,
    what: str,
    advice: tuple[str, ...],
    split: Callable[[np.ndarray, np.ndarray], np.ndarray] = _split_counts,
    **scheme: Any,
) -> Partition:
    """Draw proportions with ``draw`` until every client has ``min_samples`` training
    images and one test image, then hand out the indices.

    ``what`` names the partition and ``advice`` the scheme's remedies in the DataError
    raised after ``max_tries`` failed draws (with fewer clients, and a smaller
    min-samples where training images fell short); ``scheme`` holds the Partition's
    ``scheme``, ``alpha`` and ``classes_per_client``; ``split`` turns proportions
    into counts per class and client.
    """
    train_sizes, test_sizes = inputs.train_sizes, inputs.test_sizes
    rng = np.random.default_rng(inputs.seed)
    best_train = best_test = -1

    for tries in range(1, inputs.max_tries + 1):
        proportions = draw(rng)
        train_counts = split(proportions, train_sizes)
        test_counts = split(proportions, test_sizes)
        smallest_train = int(train_counts.sum(axis=0).min())
        smallest_test = int(test_counts.sum(axis=0).min())
        best_train = max(best_train, smallest_train)
        best_test = max(best_test, smallest_test)
        if smallest_train >= inputs.min_samples and smallest_test >= 1:
            break
    else:
        remedies = [*advice, "fewer clients"] + ["a smaller min-samples"] * (
            best_train < inputs.min_samples)
        raise DataError(
            f"Could not draw {what} over K={inputs.num_clients} clients giving every "
            f"client >= min_samples={inputs.min_samples} training images and >= 1 test "
            f"image in {inputs.max_tries} tries; the best try's smallest client had "
            f"{best_train} training images (best smallest test split: {best_test} "
            f"images). Use {' or '.join(filter(None, [', '.join(remedies[:-1]), remedies[-1]]))}."
        )

    train_parts = _assign(inputs.train, train_counts, rng)
    test_parts = _assign(inputs.test, test_counts, rng)
    return Partition(
        num_clients=inputs.num_clients,
        num_classes=inputs.num_classes,
        seed=inputs.seed,
        train_indices=tuple(train_parts),
        test_indices=tuple(test_parts),
        proportions=proportions,
        tries=tries,
        _train_counts=train_counts.T,
        _test_counts=test_counts.T,
        **scheme,
    )


def dirichlet_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    seed: int,
    min_samples: int = 10,
    max_tries: int = 1000,
    num_classes: int | None = None,
) -> Partition:
    """Split a training and a test set over clients with Dirichlet label skew.

    The FedSPC paper's scheme: for each class ``c`` draw
    ``p_c ~ Dir(alpha * 1_K)``; shuffle the class's training indices and cut
    them at ``rint(cumsum(p_c) * n_c)``; cut the class's test indices with the
    same ``p_c``. All classes are redrawn until every client has at least
    ``min_samples`` training images and at least one test image.

    Parameters
    ----------
    train_labels, test_labels : numpy.ndarray
        1-D integer class ids of the training and the (official) test set.
    num_clients : int
        Number of clients ``K`` (>= 1, <= number of training images).
    alpha : float
        Dirichlet concentration (finite, > 0). Small values give strong skew.
    seed : int
        Non-negative seed of the ``numpy.random.Generator``; the result is a
        pure function of the labels, ``num_clients``, ``alpha``, ``seed``,
        ``min_samples`` and ``num_classes``.
    min_samples : int, default 10
        Minimum training images per client (>= 1).
    max_tries : int, default 1000
        Draws attempted before giving up (>= 1).
    num_classes : int, optional
        Number of classes; defaults to one more than the largest label seen.

    Returns
    -------
    Partition

    Raises
    ------
    ConfigError
        For invalid arguments, or when ``num_clients * min_samples`` exceeds
        the number of training images (no draw could succeed).
    DataError
        For malformed labels, or when no draw within ``max_tries`` satisfies
        the size constraints.

    Notes
    -----
    Rounding: client ``k`` receives within one image of ``p_ck * n_c`` of
    class ``c`` in both splits, so its test count is within ``1 + m_c / n_c``
    of ``train_count * m_c / n_c`` (``m_c`` the class's test size).

    A try only draws the ``C x K`` proportions and checks the resulting
    counts; indices are shuffled and assigned once, for the accepted draw.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise ConfigError(f"alpha must be a positive finite number, got {alpha!r}")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha <= 0.0:
        raise ConfigError(f"alpha must be a positive finite number, got {alpha!r}")
    inputs = _check_inputs(train_labels, test_labels, num_clients=num_clients, seed=seed,
                           min_samples=min_samples, max_tries=max_tries,
                           num_classes=num_classes)
    concentration = np.full(inputs.num_clients, alpha)

    def draw(rng: np.random.Generator) -> np.ndarray:
        proportions = rng.dirichlet(concentration, size=inputs.num_classes)
        if not np.isfinite(proportions).all():
            raise DataError(
                f"numpy produced non-finite Dirichlet proportions for alpha={alpha}; "
                "use a larger alpha"
            )
        if not np.allclose(proportions.sum(axis=1), 1.0):
            # The gamma draws' sum overflows: numpy returns rows of zeros.
            raise ConfigError(
                f"alpha={alpha:g} is too large for numpy's Dirichlet draw over "
                f"{inputs.num_clients} clients (its proportions come out as zeros); use a "
                "smaller alpha: alpha=1e6 already gives each client an equal share of every "
                "class, to within a fraction of a percent"
            )
        return proportions

    return _draw_partition(inputs, draw, what=f"a Dirichlet partition with alpha={alpha:g}",
                           advice=("a larger alpha",), scheme="dirichlet", alpha=alpha)


def _class_holders(num_clients: int, num_classes: int, classes_per_client: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Which client holds which class, ``bool [num_classes, num_clients]``.

    Client by client, each takes the ``classes_per_client`` classes held by the
    fewest clients so far, ties broken at random. The holder counts therefore
    never differ by more than one, ending at ``floor(K*S/C)`` or ``ceil(K*S/C)``
    per class, and a client's classes are distinct.
    """
    held = np.zeros((num_classes, num_clients), dtype=bool)
    holders = np.zeros(num_classes, dtype=np.int64)
    for k in range(num_clients):
        # lexsort sorts by its last key first: fewest holders, then the random tie-break.
        chosen = np.lexsort((rng.random(num_classes), holders))[:classes_per_client]
        held[chosen, k] = True
        holders[chosen] += 1
    return held


def class_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    *,
    num_clients: int,
    classes_per_client: int,
    seed: int,
    min_samples: int = 10,
    max_tries: int = 1000,
    num_classes: int | None = None,
) -> Partition:
    """Split a training and a test set so that every client holds ``S`` classes.

    The "pathological" label skew: the ``K * S`` class slots are dealt out
    client by client, each client taking the ``S`` classes held by the fewest
    clients so far (seeded random tie-breaks), so every class is held by
    ``floor(K*S/C)`` or ``ceil(K*S/C)`` clients and no client holds a class
    twice. A class's training images are shuffled and split into equal shares
    among its holders, and so are its test images; the images left over when a
    class does not divide evenly go one each to holders drawn at random. With ``K * S < C`` some
    classes have no holder and their images are used by nobody. Assignments are
    redrawn until every client has at least ``min_samples`` training images and
    at least one test image.

    Parameters
    ----------
    classes_per_client : int
        ``S``, the classes each client holds (1 <= S <= ``num_classes``).
    train_labels, test_labels, num_clients, seed, min_samples, max_tries, num_classes
        As in :func:`dirichlet_partition` (``max_tries`` counts assignments); the
        result is a pure function of the labels and these arguments.

    Returns
    -------
    Partition
        With ``scheme="classes"``, ``alpha=None`` and ``proportions[c, k]`` equal
        to ``1 / holders_c`` for the holders of class ``c``, else 0.

    Raises
    ------
    ConfigError
        For invalid arguments, ``S > C``, a class with fewer training images
        than the clients that may hold it, or ``num_clients * min_samples``
        above the number of training images.
    DataError
        For malformed labels, or when no assignment within ``max_tries``
        satisfies the size constraints.
    """
    inputs = _check_inputs(train_labels, test_labels, num_clients=num_clients, seed=seed,
                           min_samples=min_samples, max_tries=max_tries,
                           num_classes=num_classes)
    per_client = _check_int("classes_per_client", classes_per_client, 1)
    if per_client > inputs.num_classes:
        raise ConfigError(
            f"classes_per_client={per_client} exceeds the {inputs.num_classes} classes "
            f"of the dataset; use classes-per-client <= {inputs.num_classes}"
        )
    most_holders = -(-inputs.num_clients * per_client // inputs.num_classes)
    sizes = inputs.train_sizes
    if sizes.min() < most_holders:
        raise ConfigError(
            f"class {int(sizes.argmin())} has {int(sizes.min())} training images, but with "
            f"K={inputs.num_clients} clients of {per_client} classes each up to "
            f"{most_holders} clients hold a class; use fewer clients or fewer classes per "
            "client"
        )

    def draw(rng: np.random.Generator) -> np.ndarray:
        held = _class_holders(inputs.num_clients, inputs.num_classes, per_client, rng)
        holders = held.sum(axis=1, keepdims=True)
        return np.divide(held, holders, out=np.zeros(held.shape), where=holders > 0)

    # The leftover images' holders come from a generator of their own, so holders and
    # shuffles are drawn as before (a class that splits evenly is cut as it always was).
    leftovers = np.random.default_rng([inputs.seed, 1])
    unheld = inputs.num_clients * per_client < inputs.num_classes  # more S, more images
    return _draw_partition(inputs, draw,
                           what=f"a partition with {per_client} classes per client",
                           advice=("more classes per client",) * unheld, scheme="classes",
                           split=lambda p, sizes: _equal_shares(p, sizes, leftovers),
                           alpha=None, classes_per_client=per_client)


def make_partition(scheme: str, train_labels: np.ndarray, test_labels: np.ndarray, *,
                   alpha: float | None, classes_per_client: int | None,
                   **options: Any) -> Partition:
    """The partition the run-config's ``partition`` names.

    ``dirichlet`` calls :func:`dirichlet_partition` (reads ``alpha``),
    ``classes`` :func:`class_partition` (reads ``classes_per_client``); the
    labels and ``options`` (``num_clients``, ``seed``, ``min_samples``,
    ``max_tries``, ``num_classes``) are passed on. Any other ``scheme`` is a
    ConfigError, raised before anything else is checked.
    """
    if _check_scheme(scheme) == "classes":
        return class_partition(train_labels, test_labels,
                               classes_per_client=classes_per_client, **options)
    return dirichlet_partition(train_labels, test_labels, alpha=alpha, **options)
