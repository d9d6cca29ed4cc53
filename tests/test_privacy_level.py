"""``dp-reference = "level"``: under privacy each FedSPC client releases the steps its
gradients alone took, and u_bar, derived from that release by the same formula, is a
running mean of the clients' mean gradient whose noise fades, where Algorithm 1's
increment keeps every round's noise (docs/privacy.md, "Reference smoothing")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_algorithm import (
    ETA,
    OneSample,
    TwoScalars,
    client_round,
    config,
    half_squared_error,
    scalar,
)
from test_privacy import run

from clients import ClientJob, ClientState, train_client
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.correction import (
    add,
    global_reference_update,
    reference_change,
    uncorrected_step,
)
from fedspc_app.core.dp_mechanism import clip_update, update_norm
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import Method, Phase, get_method
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE, WITHIN_CLIPPING_NORM
from fedspc_app.core.records import from_record
from fedspc_app.models.split import parameter_split

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
    ({"dp-clipping-norm": 1.0, "dp-reference": "level"}, "needs differential privacy, FedSPC"),
    ({"dp-clipping-norm": 1.0, "fedspc": True, "dp-reference": "level", "momentum": 0.5},
     "'momentum' = 0"),
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
    u_k ≠ u_bar). Four rounds: a wrong u_k of round 2 shows in round 4's broadcasts."""
    dp = {"method": "fedrep", "fedspc": True, "num-rounds": 4, "dp-clipping-norm": math.inf,
          "dp-noise-multiplier": 0.0}
    grid_a, rounds_a = run(tmp_path, "increment", **dp)
    grid_b, rounds_b = run(tmp_path, "level", **dp, **{"dp-reference": "level"})
    for key in (ARRAYS, GLOBAL_REFERENCE):
        for a, b in zip(broadcasts(grid_a, key), broadcasts(grid_b, key), strict=True):
            worst = max(float(np.max(np.abs(b[n] - a[n]))) for n in a)
            assert worst <= 1e-4 * max(float(np.max(np.abs(a[n]))) for n in a) + 1e-7, key
    assert rounds_b[-1]["accuracy"] == pytest.approx(rounds_a[-1]["accuracy"], abs=0.02)
    last = [r for r in grid_a.replies if r.metadata.message_type == "train"][-1]
    other = [r for r in grid_b.replies if r.metadata.message_type == "train"][-1]
    a, b = (from_record(m.content.array_records[ARRAYS]) for m in (last, other))
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) > 1e-4
    privacy = json.loads((tmp_path / "level" / "config.json").read_text())["privacy"]
    assert privacy["reference"] == "level" and "uncorrected steps" in privacy["estimator"]
    assert "reference" not in json.loads(
        (tmp_path / "increment" / "config.json").read_text())["privacy"]


def test_every_release_is_within_the_clipping_norm(tmp_path):
    """The uncorrected step is taken before clipping: what the server receives is at most
    C from what it sent, on the corrected keys, in every round."""
    grid, _ = run(tmp_path, "clip", method="fedrep", fedspc=True, **{
        "num-rounds": 3, "dp-clipping-norm": 0.05, "dp-noise-multiplier": 0.0,
        "dp-reference": "level"})
    sent = {m.metadata.message_id: from_record(m.content.array_records[ARRAYS])
            for m in grid.sent if m.metadata.message_type == "train"}
    corrected = list(broadcasts(grid, GLOBAL_REFERENCE)[0])
    replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(replies) == 3 * 3
    for r in replies:
        base, got = sent[r.metadata.reply_to_message_id], from_record(r.content.array_records[ARRAYS])
        norm = math.sqrt(sum(float(np.sum((got[k].astype(np.float64) - base[k]) ** 2))
                             for k in corrected))
        assert norm <= 0.05 * (1 + 1e-4)


# One client round of FedPer + FedSPC on test_algorithm's two-scalar model (w the body,
# shared; h the head), with u_k and u_bar apart.
B = "body.weight"
STATE = ClientState(personal={"head.weight": np.array([[1.15958125]])},
                    local_reference={B: np.array([[-1.449421875]])})
RECEIVED = {B: [[0.3521421875]]}
U_BAR = {B: np.array([[0.7392890625]], dtype=np.float32)}


def private(**extra):
    return config(**{"fedspc": True, "method": "fedper", "local_steps": 2,
                     "dp_clipping_norm": math.inf, "dp_noise_multiplier": 0.0, **extra})


