"""Errors raised for bad user input, before any training starts."""


class FedSPCError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(FedSPCError, ValueError):
    """A run-config value is unknown, out of range or inconsistent."""


class DataError(FedSPCError, RuntimeError):
    """A dataset is missing, corrupt or cannot be partitioned as asked."""


class DivergenceError(FedSPCError, FloatingPointError):
    """Local training produced a non-finite loss or parameter."""


class BusyError(FedSPCError, RuntimeError):
    """A results folder is in use by another process (a run or a grid)."""


class LockError(FedSPCError, RuntimeError):
    """A lock file cannot be used: its filesystem does not support ``flock``, or it is
    not a regular file."""


def one_line(err: BaseException, limit: int = 200) -> str:
    """One-line ``Type: message`` summary of an exception, for user-facing messages."""
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


class MessageError(FedSPCError, ValueError):
    """A server message a client cannot use: a field of the wrong type or out of
    range, or arrays that do not fit the model."""
