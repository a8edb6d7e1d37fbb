"""OpenEnv environments (OpenEnv's env-server protocol: reset, step, state over a WebSocket session).

    [[env]]
    name = "hotcold"
    openenv = { app = "my_game.server:app", num_episodes = 1000 }     # spawned: uvicorn my_game.server:app
    # openenv = { base_url = "http://game-host:8000" }                # or an external server
    max_turns = 3

:class:`OpenEnvHandle` answers the calls rlbus's own env servers answer (``info``, ``initial``, ``step``, ``score``),
so the rollout worker plays an OpenEnv episode like any multi-turn env of its own: the model's reply is the action
(``{action_field: reply}``), the observation's ``observation_field`` the next user turn, the sum of the steps'
rewards the sample's reward; env turns are out of the loss mask, every call bounded by ``rollout.env_timeout_s``, a
failed episode retried and then dead-lettered like any rollout. Episode ``i`` is ``reset(seed=i)``, so an example
index names a reproducible episode; each episode runs in its own WebSocket session, opened at its first step and
closed when it ends, or when its attempt fails (a call of its own that fails or is cancelled closes it, and the
rollout worker releases the sessions of a failed group's episodes), so a server with a session cap never fills with
dead episodes. A spawned server that has died is started again at the next episode.

Importing this module does not import openenv; a missing extra is a ConfigError naming the install command.
"""

import asyncio
import importlib
import importlib.util
import os
import sys
import time
import uuid
from typing import Any

import aiohttp

from bus.errors import ConfigError, EnvUnavailableError, RpcError
from bus.local_redis import free_port
from bus.log import get_logger
from workers.env_config import OPENENV_INSTALL, EnvConfig
from workers.envs.spawned import ServerHandle


def require_openenv() -> Any:
    """OpenEnv's generic client class (the ``openenv`` package); a one-line ConfigError naming the install command
    when it is missing."""
    if importlib.util.find_spec("openenv") is None:
        raise ConfigError(f"an OpenEnv [[env]] (openenv = ...) needs the openenv extra: {OPENENV_INSTALL}")
    return importlib.import_module("openenv.core.generic_client").GenericEnvClient


