"""The FedSPC paper's Dirichlet label-skew partition and the class-count ("pathological")
partition (fedspc_app.data.partition), their heatmaps (fedspc_app.experiments.plots,
``python -m fedspc_app.experiments partition``) and a run with ``partition = "classes"``."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from inprocess import InProcessGrid

from fedspc_app import client_app, server_app
from fedspc_app.core.config import PARTITIONS, parse_run_config
from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.data.partition import (
    SCHEMES,
    Partition,
    class_partition,
    dirichlet_partition,
    make_partition,
    partition_summary,
)
from fedspc_app.data.partition_files import load_partition_counts, save_partition
from fedspc_app.data.run_data import load_partition
from fedspc_app.experiments import cli
from fedspc_app.experiments.grid import expand_grid
from fedspc_app.experiments.plots import plot_partition, plot_partitions

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _labels(per_class: list[int] | np.ndarray, seed: int = 0) -> np.ndarray:
    """Shuffled labels with ``per_class[c]`` images of class ``c``."""
    labels = np.repeat(np.arange(len(per_class)), per_class)
    return np.random.default_rng(seed).permutation(labels)


@pytest.fixture(scope="module")
def uneven() -> tuple[np.ndarray, np.ndarray]:
    """20 classes of uneven size; test/train ratios differ between classes."""
    rng = np.random.default_rng(123)
    train = _labels(rng.integers(50, 400, size=20), seed=1)
    test = _labels(rng.integers(5, 120, size=20), seed=2)
    return train, test


@pytest.fixture(scope="module")
def part(uneven: tuple[np.ndarray, np.ndarray]) -> Partition:
    train, test = uneven
    return dirichlet_partition(train, test, num_clients=8, alpha=0.3, seed=7, min_samples=20)


def _assert_exact_cover(parts: tuple[np.ndarray, ...], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.size == n, "some index missing or repeated"
    assert np.array_equal(np.sort(joined), np.arange(n))
    for a in parts:
        assert a.dtype == np.int64
        assert np.all(np.diff(a) > 0), "indices must be sorted and unique"


# --------------------------------------------------------------------------- #
# Correctness of the split
# --------------------------------------------------------------------------- #


def test_every_index_assigned_exactly_once(part: Partition, uneven) -> None:
    train, test = uneven
    _assert_exact_cover(part.train_indices, train.size)
    _assert_exact_cover(part.test_indices, test.size)


def test_counts_match_the_labels_of_the_indices(part: Partition, uneven) -> None:
    train, test = uneven
    train_counts, test_counts = part.train_counts(), part.test_counts()
    assert train_counts.shape == test_counts.shape == (8, 20)
    assert train_counts.dtype == test_counts.dtype == np.int64
    for k in range(part.num_clients):
        tr, te = part.client(k)
        np.testing.assert_array_equal(np.bincount(train[tr], minlength=20), train_counts[k])
        np.testing.assert_array_equal(np.bincount(test[te], minlength=20), test_counts[k])


def test_counts_follow_the_proportions(part: Partition, uneven) -> None:
    # Each class is cut at rint(cumsum(p) * n): both of a client's boundaries are
    # within 0.5 of exact, so its count is within 1 of p * n.
    train, test = uneven
    n_train = np.bincount(train, minlength=20)
    n_test = np.bincount(test, minlength=20)
    p = part.proportions
    assert np.allclose(p.sum(axis=1), 1.0)
    assert np.all(np.abs(part.train_counts().T - p * n_train[:, None]) <= 1 + 1e-9)
    assert np.all(np.abs(part.test_counts().T - p * n_test[:, None]) <= 1 + 1e-9)


def test_test_distribution_follows_train(part: Partition, uneven) -> None:
    # With r_c = n_test_c / n_train_c: test = p*n_test + e1 and train = p*n_train + e2
    # with |e1|, |e2| <= 1 (rounding), so |test - r_c * train| = |e1 - r_c*e2| <= 1 + r_c.
    train, test = uneven
    ratio = np.bincount(test, minlength=20) / np.bincount(train, minlength=20)
    diff = np.abs(part.test_counts() - part.train_counts() * ratio[None, :])
    assert np.all(diff <= 1 + ratio[None, :] + 1e-9)
    # Sanity: this bound is tight relative to the counts, i.e. the split is real skew.
    assert part.train_counts().max() > 3 * (1 + ratio.max())


def test_min_samples_and_test_images_honoured(part: Partition) -> None:
    assert part.train_counts().sum(axis=1).min() >= 20
    assert part.test_counts().sum(axis=1).min() >= 1


def test_num_classes_larger_than_labels_gives_empty_classes() -> None:
    train, test = _labels([30] * 4), _labels([5] * 4)
    p = dirichlet_partition(
        train, test, num_clients=3, alpha=1.0, seed=0, min_samples=1, num_classes=6
    )
    assert p.num_classes == 6 and p.proportions.shape == (6, 3)
    assert np.all(p.train_counts()[:, 4:] == 0) and np.all(p.test_counts()[:, 4:] == 0)


def test_single_client_gets_everything() -> None:
    train, test = _labels([10, 20, 30]), _labels([1, 2, 3])
    p = dirichlet_partition(train, test, num_clients=1, alpha=0.5, seed=3)
    np.testing.assert_array_equal(p.train_indices[0], np.arange(60))
    np.testing.assert_array_equal(p.test_indices[0], np.arange(6))
    assert p.tries == 1


def test_partition_is_immutable(part: Partition) -> None:
    with pytest.raises(AttributeError):
        part.alpha = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        part.train_indices[0][0] = 0
    with pytest.raises(ValueError):
        part.proportions[0, 0] = 0.0
    counts = part.train_counts()
    counts[0, 0] += 1000
    assert part.train_counts()[0, 0] != counts[0, 0]


# --------------------------------------------------------------------------- #
# Reproducibility
# --------------------------------------------------------------------------- #


def test_same_seed_same_partition(uneven) -> None:
    train, test = uneven
    kwargs = dict(num_clients=8, alpha=0.3, seed=11, min_samples=20)
    a = dirichlet_partition(train, test, **kwargs)
    b = dirichlet_partition(train.copy(), test.copy(), **kwargs)
    assert a == b
    assert a.tries == b.tries
    np.testing.assert_array_equal(a.proportions, b.proportions)
    for x, y in zip(a.train_indices + a.test_indices, b.train_indices + b.test_indices):
        np.testing.assert_array_equal(x, y)


def test_different_seed_different_partition(uneven) -> None:
    train, test = uneven
    a = dirichlet_partition(train, test, num_clients=8, alpha=0.3, seed=1, min_samples=20)
    b = dirichlet_partition(train, test, num_clients=8, alpha=0.3, seed=2, min_samples=20)
    assert a != b
    assert not np.array_equal(a.proportions, b.proportions)
    assert any(not np.array_equal(x, y) for x, y in zip(a.train_indices, b.train_indices))


# --------------------------------------------------------------------------- #
# Dirichlet statistics
# --------------------------------------------------------------------------- #

STAT_CLASSES, STAT_CLIENTS, STAT_PER_CLASS = 200, 10, 100


def _stat_partition(alpha: float) -> Partition:
    train = _labels([STAT_PER_CLASS] * STAT_CLASSES)
    test = _labels([20] * STAT_CLASSES)
    p = dirichlet_partition(
        train, test, num_clients=STAT_CLIENTS, alpha=alpha, seed=0, min_samples=1
    )
    # One try means no rejection, so the proportions are an unconditioned Dir(alpha) sample.
    assert p.tries == 1
    return p


def test_tiny_alpha_gives_each_class_to_one_client() -> None:
    p = _stat_partition(0.01)
    max_share = p.proportions.max(axis=1)
    # For Dir(0.01 * 1_10), P(max share > 0.9) is about 0.85.
    assert np.mean(max_share > 0.9) > 0.75
    assert max_share.mean() > 0.85
    count_share = p.train_counts().max(axis=0) / STAT_PER_CLASS
    assert count_share.mean() > 0.85


def test_huge_alpha_gives_near_uniform_shares() -> None:
    p = _stat_partition(100.0)
    assert p.proportions.max() < 0.2
    assert (p.train_counts().max(axis=0) / STAT_PER_CLASS).max() < 0.2
    assert abs(p.proportions.min(axis=1).mean() - 1 / STAT_CLIENTS) < 0.05


@pytest.mark.parametrize("alpha", [0.01, 0.1, 0.5, 1.0, 10.0, 100.0])
def test_sum_of_squared_shares_matches_dirichlet_expectation(alpha: float) -> None:
    # For p ~ Dir(alpha * 1_K): E[sum_k p_k^2] = K * E[p_1^2] = (alpha + 1) / (K*alpha + 1).
    # The mean over 200 independent classes is compared with 5 standard errors.
    p = _stat_partition(alpha)
    sq = (p.proportions**2).sum(axis=1)
    expected = (alpha + 1) / (STAT_CLIENTS * alpha + 1)
    stderr = sq.std(ddof=1) / math.sqrt(STAT_CLASSES)
    assert abs(sq.mean() - expected) < 5 * stderr + 1e-4
    # Realised shares of images differ from p by at most 1/n per client.
    shares = p.train_counts().T / STAT_PER_CLASS
    assert np.all(np.abs(shares - p.proportions) <= 1 / STAT_PER_CLASS + 1e-12)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


def test_impossible_min_samples_is_config_error() -> None:
    train, test = _labels([50] * 10), _labels([10] * 10)
    with pytest.raises(ConfigError, match="min_samples=60"):
        dirichlet_partition(train, test, num_clients=10, alpha=1.0, seed=0, min_samples=60)


def test_unsatisfiable_alpha_is_data_error_after_max_tries() -> None:
    # Digits-like sizes, but 20 clients for 10 classes: with alpha=0.001 each class
    # goes (almost) entirely to one client, so at least 10 clients get < 10 images.
    # Satisfying it would need every class split ~evenly in two, which Dir(0.001)
    # practically never draws; the up-front feasibility check (20*10 <= 1437) passes.
    train = _labels([144] * 9 + [141])
    test = _labels([36] * 10)
    with pytest.raises(DataError) as info:
        dirichlet_partition(
            train, test, num_clients=20, alpha=0.001, seed=0, min_samples=10, max_tries=5
        )
    message = str(info.value)
    for expected in (
        "alpha=0.001",
        "K=20",
        "min_samples=10",
        "5 tries",
        "larger alpha",
        "fewer clients",
        "smaller min-samples",
    ):
        assert expected in message
    smallest = int(re.search(r"smallest client had (\d+) training images", message).group(1))
    assert 0 <= smallest < 10


def test_alpha_beyond_numpys_dirichlet_is_config_error() -> None:
    # alpha * K overflows numpy's gamma sum: its proportions are rows of zeros (finite),
    # which would give every class to nobody. 1e300 still draws (near-uniform shares).
    train, test = _labels([50] * 10), _labels([10] * 10)
    kwargs = dict(num_clients=10, seed=0, min_samples=1)
    with pytest.raises(ConfigError, match=r"alpha=1e\+308 is too large .* over 10 clients"):
        dirichlet_partition(train, test, alpha=1e308, **kwargs)
    p = dirichlet_partition(train, test, alpha=1e300, **kwargs)
    assert p.tries == 1 and p.train_counts().sum() == 500
    assert np.allclose(p.proportions, 0.1)


@pytest.mark.parametrize("alpha", [0, 0.0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_bad_alpha_is_config_error(alpha) -> None:
    train, test = _labels([20] * 3), _labels([5] * 3)
    with pytest.raises(ConfigError, match="alpha"):
        dirichlet_partition(train, test, num_clients=2, alpha=alpha, seed=0, min_samples=1)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(num_clients=0), "num_clients"),
        (dict(num_clients=61), "num_clients=61 exceeds"),
        (dict(num_clients=2.5), "num_clients"),
        (dict(min_samples=0), "min_samples"),
        (dict(max_tries=0), "max_tries"),
        (dict(seed=-1), "seed"),
        (dict(num_classes=2), "num_classes=2"),
        (dict(num_clients=7, min_samples=1), "test images"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict, pattern: str) -> None:
    train, test = _labels([20] * 3), _labels([2] * 3)
    args = dict(num_clients=2, alpha=1.0, seed=0, min_samples=1) | kwargs
    with pytest.raises(ConfigError, match=pattern):
        dirichlet_partition(train, test, **args)


@pytest.mark.parametrize(
    "train",
    [
        np.array([0, 1, -1, 2]),
        np.array([[0, 1], [1, 0]]),
        np.array([0.0, 1.0, 1.0]),
        np.array([], dtype=int),
    ],
)
def test_malformed_labels_are_data_errors(train: np.ndarray) -> None:
    with pytest.raises(DataError):
        dirichlet_partition(
            train, np.array([0, 1]), num_clients=1, alpha=1.0, seed=0, min_samples=1
        )


@pytest.mark.parametrize("pid", [-1, 8, 100, 1.0, "0", True])
def test_bad_partition_id_is_config_error(part: Partition, pid) -> None:
    with pytest.raises(ConfigError, match="partition-id"):
        part.client(pid)


def test_numpy_integer_partition_id_is_accepted(part: Partition) -> None:
    tr, te = part.client(np.int64(2))
    assert tr is part.train_indices[2] and te is part.test_indices[2]


# --------------------------------------------------------------------------- #
# Files and figures
# --------------------------------------------------------------------------- #


def test_to_dict_is_json_and_small(part: Partition) -> None:
    d = part.to_dict()
    restored = json.loads(json.dumps(d))
    assert restored["alpha"] == 0.3 and restored["seed"] == 7
    assert restored["num_clients"] == 8 and restored["num_classes"] == 20
    assert restored["tries"] == part.tries
    assert restored["train_counts"] == part.train_counts().tolist()
    assert restored["test_counts"] == part.test_counts().tolist()
    assert "train_indices" not in d and "test_indices" not in d


def test_save_and_load_partition(part: Partition, tmp_path: Path) -> None:
    out = tmp_path / "run" / "partition"
    save_partition(part, out)
    assert sorted(p.name for p in out.iterdir()) == ["partition.csv", "partition.json"]

    for source in (out, out / "partition.json"):
        loaded = load_partition_counts(source)
        np.testing.assert_array_equal(loaded["train_counts"], part.train_counts())
        np.testing.assert_array_equal(loaded["test_counts"], part.test_counts())
        assert loaded["alpha"] == part.alpha and loaded["tries"] == part.tries

    with (out / "partition.csv").open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["client", "split"] + [f"class_{c}" for c in range(20)]
    assert len(rows) == 1 + 2 * part.num_clients
    for row in rows[1:]:
        k, split = int(row[0]), row[1]
        counts = part.train_counts() if split == "train" else part.test_counts()
        assert split in ("train", "test")
        assert [int(x) for x in row[2:]] == counts[k].tolist()


def test_load_partition_counts_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="No partition file"):
        load_partition_counts(tmp_path)
    (tmp_path / "partition.json").write_text("{not json")
    with pytest.raises(DataError, match="Cannot read"):
        load_partition_counts(tmp_path)
    (tmp_path / "partition.json").write_text('{"num_clients": 2, "num_classes": 2}')
    with pytest.raises(DataError, match="train_counts"):
        load_partition_counts(tmp_path)


def test_plot_partition_writes_png(part: Partition, tmp_path: Path) -> None:
    path = plot_partition(
        part.train_counts(),
        tmp_path / "figs" / "partition.png",
        title="alpha=0.3",
        class_names=[f"c{i}" for i in range(20)],
    )
    assert path == tmp_path / "figs" / "partition.png"
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    assert [p.name for p in path.parent.iterdir()] == ["partition.png"], "temp file left behind"


def test_plot_partitions_side_by_side(tmp_path: Path) -> None:
    train, test = _labels([40] * 30), _labels([8] * 30)
    panels = [
        (
            f"alpha={a}",
            dirichlet_partition(
                train, test, num_clients=10, alpha=a, seed=0, min_samples=1
            ).train_counts(),
        )
        for a in (0.1, 0.5, 1.0)
    ]
    path = plot_partitions(panels, tmp_path / "three.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("counts", [np.zeros(5), np.array([[1, -1]]), np.array([[np.nan, 1.0]])])
def test_plot_partition_rejects_bad_counts(counts: np.ndarray, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        plot_partition(counts, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_partitions_rejects_no_panels(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        plot_partitions([], tmp_path / "x.png")


def test_partition_command_draws_one_run_or_panels(tmp_path: Path, capsys) -> None:
    train, test = _labels([40] * 6), _labels([8] * 6)
    runs = []
    for alpha in (0.1, 1.0):
        run = tmp_path / f"a{alpha}"
        save_partition(dirichlet_partition(train, test, num_clients=4, alpha=alpha, seed=0,
                                           min_samples=1), run)
        runs.append(run)
    assert cli.main(["partition", str(runs[0])]) == 0
    assert (runs[0] / "partition.png").read_bytes().startswith(PNG_SIGNATURE)
    both = tmp_path / "figs" / "both.png"
    assert cli.main(["partition", *map(str, runs), "-o", str(both)]) == 0
    assert both.read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().out.splitlines() == [str(runs[0] / "partition.png"), str(both)]
    assert cli.main(["partition", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedspc: No partition file") and err.count("\n") == 1


# --------------------------------------------------------------------------- #
# Class-count ("pathological") partition
# --------------------------------------------------------------------------- #


def _classes(train: np.ndarray, test: np.ndarray, **kwargs) -> Partition:
    args = dict(num_clients=13, classes_per_client=3, seed=5, min_samples=1) | kwargs
    return class_partition(train, test, **args)


@pytest.fixture(scope="module")
def by_class(uneven: tuple[np.ndarray, np.ndarray]) -> Partition:
    """13 clients of 3 classes over the 20 uneven classes: 39 slots, 1 or 2 holders."""
    return _classes(*uneven)


def _held(counts: np.ndarray) -> np.ndarray:
    return counts > 0


@pytest.mark.parametrize(
    "num_clients, per_client, seed",
    [(13, 3, 5), (20, 1, 0), (20, 20, 1), (7, 6, 2), (40, 7, 3), (1, 4, 4), (4, 3, 9)],
)
def test_every_client_holds_s_distinct_classes_and_holders_are_balanced(
        uneven, num_clients: int, per_client: int, seed: int) -> None:
    p = _classes(*uneven, num_clients=num_clients, classes_per_client=per_client, seed=seed)
    held = _held(p.train_counts())
    assert held.shape == (num_clients, 20)
    assert held.sum(axis=1).tolist() == [per_client] * num_clients
    np.testing.assert_array_equal(p.proportions > 0, held.T)
    holders = held.sum(axis=0)
    assert holders.max() - holders.min() <= 1
    assert holders.sum() == num_clients * per_client
    slots = num_clients * per_client
    assert set(holders.tolist()) <= {slots // 20, -(-slots // 20)}
    assert (p.scheme, p.classes_per_client, p.alpha) == ("classes", per_client, None)


def test_class_shares_are_equal_among_holders(by_class: Partition, uneven) -> None:
    train, _ = uneven
    sizes = np.bincount(train, minlength=20)
    counts = by_class.train_counts()
    for c in range(20):
        shares = counts[_held(counts)[:, c], c]
        assert shares.sum() == sizes[c]
        assert shares.max() - shares.min() <= 1
    p = by_class.proportions
    assert np.allclose(p, (p > 0) / (p > 0).sum(axis=1, keepdims=True))


def test_class_partition_uses_each_index_once_and_every_image_of_used_classes(uneven) -> None:
    train, test = uneven
    # 4 clients x 3 classes: 12 of the 20 classes are held, the other 8 unused.
    p = _classes(train, test, num_clients=4, classes_per_client=3)
    used = np.flatnonzero(_held(p.train_counts()).any(axis=0))
    assert used.size == 12
    for parts, labels in ((p.train_indices, train), (p.test_indices, test)):
        joined = np.concatenate(parts)
        assert np.unique(joined).size == joined.size, "an index went to two clients"
        np.testing.assert_array_equal(np.sort(joined), np.flatnonzero(np.isin(labels, used)))
        for a in parts:
            assert a.dtype == np.int64 and np.all(np.diff(a) > 0)
    for k in range(4):
        tr, te = p.client(k)
        np.testing.assert_array_equal(np.bincount(train[tr], minlength=20), p.train_counts()[k])
        np.testing.assert_array_equal(np.bincount(test[te], minlength=20), p.test_counts()[k])


def test_class_partition_covers_everything_when_every_class_is_held(
        by_class: Partition, uneven) -> None:
    train, test = uneven
    _assert_exact_cover(by_class.train_indices, train.size)
    _assert_exact_cover(by_class.test_indices, test.size)


def test_class_test_split_follows_train(by_class: Partition, uneven) -> None:
    # The same bound as the Dirichlet test: both splits are cut by the same proportions.
    train, test = uneven
    np.testing.assert_array_equal(_held(by_class.test_counts()), _held(by_class.train_counts()))
    ratio = np.bincount(test, minlength=20) / np.bincount(train, minlength=20)
    diff = np.abs(by_class.test_counts() - by_class.train_counts() * ratio[None, :])
    assert np.all(diff <= 1 + ratio[None, :] + 1e-9)
    assert by_class.test_counts().sum(axis=1).min() >= 1


def _cifar100_labels() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.permutation(np.repeat(np.arange(100), 500)),
            rng.permutation(np.repeat(np.arange(100), 100)))


def test_class_leftovers_go_to_random_holders_not_the_same_clients() -> None:
    # CIFAR-100 sizes, every client holding every class: 500/60 and 100/60 images per
    # class and client. Were the leftovers always at the same positions, half the clients
    # would test on 100 images and half on 200 (and K=200 could never be drawn).
    train, test = _cifar100_labels()
    p = class_partition(train, test, num_clients=60, classes_per_client=100, seed=0)
    tests = p.test_counts().sum(axis=1)
    assert tests.sum() == 10000 and tests.min() > 140 and tests.max() < 195
    assert np.all(np.abs(p.train_counts().sum(axis=1) - 50000 / 60) < 30)
    for counts in (p.train_counts(), p.test_counts()):
        assert np.all(counts.max(axis=0) - counts.min(axis=0) <= 1)
    p = class_partition(train, test, num_clients=200, classes_per_client=100, seed=0)
    assert p.tries == 1 and p.test_counts().sum(axis=1).min() >= 1


@pytest.mark.parametrize(("num_clients", "per_client", "digest"), [
    (10, 5, "4c0ebc42d372a481"),  # one holder per class (the committed -c5 runs)
    (20, 10, "6f8fa308685eadd5"),  # two holders, every class splits evenly
])
def test_class_partition_that_splits_evenly_is_the_one_drawn_before(
        num_clients: int, per_client: int, digest: str) -> None:
    # The indices drawn before leftovers went to random holders, byte for byte.
    train, test = _cifar100_labels()
    p = class_partition(train, test, num_clients=num_clients, classes_per_client=per_client,
                        seed=0)
    h = hashlib.sha256()
    for part in p.train_indices + p.test_indices:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
    assert (p.tries, h.hexdigest()[:16]) == (1, digest)


def test_class_partition_is_deterministic_per_seed(uneven) -> None:
    train, test = uneven
    a = _classes(train, test, seed=11)
    b = _classes(train.copy(), test.copy(), seed=11)
    assert a == b and a.tries == b.tries
    for x, y in zip(a.train_indices + a.test_indices, b.train_indices + b.test_indices):
        np.testing.assert_array_equal(x, y)
    others = [_classes(train, test, seed=seed) for seed in (12, 13)]
    for other in others:
        assert other != a
        assert not np.array_equal(_held(other.train_counts()), _held(a.train_counts()))


def test_class_partition_differs_from_dirichlet_of_same_seed(by_class: Partition, uneven) -> None:
    train, test = uneven
    d = dirichlet_partition(train, test, num_clients=13, alpha=0.3, seed=5, min_samples=1)
    assert d != by_class and d.scheme == "dirichlet" and d.classes_per_client is None


def test_more_classes_per_client_than_classes_is_config_error(uneven) -> None:
    train, test = uneven
    with pytest.raises(ConfigError, match="classes_per_client=21 exceeds the 20 classes"):
        _classes(train, test, classes_per_client=21)
    with pytest.raises(ConfigError, match="classes_per_client=5 exceeds the 4 classes"):
        _classes(_labels([30] * 4), _labels([5] * 4), num_clients=2, classes_per_client=5)


@pytest.mark.parametrize("per_client", [0, -1, 2.0, "2", True, None])
def test_bad_classes_per_client_is_config_error(uneven, per_client) -> None:
    with pytest.raises(ConfigError, match="classes_per_client"):
        _classes(*uneven, classes_per_client=per_client)


def test_class_with_too_few_images_for_its_holders_is_config_error() -> None:
    # 12 clients x 5 classes over 10 classes: 6 holders per class, but class 3 has 4 images.
    train, test = _labels([40, 40, 40, 4, 40, 40, 40, 40, 40, 40]), _labels([10] * 10)
    with pytest.raises(ConfigError, match="class 3 has 4 training images.* up to 6 clients"):
        _classes(train, test, num_clients=12, classes_per_client=5)


def test_unsatisfiable_min_samples_is_data_error_after_max_tries() -> None:
    # 4 clients of 1 class of 30 images: 4 x 40 <= 300 passes the up-front check, but
    # every deal gives every client 30 images.
    train, test = _labels([30] * 10), _labels([6] * 10)
    with pytest.raises(DataError) as info:
        _classes(train, test, num_clients=4, classes_per_client=1, min_samples=40,
                 max_tries=3)
    message = str(info.value)
    for expected in ("1 classes per client", "K=4", "min_samples=40", "3 tries",
                     "smallest client had 30", "more classes per client"):
        assert expected in message


def test_short_test_split_advice_leaves_out_min_samples() -> None:
    # 16 clients of 1 class over 8 classes: 2 holders a class, so a class with one test
    # image leaves a holder without one whatever the deal; every client has 50 training
    # images, and every class has holders, so only fewer clients helps.
    train, test = _labels([100] * 8), _labels([1] * 4 + [3] * 4)
    with pytest.raises(DataError) as info:
        _classes(train, test, num_clients=16, classes_per_client=1, min_samples=10,
                 max_tries=3)
    message = str(info.value)
    assert "best smallest test split: 0 images" in message
    assert message.endswith("Use fewer clients.")


def test_unknown_scheme_is_config_error(uneven, part: Partition) -> None:
    train, test = uneven
    assert set(SCHEMES) == set(PARTITIONS)
    with pytest.raises(ConfigError, match="partition must be one of 'dirichlet', 'classes'"):
        make_partition("shards", train, test, num_clients=4, alpha=0.3,
                       classes_per_client=2, seed=0)
    with pytest.raises(ConfigError, match="'shards'"):
        Partition(num_clients=1, num_classes=1, alpha=None, seed=0, train_indices=([0],),
                  test_indices=([0],), proportions=[[1.0]], tries=1, scheme="shards")
    with pytest.raises(ConfigError, match="'shards'"):
        partition_summary("shards", alpha=None, classes_per_client=2, seed=0, tries=1,
                          train_counts=part.train_counts(), test_counts=part.test_counts())


def test_make_partition_dispatches_on_the_scheme(uneven, by_class: Partition) -> None:
    train, test = uneven
    common = dict(num_clients=13, alpha=0.3, seed=5, min_samples=1)
    assert make_partition("classes", train, test, classes_per_client=3, **common) == by_class
    assert make_partition("dirichlet", train, test, classes_per_client=3, **common) == \
        dirichlet_partition(train, test, **common)


def test_class_partition_json_records_scheme_and_classes(uneven, tmp_path: Path) -> None:
    train, test = uneven
    p = _classes(train, test, num_clients=4, classes_per_client=3)
    save_partition(p, tmp_path)
    data = load_partition_counts(tmp_path)
    assert data["scheme"] == "class-count" and data["classes_per_client"] == 3
    assert "alpha" not in data
    held = _held(p.train_counts())
    assert data["client_classes"] == [np.flatnonzero(row).tolist() for row in held]
    assert all(len(classes) == 3 for classes in data["client_classes"])
    assert data["unused_classes"] == np.flatnonzero(~held.any(axis=0)).tolist()
    assert len(data["unused_classes"]) == 8
    assert data["class_holders"] == held.sum(axis=0).tolist()
    assert (data["seed"], data["tries"], data["num_clients"]) == (5, p.tries, 4)
    np.testing.assert_array_equal(data["train_counts"], p.train_counts())
    np.testing.assert_array_equal(data["test_counts"], p.test_counts())
    # The deployment's file, built from the counts the nodes report, is the same.
    reported = partition_summary("classes", alpha=0.1, classes_per_client=3, seed=5,
                                 tries=p.tries, train_counts=p.train_counts().tolist(),
                                 test_counts=p.test_counts().tolist())
    assert reported == p.to_dict()


def test_dirichlet_partition_json_keeps_its_keys(part: Partition) -> None:
    assert list(part.to_dict()) == ["scheme", "num_clients", "num_classes", "alpha", "seed",
                                    "tries", "train_counts", "test_counts"]
    assert part.to_dict()["scheme"] == "dirichlet-label-skew"


def test_run_name_and_cached_partition_follow_the_scheme() -> None:
    dirichlet = parse_run_config({"alpha": 0.5, "seed": 2})
    two = parse_run_config({"partition": "classes", "classes-per-client": 2, "seed": 2})
    three = two.replace(classes_per_client=3)
    assert dirichlet.resolved_run_name == "digits-cnn-fedavg-a0.5-s2"
    assert two.resolved_run_name == "digits-cnn-fedavg-c2-s2"
    assert three.resolved_run_name == "digits-cnn-fedavg-c3-s2"
    partitions = [load_partition(config, 6) for config in (dirichlet, two, three)]
    assert [p.scheme for p in partitions] == ["dirichlet", "classes", "classes"]
    for p, per_client in zip(partitions[1:], (2, 3)):
        assert _held(p.train_counts()).sum(axis=1).tolist() == [per_client] * 6
    assert load_partition(three, 6) is partitions[2]  # cached per process


def test_grid_names_cells_by_partition_and_classes_per_client(tmp_path: Path) -> None:
    grid = expand_grid({"axes": {"partition": ["dirichlet", "classes"],
                                 "classes-per-client": [2, 5]}},
                       name="g", output_dir=tmp_path)
    names = [cell.name for cell in grid.cells]
    assert names == ["partition-dirichlet-c2", "partition-dirichlet-c5",
                     "partition-classes-c2", "partition-classes-c5"]


# --------------------------------------------------------------------------- #
# A run with partition = "classes" (the real apps, in this process)
# --------------------------------------------------------------------------- #


def _run_apps(tmp_path: Path, **overrides):
    run_config = {"method": "fedavg", "num-rounds": 1, "local-epochs": 1, "batch-size": 64,
                  "partition": "classes", "classes-per-client": 2, "seed": 3,
                  "output-dir": str(tmp_path), "checkpoint": False, **overrides}
    grid = InProcessGrid(client_app.app, 4, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    return grid


def test_a_run_with_two_classes_per_client_finishes(tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", logger="flwr")
    _run_apps(tmp_path)
    run_dir = tmp_path / "digits-cnn-fedavg-c2-s3"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["rounds"][-1]["round"] == 1
    assert 0.0 <= metrics["rounds"][-1]["accuracy"] <= 1.0
    data = load_partition_counts(run_dir)
    assert data["scheme"] == "class-count" and data["classes_per_client"] == 2
    assert [len(classes) for classes in data["client_classes"]] == [2] * 4
    assert len(data["unused_classes"]) == 2  # 4 clients x 2 classes over 10 digits
    assert "4 clients, 2 classes per client, 1 rounds" in caplog.text


def test_a_run_with_more_classes_per_client_than_digits_stops_before_writing(
        tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="classes_per_client=11 exceeds the 10 classes"):
        _run_apps(tmp_path / "out", **{"classes-per-client": 11})
    assert not (tmp_path / "out").exists()


def test_a_deployment_writes_the_class_count_partition_its_nodes_report(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(server_app, "is_deployment", lambda grid: True)
    grid = _run_apps(tmp_path, **{"num-clients": 4})
    assert [m.content.config_records["config"]["query"] for m in grid.queries] == [
        "partition"] * 4
    run_dir = tmp_path / "digits-cnn-fedavg-c2-s3"
    written = json.loads((run_dir / "partition.json").read_text())
    expected = load_partition(parse_run_config(grid.contexts[1].run_config), 4).to_dict()
    assert written == {**expected, "source": "reported by the SuperNodes"}
