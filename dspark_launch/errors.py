"""Error types that carry an exit code, so the entry point can end without a traceback."""

from __future__ import annotations

import math


class LaunchError(Exception):
    """A failure the user can act on: printed as one line, no traceback."""

    exit_code = 1


class ConfigError(LaunchError):
    """Bad flags, bad checkpoint, bad topology: exit code 2."""

    exit_code = 2


def require_positive(name: str, value: float | int | None, allow_zero: bool = False) -> None:
    """A count or duration: finite and >= 1 (>= 0 with allow_zero); None passes (unset)."""
    if value is None:
        return
    bound = ">= 0" if allow_zero else ">= 1"
    if not math.isfinite(value):  # nan compares false to everything, and passed
        raise ConfigError(f"{name}={value} must be a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value} must be {bound}")


class RuntimeFailure(LaunchError):
    """A failure while running (a rank died, a collective timed out): exit code 1."""

    exit_code = 1
