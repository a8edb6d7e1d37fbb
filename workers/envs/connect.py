"""The client of an ``[[env]]``'s server, whoever serves it: rlbus's env server or verifiers'."""

from workers.env_config import EnvConfig
from workers.envs.server import EnvHandle
from workers.envs.verifiers_env import VerifiersHandle


async def start_env(env: EnvConfig, timeout_s: float, serve: bool = True) -> EnvHandle | VerifiersHandle:
    """Connect to (or spawn) the env's server; both handles answer ``info()`` with the dataset ``size``.
    ``serve=False``: a verifiers env only loads its taskset (its size is known client-side, no server needed)."""
    if env.kind == "verifiers":
        return await VerifiersHandle.start(env, serve=serve)
    return await EnvHandle.start(env, timeout_s=timeout_s)
