"""Test configuration.

The helpers in tests/ are importable as plain modules. Torch computes on one thread
in the test process: the models here are small, and two threads on a 2-core machine
that is busy (another test worker, the Ray workers of an end-to-end run, a grid)
make every step several times slower. Under pytest-xdist (``pytest -n 2``) the runs
through ``flwr run`` and the deployments share one group, so one worker runs them
one after another while the others take the in-process tests.

On a machine with CUDA, ``device = auto`` trains the tests' runs there, and the
tests that compare two runs bit for bit (resume, held-out clients, the plain loop
against the apps) need kernels that repeat: the session turns on what run-config
``deterministic = true`` turns on (PyTorch's deterministic algorithms, cuDNN's
deterministic mode, a fixed cuBLAS workspace) before CUDA starts. On CPUs it changes
nothing.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

from fedspc_app.training.precision import apply_determinism

# The marks of the tests that start a SuperLink, Ray or SuperNodes.
PROCESS_MARKS = ("e2e", "slow", "deploy")


def pytest_configure(config):
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        apply_determinism(True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Put the tests that start Flower's processes in one xdist group (``--dist loadgroup``)."""
    for item in items:
        if any(item.get_closest_marker(mark) for mark in PROCESS_MARKS):
            item.add_marker(pytest.mark.xdist_group("flower-processes"))


@pytest.fixture
def task_identity():
    """Let ``Message(...)`` be constructed outside a running Flower app."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1
    yield
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = saved
