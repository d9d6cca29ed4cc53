"""Things of the user's own named in the run-config as ``package.module:attribute``:
a model (``model = "my_models:build_net"``, a function that builds it) or a method
(``method = "my_methods:FEDPER_WARMUP"``, a
:class:`~fedspc_app.core.methods.Method`), so that neither needs a change to this
package. The module is imported where it is
needed, so it must be importable wherever the ServerApp and the ClientApps run."""

from __future__ import annotations

import importlib
import re
from typing import Any

from fedspc_app.core.errors import ConfigError

PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""``package.module:attribute``."""
WHERE = ("an installed package, a folder on PYTHONPATH, or a module inside fedspc_app/, "
         "which the FAB carries")
"""Where such a module can live so that every party can import it."""


def is_named(value: str) -> bool:
    """Whether a run-config value names something of the user's own (it has a ``:``)."""
    return ":" in value


def check_name(key: str, value: str, example: str) -> None:
    """Raise ConfigError unless ``value`` has the form ``package.module:attribute``."""
    if not PATTERN.fullmatch(value):
        raise ConfigError(
            f"run-config '{key}' = {value!r}: one of your own is named "
            f"'package.module:attribute', e.g. {example!r}")


def import_named(key: str, value: str, example: str) -> Any:
    """The attribute ``value`` names (``package.module:attribute``), imported; one
    ConfigError naming the module or the attribute when it cannot be."""
    check_name(key, value, example)
    module_name, _, attribute = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"run-config '{key}' = {value!r}: cannot import {module_name!r} ({error}); "
            f"the module must be importable where the ServerApp and every ClientApp "
            f"run ({WHERE})") from None
    if not hasattr(module, attribute):
        raise ConfigError(f"run-config '{key}' = {value!r}: {module_name} has no "
                          f"{attribute!r}")
    return getattr(module, attribute)
