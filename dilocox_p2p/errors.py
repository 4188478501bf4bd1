"""The exceptions dilocox-p2p raises on purpose.

    DilocoxError
    +-- ConfigError          a config file, flag or value is wrong; the message says which and why
    +-- DataError            the corpus is missing, empty or too small for the sequence length
    +-- CheckpointError      nothing to resume from, or a checkpoint that does not fit this run
    +-- SwarmError           the swarm could not be joined or refused this peer
    |   +-- SwarmUnreachable no initial peer answered at start (exit code 75: try again later)
    |   +-- AdmissionError   another peer of the run has a different config hash, or a closed run's
    |                        allowlist and certificate do not admit this peer's key
    +-- IdentityError        a key or certificate file is missing, unsafe (readable by others) or malformed
    +-- WireRejected         bytes from another peer were refused (malformed, oversized...)
    +-- StageOutOfMemory     an inner step did not fit the device's memory; the message names the flags

The CLI maps every DilocoxError to a one-line message and its `exit_code`: 2 (fix the command,
config or files), except SwarmUnreachable's 75 (temporary: a supervisor should retry).
"""

from __future__ import annotations

__all__ = [
    "AdmissionError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DilocoxError",
    "IdentityError",
    "StageOutOfMemory",
    "SwarmError",
    "SwarmUnreachable",
    "WireRejected",
]


class DilocoxError(Exception):
    """Base class: an error the user can fix; the message names the problem and the fix."""

    exit_code = 2
    """The process exit code the CLI gives it: 2, a usage error (fix the command or its files)."""


class ConfigError(DilocoxError, ValueError):
    """A config file, a flag or a value is invalid."""


class DataError(DilocoxError):
    """The training corpus cannot be used."""


class CheckpointError(DilocoxError):
    """A checkpoint is missing or does not match this run."""


class SwarmError(DilocoxError):
    """The swarm could not be joined or used."""


class SwarmUnreachable(SwarmError):
    """No initial peer could be reached at start: a temporary failure; retrying later may succeed."""

    exit_code = 75  # EX_TEMPFAIL: services restart on it, and stop restarting on 2 (a usage error)


class AdmissionError(SwarmError):
    """This peer was refused by the run (or refused another peer): config hashes differ."""


class IdentityError(DilocoxError):
    """A key or certificate file cannot be used; the message says why and how to fix it."""


class WireRejected(DilocoxError):
    """Bytes from another peer were refused; the message says why. Counted and logged, never fatal."""


class StageOutOfMemory(DilocoxError):
    """An inner step of a stage did not fit its device's memory; the message names the settings that shrink it."""
