"""Drift diagnostics (strategies/drift.py), checked against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.drift import drift_statistics

B = {"w": np.zeros(2, dtype=np.float32), "b": np.array([1.0], dtype=np.float32)}


def final(w, b) -> dict:
    return {"w": np.array(w, dtype=np.float32), "b": np.array([b], dtype=np.float32)}


def test_two_orthogonal_updates_by_hand():
    # Delta_1 = (1, 0), Delta_2 = (0, 1) on w; b unchanged. m = (0.5, 0.5).
    out = drift_statistics(B, [final([1, 0], 1), final([0, 1], 1)], [1.0, 1.0],
                           ["w", "b"])
    assert out["update-norm"] == pytest.approx(math.sqrt(0.5))
    assert out["client-update-norm"] == pytest.approx(1.0)
    # ||Delta_k - m||^2 = 0.5 for both; / ||m||^2 = 0.5
    assert out["drift-dispersion"] == pytest.approx(1.0)
    # cos = <Delta_k, m> / (||Delta_k|| ||m||) = 0.5 / sqrt(0.5)
    assert out["update-cosine"] == pytest.approx(math.sqrt(0.5))
    assert out["client-update-norms"] == pytest.approx([1.0, 1.0])


def test_identical_updates_have_no_dispersion_and_cosine_one():
    out = drift_statistics(B, [final([2, 1], 3), final([2, 1], 3)], [1.0, 1.0],
                           ["w", "b"])
    # Delta = (2, 1, 2) for both
    assert out["update-norm"] == pytest.approx(3.0)
    assert out["drift-dispersion"] == pytest.approx(0.0, abs=1e-12)
    assert out["update-cosine"] == pytest.approx(1.0)


def test_weights_move_the_mean_and_opposite_updates_cancel():
    # Delta_1 = (1, 0), Delta_2 = (-1, 0) with weights 3:1 -> m = (0.5, 0)
    out = drift_statistics(B, [final([1, 0], 1), final([-1, 0], 1)], [3.0, 1.0],
                           ["w"])
    assert out["update-norm"] == pytest.approx(0.5)
    # ||(0.5, 0)||^2 = 0.25 and ||(-1.5, 0)||^2 = 2.25 -> mean 1.25 / 0.25
    assert out["drift-dispersion"] == pytest.approx(5.0)
    assert out["client-update-cosines"] == pytest.approx([1.0, -1.0])
    equal = drift_statistics(B, [final([1, 0], 1), final([-1, 0], 1)], [1.0, 1.0],
                             ["w"])
    assert equal["update-norm"] == 0.0
    assert math.isnan(equal["drift-dispersion"]) and math.isnan(equal["update-cosine"])


def test_chunked_figures_agree_with_whole_arrays_in_float64():
    """Keys longer than a chunk (and a 0-d one), weighted: the chunked computation
    gives what the whole-array float64 formulas give, to rounding."""
    from strategies import drift

    rng = np.random.default_rng(3)
    shapes = {"big": (3, drift.CHUNK + 123), "scalar": (), "small": (5,)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    finals = [{k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01 * (i + 1))
               .astype(np.float32) for k, v in base.items()} for i in range(4)]
    weights = [1.0, 3.0, 0.5, 2.0]
    out = drift_statistics(base, finals, weights, list(shapes))

    deltas = [np.concatenate([np.ravel(f[k]).astype(np.float64)
                              - np.ravel(base[k]).astype(np.float64) for k in shapes])
              for f in finals]
    mean = sum(d * (w / sum(weights)) for d, w in zip(deltas, weights))
    norms = [np.linalg.norm(d) for d in deltas]
    assert out["update-norm"] == pytest.approx(np.linalg.norm(mean), rel=1e-12)
    assert out["client-update-norms"] == pytest.approx(norms, rel=1e-12)
    assert out["client-update-cosines"] == pytest.approx(
        [float(d @ mean) / (n * np.linalg.norm(mean)) for d, n in zip(deltas, norms)],
        rel=1e-12)
    spread = np.mean([np.sum((d - mean) ** 2) for d in deltas]) / np.sum(mean ** 2)
    assert out["drift-dispersion"] == pytest.approx(spread, rel=1e-9)
