"""Error types that carry an exit code, so the entry point can end without a traceback."""

from __future__ import annotations


class LaunchError(Exception):
    """A failure the user can act on: printed as one line, no traceback."""

    exit_code = 1


class ConfigError(LaunchError):
    """Bad flags, bad checkpoint, bad topology: exit code 2."""

    exit_code = 2


class RuntimeFailure(LaunchError):
    """A failure while running (a rank died, a collective timed out): exit code 1."""

    exit_code = 1
