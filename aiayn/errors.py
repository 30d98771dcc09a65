"""User errors: problems the user caused and can fix, reported as one line and exit status 2.

Every layer raises a subclass of :class:`UserError` for bad input (a config key, a corpus line, a
broken checkpoint, a device that is not there); the command line's single error boundary
(:func:`aiayn.cli.main`) prints ``aiayn: error: <message>`` and exits 2. Anything else is a bug and
keeps its traceback (shown with ``-v``). This module imports nothing, so every layer can use it.
"""

from __future__ import annotations


def one_line(message: object) -> str:
    """``str(message)`` folded onto one line (a stderr line must never be broken up)."""
    return " ".join(str(message).split("\n")).strip()


class UserError(Exception):
    """Base class of the errors a user can fix; ``str()`` is one line: what is wrong and where."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(message))


class ConfigError(UserError, ValueError):
    """A config or option that cannot be used: unknown key, wrong type, value out of range, impossible shape."""


class DataError(UserError, ValueError):
    """Unusable input data: missing or unreadable file, bad encoding, mismatched parallel files."""


class CheckpointError(UserError, RuntimeError):
    """A run directory or checkpoint that cannot be read, does not fit the model, or may not be written."""


class DeviceError(UserError, RuntimeError):
    """A device or precision this machine does not offer (``--device cuda`` without CUDA, bf16 on CPU, ...)."""


def require(module: str, extra: str, what: str) -> None:
    """Raise a one-line :class:`ConfigError` when the optional ``module`` is not installed, naming the extra
    that brings it (``pip install 'aiayn[extra]'``). Call it before any work starts."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module} package: pip install 'aiayn[{extra}]'")


__all__ = ["CheckpointError", "ConfigError", "DataError", "DeviceError", "UserError", "one_line", "require"]
