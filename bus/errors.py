"""The error hierarchy shared by every worker.

Catch at one boundary per message: retry (RetryableError), dead-letter (DecodeError and
anything that can never succeed), crash on everything else so the supervisor restarts the worker.
"""


CONFIG_EXIT_CODE = 2
"""Exit status of a process that stopped on a ConfigError: restarting it cannot help, so nobody does."""


class RlbusError(Exception):
    """Base of every error rlbus raises on purpose."""


class ConfigError(RlbusError, ValueError):
    """A configuration value is wrong; the message names the field and the fix (the CLI prints it, exit 2)."""


class DecodeError(RlbusError):
    """A stream entry or RPC frame could not be decoded (unknown schema version, missing field, garbage)."""


class RetryableError(RlbusError):
    """A failure worth retrying after `delay_s` seconds (up to the caller's limit)."""

    def __init__(self, message: str, delay_s: float = 1.0):
        super().__init__(message)
        self.delay_s = delay_s


class RpcError(RlbusError):
    """The remote side of a ZeroMQ RPC raised; the message carries its error type and text."""


class RpcTimeoutError(RpcError):
    """A ZeroMQ RPC call got no reply within its timeout; the message names the address."""


class EnvUnavailableError(RetryableError):
    """An env server is unreachable, dead or cannot be started: the infrastructure's fault, not the task's (the
    rollout worker holds the task until the server answers)."""


class RedisNotInstalledError(RlbusError):
    """No redis-server binary on PATH."""


class CollapseError(RlbusError):
    """Too many consecutive zero-variance groups: the run stops (ART's collapse failsafe)."""
