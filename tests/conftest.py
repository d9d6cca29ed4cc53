"""Test configuration: the helpers in tests/ are importable as plain modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402


@pytest.fixture
def task_identity():
    """Let ``Message(...)`` be constructed outside a running Flower app."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1
    yield
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = saved
