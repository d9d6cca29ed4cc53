"""Client-drift diagnostics of one round, from what the server already receives.

With ``Delta_k = theta_{s,k} - theta_s`` the update of client k on the shared block
(its reply minus the broadcast) and ``m`` their mean (with the aggregation's
weights):

* ``update-norm``: ``||m||``, the step the server takes;
* ``client-update-norm``: ``mean_k ||Delta_k||``, the steps the clients took;
* ``drift-dispersion``: ``mean_k ||Delta_k - m||^2 / ||m||^2``, how far the clients
  pull apart relative to the step they agree on (0: all the same; large: the mean
  is a small residue of updates that cancel);
* ``update-cosine``: ``mean_k cos(Delta_k, m)``, how well each client's direction
  agrees with the mean (1: all aligned).

Per client, ``client-update-norms`` and ``client-update-cosines`` (in the order of
``finals``). Computed key by key in float64, so memory stays at one key's
size per client whatever the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedspc_app.core.records import ArrayDict


def drift_statistics(broadcast: Mapping[str, np.ndarray], finals: Sequence[ArrayDict],
                     weights: Sequence[float], keys: Sequence[str]
                     ) -> dict[str, float | list[float]]:
    """The diagnostics above over ``keys`` (each reply's final shared arrays)."""
    total = float(sum(weights))
    count = len(finals)
    mean_sq = 0.0
    norms_sq = np.zeros(count)
    dots = np.zeros(count)
    for key in keys:
        base = np.asarray(broadcast[key], dtype=np.float64)
        deltas = [np.asarray(final[key], dtype=np.float64) - base for final in finals]
        mean = sum(d * (w / total) for d, w in zip(deltas, weights))
        mean_sq += float(np.sum(mean * mean))
        for k, delta in enumerate(deltas):
            norms_sq[k] += float(np.sum(delta * delta))
            dots[k] += float(np.sum(delta * mean))
    norms = np.sqrt(norms_sq)
    mean_norm = math.sqrt(mean_sq)
    # ||Delta_k - m||^2 = ||Delta_k||^2 - 2 <Delta_k, m> + ||m||^2
    spread = np.maximum(norms_sq - 2 * dots + mean_sq, 0.0)
    cosines = [float(dot / (norm * mean_norm)) if norm > 0 and mean_norm > 0 else math.nan
               for dot, norm in zip(dots, norms)]
    return {
        "update-norm": mean_norm,
        "client-update-norm": float(np.mean(norms)) if count else math.nan,
        "drift-dispersion": float(np.mean(spread) / mean_sq) if mean_sq > 0 else math.nan,
        "update-cosine": float(np.mean(cosines)) if count else math.nan,
        "client-update-norms": [float(v) for v in norms],
        "client-update-cosines": cosines,
    }
