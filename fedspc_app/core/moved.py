"""Former module paths kept as aliases after a module moved, so that code written
against them still runs (``fedspc_app/core/models.py``, ``core/training.py``)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(former: str, home: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``former`` that looks every name up in ``home``,
    with a DeprecationWarning naming the new home."""
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{former} moved to {home}; import {name} from there",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    return __getattr__
