"""``dp-reference = "level"``: under privacy each FedSPC client releases the steps its
gradients alone took, and u_bar, derived from that release by the same formula, is a
running mean of the clients' mean gradient whose noise fades, where Algorithm 1's
increment keeps every round's noise (docs/privacy.md, "Reference smoothing")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_privacy import run

from fedspc_app.core.config import parse_run_config
from fedspc_app.core.correction import (
    add,
    global_reference_update,
    reference_change,
    uncorrected_step,
)
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE
from fedspc_app.core.records import from_record

W = "w"


def test_the_uncorrected_step_by_hand():
    """E = 2, η = 0.25: θ_k + Eη(ū − u_k) on the corrected keys; the others as they are.
    Its change against u_k gives Algorithm 1's new u_k."""
    received = {W: np.array([1.0, 2.0], np.float32), "b": np.array([5.0], np.float32)}
    final = {W: np.array([0.5, 2.5], np.float32), "b": np.array([4.0], np.float32)}
    u_bar, u_k = {W: np.array([0.2, -0.4], np.float32)}, {W: np.array([1.0, 0.0], np.float32)}
    step = uncorrected_step(final, u_bar, u_k, steps=2, learning_rate=0.25)
    np.testing.assert_allclose(step[W], [0.5 + 0.5 * (0.2 - 1.0), 2.5 + 0.5 * (-0.4)])
    assert step["b"] is final["b"] and step[W].dtype == np.float32
    # Algorithm 1: u_k' = u_k + (−ū − Δθ_k/(Eη)); from the uncorrected step, −Δ'/(Eη).
    algorithm1 = add(u_k, reference_change({W: final[W] - received[W]}, u_bar, steps=2,
                                           learning_rate=0.25))
    level = add(u_k, reference_change({W: step[W] - received[W]}, u_k, steps=2,
                                      learning_rate=0.25))
    np.testing.assert_allclose(level[W], algorithm1[W], rtol=1e-6)
    np.testing.assert_allclose(level[W], -(step[W] - received[W]) / 0.5, rtol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    ({"fedspc": True, "dp-reference": "level"}, "'level' needs differential privacy"),
    ({"dp-clipping-norm": 1.0, "dp-reference": "level"}, "needs differential privacy and"),
    ({"dp-clipping-norm": 1.0, "fedspc": True, "dp-reference": "levels"}, "'dp-reference'"),
])
def test_what_level_cannot_honour_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({"local-steps": 2, **overrides})


def broadcasts(grid, key):
    """Each round's broadcast of ``key`` (the first training message of the round)."""
    out = {}
    for m in grid.sent:
        if m.metadata.message_type == "train":
            out.setdefault(m.content.config_records["config"]["server-round"],
                           from_record(m.content.array_records[key]))
    return [out[r] for r in sorted(out)]


def test_with_every_client_and_no_clipping_or_noise_level_is_algorithm_1(tmp_path):
    """q = 1, C = inf, σ = 0: the drawn clients' u_k average to u_bar, so the mean of the
    uncorrected steps is the mean update and u_bar the same: θ and u_bar broadcast in
    every round agree to float rounding, while the replies differ (from round 2, where
    u_k ≠ u_bar)."""
    dp = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "dp-clipping-norm": math.inf,
          "dp-noise-multiplier": 0.0}
    grid_a, rounds_a = run(tmp_path, "increment", **dp)
    grid_b, rounds_b = run(tmp_path, "level", **dp, **{"dp-reference": "level"})
    for key in (ARRAYS, GLOBAL_REFERENCE):
        for a, b in zip(broadcasts(grid_a, key), broadcasts(grid_b, key), strict=True):
            for name in a:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6)
    assert rounds_b[-1]["accuracy"] == pytest.approx(rounds_a[-1]["accuracy"], abs=0.02)
    last = [r for r in grid_a.replies if r.metadata.message_type == "train"][-1]
    other = [r for r in grid_b.replies if r.metadata.message_type == "train"][-1]
    a, b = (from_record(m.content.array_records[ARRAYS]) for m in (last, other))
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) > 1e-4
    privacy = json.loads((tmp_path / "level" / "config.json").read_text())["privacy"]
    assert privacy["reference"] == "level"
    assert "reference" not in json.loads(
        (tmp_path / "increment" / "config.json").read_text())["privacy"]


def simulate(reference: str, rounds: int, q: float = 0.5, sigma: float = 1.0, clients=20,
             dim=200, steps=5, lr=0.05, seed=0):
    """FedSPC under privacy on quadratic clients f_k = Σ λ_i (θ_i − c_ki)²/2 (half the
    directions flat, λ = 0.01), with the app's own arithmetic: the client's reference
    change (and, for "level", its uncorrected step), the release (the sum plus noise of
    std σ, over qK) and u_bar's increment from it. Returns the rms of u_bar − mean_k u_k
    after each round: the noise u_bar carries beyond the clients' own references."""
    rng = np.random.default_rng(seed)
    lam = np.where(np.arange(dim) < dim // 2, 1.0, 0.01).astype(np.float32)
    centres = rng.normal(size=(clients, dim)).astype(np.float32)
    theta, u_bar = np.zeros(dim, np.float32), np.zeros(dim, np.float32)
    u = np.zeros((clients, dim), np.float32)
    gaps = []
    for _ in range(rounds):
        total = np.zeros(dim, np.float64)
        for k in np.flatnonzero(rng.random(clients) < q):
            x = theta.copy()
            for _ in range(steps):
                x = (x - lr * (lam * (x - centres[k]) - u[k] + u_bar)).astype(np.float32)
            final, base = {W: x}, {W: u_bar}
            if reference == "level":
                final = uncorrected_step(final, {W: u_bar}, {W: u[k]}, steps=steps,
                                         learning_rate=lr)
                base = {W: u[k]}
            update = {W: final[W] - theta}
            u[k] += reference_change(update, base, steps=steps, learning_rate=lr)[W]
            total += update[W]
        released = ((total + rng.normal(0, sigma, dim)) / (q * clients)).astype(np.float32)
        theta = theta + released
        change = reference_change({W: released}, {W: u_bar}, steps=steps, learning_rate=lr)
        u_bar = global_reference_update({W: u_bar}, [{W: change[W] * (q * clients)}],
                                        clients)[W]
        gaps.append(float(np.sqrt(np.mean((u_bar - u.mean(0)) ** 2))))
    return np.array(gaps)


def test_under_noise_the_increment_keeps_every_round_s_noise_and_level_does_not():
    """With every client drawn the increment's u_bar − mean u_k is a random walk: its
    rms grows as √t (about ×2.8 from rounds 16-25 to 151-160); level's is stationary,
    and far below from the first rounds on. Drawn at q = 0.5 the same holds."""
    increment, level = simulate("increment", 160, q=1.0), simulate("level", 160, q=1.0)
    early, late = slice(15, 25), slice(150, 160)
    assert increment[late].mean() > 2.2 * increment[early].mean()
    assert level[late].mean() < 1.2 * level[early].mean()
    assert level[early].mean() < 0.3 * increment[early].mean()
    increment, level = simulate("increment", 160), simulate("level", 160)
    assert increment[late].mean() > 1.4 * increment[early].mean()
    assert level[late].mean() < 1.2 * level[early].mean()
    assert level[early].mean() < 0.4 * increment[early].mean()
    # Without noise both follow the clients' references exactly when all are drawn.
    assert simulate("increment", 60, sigma=0.0, q=1.0)[-1] < 1e-5
    assert simulate("level", 60, sigma=0.0, q=1.0)[-1] < 1e-5