class OpenEnvHandle(ServerHandle):
    """One OpenEnv server (spawned and owned unless ``base_url`` is set), one session per episode."""

    def __init__(self, env: EnvConfig, timeout_s: float):
        super().__init__()
        self.env_config = env
        self.cfg = env.openenv
        self.name = env.resolved_name
        self.timeout_s = timeout_s
        self.base_url = self.cfg.base_url or ""
        self.spawned = self.cfg.base_url is None
        self.restarts = 0
        self.sessions: dict[str, Any] = {}
        """Open episode sessions by id (the id rides in the episode's state)."""
        self._lock = asyncio.Lock()
        self._client_cls: Any = None
        self.log = get_logger(worker="env_handle", env=self.name)

    @classmethod
    async def start(cls, env: EnvConfig, timeout_s: float = 30.0, serve: bool = True) -> "OpenEnvHandle":
        handle = cls(env, timeout_s)
        if not serve:
            return handle
        handle._client_cls = require_openenv()
        return await handle._connected(handle._ensure_server())

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.cfg.num_episodes, "max_turns": self.env_config.max_turns}

    async def initial(self, index: int) -> dict[str, Any]:
        """Episode ``index``'s first observation (the prompt), from a session opened and closed for it: the group's
        episodes each replay the same reset in their own session at their first step."""
        await self._ensure_server()
        session, observation = await self._open(index)
        await self._close_session(session)
        return {"messages": [self._user(observation)], "state": {"session": None, "reward": 0.0, "steps": 0}}

    async def step(self, index: int, messages: list[dict], state: dict) -> dict[str, Any]:
        """The model's last reply as the action; the observation as the next user turn."""
        session = state.get("session")
        if session not in self.sessions:  # the episode's first step: its own session, reset to the same episode
            session, _ = await self._open(index)
        reply = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        try:
            result = await self._call(self.sessions[session].step({self.cfg.action_field: reply}))
        except BaseException:  # failed or cancelled: the episode will not step again
            await self._close_session(session)
            raise
        state = {"session": session, "reward": state.get("reward", 0.0) + float(result.reward or 0.0),
                 "steps": state.get("steps", 0) + 1}
        if result.done:
            await self._close_session(session)
        return {"messages": [] if result.done else [self._user(result.observation)], "done": bool(result.done),
                "state": state}

    async def score(self, index: int, messages: list[dict], state: dict) -> dict[str, Any]:
        """The episode's reward: the sum of its steps' rewards (its session closed if still open)."""
        await self._close_session(state.get("session"))
        return {"reward": float(state.get("reward", 0.0)), "metrics": {"env_steps": float(state.get("steps", 0))}}

    async def release(self, state: dict) -> None:
        """An episode that ends unscored (its attempt failed): its session closed."""
        await self._close_session(state.get("session"))

    async def close(self) -> None:
        for session in list(self.sessions):
            await self._close_session(session)
        await super().close()

    async def _open(self, index: int) -> tuple[str, Any]:
        client = self._client_cls(base_url=self.base_url, message_timeout_s=self.timeout_s)
        session = uuid.uuid4().hex
        self.sessions[session] = client
        try:
            try:
                await self._call(client.connect())
            except RpcError as e:  # no connection at all: the server is down, not the task bad
                raise EnvUnavailableError(str(e)) from e
            result = await self._call(client.reset(seed=index, **self.cfg.reset_args))
        except BaseException:  # a reset refused (a full server) or cancelled: the session must not stay open
            await self._close_session(session)
            raise
        return session, result.observation

    async def _close_session(self, session: str | None) -> None:
        client = self.sessions.pop(session, None) if session else None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.timeout_s)
            except Exception as e:  # a session of a dead server: nothing left to close
                self.log.debug("openenv_session_close_failed", error=str(e))

    async def _call(self, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except Exception as e:  # the remote call's boundary: a closed socket, an error reply, a timeout
            raise RpcError(f"OpenEnv server {self.base_url} of env {self.name!r} failed: {e}") from e

    def _user(self, observation: Any) -> dict[str, str]:
        if isinstance(observation, dict) and self.cfg.observation_field in observation:
            return {"role": "user", "content": str(observation[self.cfg.observation_field])}
        return {"role": "user", "content": str(observation)}

    async def _ensure_server(self) -> None:
        """Spawn the server (again, if it died) and wait for its ``/health``; an external one is left as it is.
        A restart that fails is EnvUnavailableError (the rollout worker holds the task)."""
        async with self._lock:
            exited = self._server.exited
            if self.spawned and (exited is None or exited.done()):
                if exited is None:
                    await self._spawn()
                    return
                self.restarts += 1
                self.log.warning("env_server_restarted", reason=f"exit code {exited.result()}",
                                 restarts=self.restarts)
                try:
                    await self._spawn()
                except (RpcError, OSError) as e:
                    raise EnvUnavailableError(f"OpenEnv server of env {self.name!r} could not be started again: "
                                              f"{e}") from e

    async def _spawn(self) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "uvicorn", self.cfg.app, "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        await self._server.start(argv, env, own_session=True)
        await self._wait_healthy(self.cfg.start_timeout_s)
        self.log.info("openenv_server_spawned", pid=self.pid, base_url=self.base_url, app=self.cfg.app)

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                exited = self._server.exited
                if exited is not None and exited.done():
                    raise RpcError(f"OpenEnv server {self.cfg.app!r} exited with code {exited.result()} "
                                   "before it was healthy; its error is in the log above")
                try:
                    async with http.get(f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RpcError(f"OpenEnv server {self.base_url} of env {self.name!r} not healthy within "
                                   f"{timeout_s:.0f} s")
                await asyncio.sleep(0.3)
