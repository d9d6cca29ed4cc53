"""The edges of differential privacy's settings and state: refusals that reach the
user as one message, a clipping norm that stays finite, positive and within its public
bounds (also against clients that steer it), a checkpoint's C_t checked on load, and
u_bar's smoothing only where there is noise to damp."""

from __future__ import annotations

from inprocess import InProcessGrid, run_server

from fedspc_app import client_app


def test_a_count_noise_too_small_for_the_federation_found_at_the_start_is_a_refusal(
        tmp_path):
    """num-clients unset: K, and so the default σ_b = q·K/20, is known only when the run
    starts; σ_b ≤ σ/2 then stops the run with the one message of every refusal."""
    config = {"method": "fedavg", "num-rounds": 1, "local-steps": 1, "checkpoint": False,
              "output-dir": str(tmp_path), "run-name": "refused", "dp-clipping-norm": 0.5,
              "dp-noise-multiplier": 0.5, "dp-clipping-quantile": 0.5}
    error = run_server(InProcessGrid(client_app.app, 3, config), config)
    assert error is not None and error.startswith("fedspc: run-config "
                                                  "'dp-clipped-count-stddev'")
    assert "σ_b must exceed σ/2" in error
    assert not (tmp_path / "refused" / "metrics.json").exists()