def test_a_client_round_releases_the_update_plus_e_eta_times_the_correction():
    increment = client_round("fedper", private(), RECEIVED, STATE, 0, U_BAR)
    level = client_round("fedper", private(dp_reference="level"), RECEIVED, STATE, 0, U_BAR)
    steps = increment.shared_steps
    assert steps == level.shared_steps == 2
    correction = float(U_BAR[B][0, 0]) - (-1.449421875)
    assert scalar(level.shared, B) == pytest.approx(
        scalar(increment.shared, B) + steps * ETA * correction, abs=1e-6)
    # The new u_k is Algorithm 1's, and minus the released step over E η.
    new = scalar(level.state.local_reference, B)
    assert new == pytest.approx(scalar(increment.state.local_reference, B), abs=1e-5)
    assert new == pytest.approx(-(scalar(level.shared, B) - 0.3521421875) / (steps * ETA),
                                abs=1e-5)


@pytest.mark.parametrize("clip", [0.05, 0.2])
def test_the_release_is_clipped_and_u_k_follows_the_clipped_release(clip):
    level = client_round("fedper", private(dp_reference="level", dp_clipping_norm=clip),
                         RECEIVED, STATE, 0, U_BAR)
    step = scalar(level.shared, B) - 0.3521421875
    assert abs(step) == pytest.approx(clip, rel=1e-5)  # the unclipped step is larger
    assert scalar(level.state.local_reference, B) == pytest.approx(-step / (2 * ETA),
                                                                   abs=1e-5)


def test_adaptive_clipping_s_bit_is_about_the_release():
    def norm(cfg):
        return abs(scalar(client_round("fedper", cfg, RECEIVED, STATE, 0, U_BAR).shared, B)
                   - 0.3521421875)
    released, update = norm(private(dp_reference="level")), norm(private())
    between = (released + update) / 2  # the two bits differ at this norm
    out = client_round("fedper", private(dp_reference="level", dp_clipping_norm=between,
                                         dp_clipping_quantile=0.5), RECEIVED, STATE, 0, U_BAR)
    assert out.metrics[WITHIN_CLIPPING_NORM] == int(released <= between)


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


# A method of one's own whose shared phases train different parts of the shared block:
# the head, then the body, everything shared.
TWO_PHASES = Method("twophase", "all",
                    (Phase("head", "local_epochs"), Phase("body", "local_epochs")),
                    personalized=False, summary="head then body, all shared")


def test_level_adds_back_each_key_s_own_correction_when_phases_train_different_keys():
    """Each key is corrected only in the phases that train it (2 of the E = 4 shared
    steps here), so the uncorrected step adds back 2η(ū − u_k) to each, not Eη(ū − u_k):
    with no data gradient (x = 0) the release is zero."""
    method = get_method("test_privacy_level:TWO_PHASES")
    cfg = config(fedspc=True, method="test_privacy_level:TWO_PHASES", local_steps=2,
                 dp_clipping_norm=math.inf, dp_noise_multiplier=0.0, dp_reference="level")
    model = TwoScalars().double()
    split = parameter_split(model, method)
    received = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    u_bar = {k: np.ones(received[k].shape, np.float32) for k in split.corrected}
    state = ClientState(local_reference={k: np.zeros(received[k].shape, np.float32)
                                         for k in split.corrected})
    out = train_client(ClientJob(cfg, method, model, split, received, state, OneSample(0.0, 0.0)),
                       global_reference=u_bar, loss_fn=half_squared_error)
    assert out.shared_steps == 4 and set(split.corrected) == {"body.weight", "head.weight"}
    for key in split.corrected:
        np.testing.assert_allclose(out.shared[key] - received[key], 0.0, atol=1e-7)


@pytest.mark.parametrize("clipping_norm", [1e-3, 3e-5, 2.4e-5, 1e-5, 1e-9])
def test_a_clipped_update_is_within_the_norm_the_server_measures_at_any_c(clipping_norm):
    """Parameters of size about 1, updates whose float32 rounding is comparable to C: the
    clipped update, as the server measures it (what was sent minus the broadcast, in
    float64), is never above C, so an honest reply never fails the server's check,
    whatever its data; below float32's resolution the update is dropped."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        initial = {k: rng.normal(size=(64, 32)).astype(np.float32) for k in ("a", "b")}
        final = {k: (v + rng.normal(scale=10 ** rng.uniform(-4, 0), size=v.shape))
                 .astype(np.float32) for k, v in initial.items()}
        clipped = clip_update(final, initial, list(initial), clipping_norm)
        assert update_norm(clipped, initial, list(initial)) <= clipping_norm
        assert all(clipped[k].dtype == np.float32 for k in clipped)
    if clipping_norm >= 1e-3:  # well above the rounding: clipped to C, to float32 precision
        assert update_norm(clipped, initial, list(initial)) == pytest.approx(clipping_norm,
                                                                             rel=1e-3)
