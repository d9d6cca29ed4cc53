"""The FedSPC / SCAFFOLD arithmetic shared by the client and the server.

Both sides compute the shared update and the reference change with these
functions, on the same float32 arrays (the server's broadcast and the client's
reply), so a reference change derived by the server is bit-identical to the one
the client applies to its own ``u_k``. The server's update of ``u_bar`` from the
clients' changes is :func:`global_reference_update`, used by the FedSPC strategy and
by the plain loop (:mod:`fedspc_app.serial`) alike.

Notation (the paper's Algorithm 1): ``theta_s`` the shared parameters, ``u_bar``
the server's global drift reference, ``u_k`` client k's local reference, ``E`` the
number of optimizer steps that updated the shared block in the round, ``eta`` the
local learning rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from fedspc_app.core.records import ArrayDict


def shared_update(final: Mapping[str, np.ndarray], initial: Mapping[str, np.ndarray],
                  keys: Iterable[str]) -> ArrayDict:
    """``Delta theta_k = theta_{s,k}^{t,E} - theta_s^t`` over ``keys`` (float32)."""
    return {
        key: np.subtract(final[key], initial[key], dtype=np.float32) for key in keys
    }


def reference_change(update: Mapping[str, np.ndarray],
                     global_reference: Mapping[str, np.ndarray], *, steps: int,
                     learning_rate: float) -> ArrayDict:
    """``u_k^{t+1} - u_k^t = -u_bar^t - Delta theta_k / (E eta)`` (Algorithm 1, step 3).

    This is also SCAFFOLD's option-II control-variate update
    ``c_k^+ - c_k = -c + (x - y_k) / (K eta)``. ``update`` and ``global_reference``
    have the same keys (the corrected parameters).
    """
    if steps <= 0:
        raise ValueError(
            "the reference change needs at least one optimizer step on the shared "
            f"block, got {steps}"
        )
    scale = np.float32(1.0 / (steps * learning_rate))
    return {
        key: (-global_reference[key] - update[key] * scale).astype(np.float32, copy=False)
        for key in global_reference
    }


def uncorrected_step(final: Mapping[str, np.ndarray], global_reference: Mapping[str, np.ndarray],
                     local_reference: Mapping[str, np.ndarray], *,
                     steps: int | Mapping[str, int], learning_rate: float) -> ArrayDict:
    """``theta_{s,k} + E eta (u_bar - u_k)`` over the corrected keys (float32), the others
    as they are: where the shared block would end had the round's correction not moved
    it, so that its update is ``-E eta g_k``, the steps of the gradients alone along the
    corrected path (``dp-reference = "level"``: what a client releases under privacy).
    ``steps`` is E, or per key the steps that corrected it (a method whose shared phases
    train different parts of the block). Its reference change is then
    :func:`reference_change` of that update against ``u_k`` in place of ``u_bar``: the
    same new ``u_k``, ``g_k``, as Algorithm 1's."""
    def scale(key):
        return np.float32((steps[key] if isinstance(steps, Mapping) else steps) * learning_rate)

    return {key: (np.add(value, scale(key) * (global_reference[key] - local_reference[key]),
                         dtype=np.float32) if key in global_reference else value)
            for key, value in final.items()}


def zeros_like(arrays: Mapping[str, np.ndarray], keys: Iterable[str]) -> ArrayDict:
    """Zero float32 arrays shaped like ``arrays[key]`` for each key (``u^0 = 0``)."""
    return {key: np.zeros(np.shape(arrays[key]), dtype=np.float32) for key in keys}


def add(base: Mapping[str, np.ndarray], change: Mapping[str, np.ndarray]) -> ArrayDict:
    """``base + change`` key by key (float32)."""
    return {key: np.add(base[key], change[key], dtype=np.float32) for key in base}


def global_reference_update(global_reference: Mapping[str, np.ndarray],
                            changes: Iterable[Mapping[str, np.ndarray]],
                            num_clients: int) -> ArrayDict:
    """``u_bar^{t+1} = u_bar^t + (1/K) sum_{k in S_t} (u_k^{t+1} - u_k^t)`` (Algorithm 1,
    step 4), the server's side of :func:`reference_change`.

    ``changes`` are the reference changes of the clients that trained this round,
    taken one at a time (memory stays at one client's change) and summed in float64
    in the order given; ``num_clients`` is K, every client of the run, so u_bar stays
    the mean of all the u_k under partial participation. The result is float32.
    """
    total = {key: np.zeros(value.shape, dtype=np.float64)
             for key, value in global_reference.items()}
    for change in changes:
        for key, value in change.items():
            total[key] += value
    return {key: (global_reference[key] + total[key] / num_clients).astype(np.float32)
            for key in global_reference}
