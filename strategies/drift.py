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
``finals``). Computed in float64 a chunk of a key at a time, so memory stays at a
chunk per client whatever the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedspc_app.core.records import ArrayDict
from strategies.aggregation import CHUNK  # entries of a key taken at once


def drift_statistics(broadcast: Mapping[str, np.ndarray], finals: Sequence[ArrayDict],
                     weights: Sequence[float], keys: Sequence[str]
                     ) -> dict[str, float | list[float]]:
    """The diagnostics above over ``keys`` (each reply's final shared arrays)."""
    total = float(sum(weights))
    count = len(finals)
    shares = np.array([w / total for w in weights], dtype=np.float64)
    mean_sq = 0.0
    norms_sq = np.zeros(count)
    dots = np.zeros(count)
    buffer = np.empty((count, CHUNK))
    # Each key a chunk at a time, the clients' deltas in float64 in one reused buffer,
    # the sums by einsum (no BLAS: its threads slow a busy machine's server down).
    for key in keys:
        base = np.ravel(broadcast[key])
        flats = [np.ravel(final[key]) for final in finals]
        for start in range(0, base.size, CHUNK):
            stop = min(base.size, start + CHUNK)
            deltas = buffer[:, :stop - start]
            for k, flat in enumerate(flats):
                np.subtract(flat[start:stop], base[start:stop], out=deltas[k],
                            dtype=np.float64)
            mean = np.einsum("k,ki->i", shares, deltas)
            mean_sq += float(np.einsum("i,i->", mean, mean))
            norms_sq += np.einsum("ki,ki->k", deltas, deltas)
            dots += np.einsum("ki,i->k", deltas, mean)
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
