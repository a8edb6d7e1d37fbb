"""The client of an ``[[env]]``'s server, whoever serves it: rlbus's env server or verifiers'."""

from workers.env_config import EnvConfig
from workers.envs.openenv_env import OpenEnvHandle
from workers.envs.server import EnvHandle
from workers.envs.verifiers_env import VerifiersHandle


async def start_env(env: EnvConfig, timeout_s: float, serve: bool = True,
                    curve_dir: str | None = None) -> EnvHandle | VerifiersHandle | OpenEnvHandle:
    """Connect to (or spawn) the env's server; every handle answers ``info()`` with the dataset ``size``.
    ``serve=False``: a verifiers or OpenEnv env starts no server (its size is known client-side). ``curve_dir``:
    the CURVE keys of an rlbus env server at a ``tcp://`` address (``rollout.curve_dir``)."""
    if env.kind == "openenv":
        return await OpenEnvHandle.start(env, timeout_s=timeout_s, serve=serve)
    if env.kind == "verifiers":
        return await VerifiersHandle.start(env, serve=serve)
    return await EnvHandle.start(env, timeout_s=timeout_s, curve_dir=curve_dir)
