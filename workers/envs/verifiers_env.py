"""verifiers v1 environments (prime-rl's contract): an ``[[env]]`` with ``taskset = {id = ...}``.

Client side (the rollout worker, the feeder): :class:`VerifiersHandle` loads the taskset here, as prime-rl's
orchestrator does (the data never lives in the env server), and talks to verifiers' own env server over its v1
ZeroMQ protocol (``run`` with streamed deltas and a final reply, ``health``, ``cancel`` when a run is abandoned).
The server is verifiers' ``serve_env``: spawned here (``python -m workers.envs.verifiers_env``) on an ipc://
socket and restarted when it dies, or an external one at ``address``.

    [[env]]
    taskset = { id = "reverse-text", num_tasks = 500 }          # the taskset package and its own args
    agent = { harness = { id = "rlbus-chat" }, runtime = { type = "subprocess" } }
    timeout = { episode = 120 }
    pool = { type = "static", num_workers = 1 }

An unset harness is ``rlbus-chat`` (:mod:`rlbus_chat`: the chat loop in-process, ~0.05 s per episode on the tiny
model) rather than verifiers' ``null`` (a new ``uv run`` program per episode: ``uv``, a package index or a wheel
cache, and seconds each); an unset runtime is ``subprocess`` (verifiers defaults to a hosted one).

Importing this module does not import verifiers; :func:`require_verifiers` turns its absence into a ConfigError.
"""

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import shutil
import sys
from typing import Any

from bus.errors import ConfigError, EnvUnavailableError, RpcError
from bus.log import get_logger
from workers.env_config import VERIFIERS_INSTALL, EnvConfig
from workers.envs.spawned import ServerHandle

DEFAULT_AGENT = {"harness": {"id": "rlbus-chat"}, "runtime": {"type": "subprocess"}}
"""What an agent seat the config leaves unset plays with: the in-process harness on the local machine."""
HEALTH_EVERY_S = 2.0
HEALTH_MISSES = 3
"""An external server that misses this many health checks in a row (HEALTH_EVERY_S apart) fails its runs."""
ANSWER_FIELD = "answer"
"""The task field a verifiers env's sft from references trains on (verifiers' reference judge's default)."""
UV_HARNESSES = frozenset({"null", "bash"})
"""verifiers harnesses that start their program with ``uv run`` (a package index or a wheel cache at run time)."""


def require_verifiers() -> Any:
    """The ``verifiers.v1`` module; a one-line ConfigError naming the install command when it is missing."""
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(f"a verifiers [[env]] (taskset = ...) needs the verifiers extra: {VERIFIERS_INSTALL}")
    return importlib.import_module("verifiers.v1")


def vf_config_data(env: EnvConfig) -> dict[str, Any]:
    """The verifiers env config of an ``[[env]]`` as plain data: its taskset, agents (unset parts defaulted, see
    :data:`DEFAULT_AGENT`), timeouts and env id, resolved and checked by verifiers itself."""
    require_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    raw = {"taskset": dict(env.taskset or {}), "timeout": dict(env.timeout), **env.roles}
    if env.vf_id:
        raw["id"] = env.vf_id
    try:
        cls = type(resolve_env_config(dict(raw)))
        for role in agent_config_fields(cls()):
            given = dict(raw.get(role) or {})
            raw[role] = {**{k: v for k, v in DEFAULT_AGENT.items() if given.get(k) is None}, **given}
        data = resolve_env_config(raw).model_dump(mode="json")
    except (ValueError, TypeError, ImportError) as e:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"env {env.resolved_name!r}: verifiers rejects its config: {_first_line(e)}") from e
    uv_harnesses = [role for role in data if isinstance(data[role], dict)
                    and (data[role].get("harness") or {}).get("id") in UV_HARNESSES]
    if uv_harnesses and shutil.which("uv", path=_server_path()) is None:
        raise ConfigError(f"env {env.resolved_name!r}: the harness of {uv_harnesses} runs its program with `uv run`, "
                          f"and uv is not on PATH; {VERIFIERS_INSTALL} installs it (or use harness id 'rlbus-chat')")
    return data


def load_tasks(env: EnvConfig, config_data: dict[str, Any]) -> list[dict[str, Any]]:
    """The taskset's tasks as wire data (what ``run`` takes), in ``load()`` order; an infinite taskset is cut at
    ``max_tasks``."""
    from verifiers.v1.utils.loaders import load_taskset, resolve_env_config

    taskset = load_taskset(resolve_env_config(config_data).taskset)
    if env.max_tasks is not None:
        taskset = taskset.take(env.max_tasks)
    elif not taskset.bounded:
        raise ConfigError(f"env {env.resolved_name!r}: taskset {env.taskset['id']!r} is infinite; "
                          "set max_tasks = N in its [[env]]")
    return [task.data.model_dump(mode="json") for task in taskset]


def task_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a chat seat opens task ``data`` (wire data) with: its system prompt, then its prompt (a
    string as the user's turn, or messages as given), as ``rlbus-chat`` sends it."""
    messages = [{"role": "system", "content": data["system_prompt"]}] if data.get("system_prompt") else []
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        messages += [dict(m) for m in prompt]
    return messages


def reference_answer(data: dict[str, Any]) -> str | None:
    """Task ``data``'s reference answer: its ``answer`` field (the field verifiers' reference judge reads by
    default; of a list of acceptable answers, the first); None when it has none."""
    answer = data.get(ANSWER_FIELD)
    if isinstance(answer, list):
        answer = answer[0] if answer else None
    return None if answer is None or answer == "" else str(answer)


class VerifiersHandle(ServerHandle):
    """The client of one verifiers env server (spawned and owned unless ``address`` is set) plus the taskset."""

    def __init__(self, env: EnvConfig, config_data: dict[str, Any], tasks: list[dict[str, Any]],
                 start_timeout_s: float):
        super().__init__()
        self.env_config = env
        self.name = env.resolved_name
        self.config_data = config_data
        self.tasks = tasks
        self.start_timeout_s = start_timeout_s
        self.spawned = env.address is None
        self.address = env.address or ""
        self.restarts = 0
        self._client: Any = None
        self._lost: asyncio.Future | None = None
        """External server: done while it is not answering health (see :meth:`_watch`)."""
        self._watchdog: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.log = get_logger(worker="env_handle", env=self.name)

    @classmethod
    async def start(cls, env: EnvConfig, start_timeout_s: float = 120.0, serve: bool = True) -> "VerifiersHandle":
        """Load the taskset and (``serve``) connect to, or spawn, the env server and wait for its ``health``."""
        config_data = vf_config_data(env)
        tasks = await asyncio.to_thread(load_tasks, env, config_data)
        if not tasks:
            raise ConfigError(f"env {env.resolved_name!r}: taskset {env.taskset['id']!r} has no tasks")
        handle = cls(env, config_data, tasks, start_timeout_s)
        return await handle._connected(handle._connect()) if serve else handle

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "size": len(self.tasks), "taskset": self.env_config.taskset["id"]}

    async def run(self, index: int, client: dict[str, Any], model: str, sampling: dict[str, Any]) -> Any:
        """One episode of task ``index`` (a verifiers ``WireEpisode``). Cancelling it cancels the run on the server;
        a spawned server that dies fails it at once (RpcError) and is started again for the next run; an external
        one that stops answering health fails it within HEALTH_MISSES * HEALTH_EVERY_S. EnvUnavailableError (the
        rollout worker holds the task): the external server does not answer health, or the spawned one could not be
        started again."""
        from verifiers.v1.clients import TrainClientConfig
        from verifiers.v1.types import SamplingConfig

        async with self._lock:  # not while a restart is under way
            rpc, exited, generation = self._client, self._server.exited or self._lost, self.restarts
        run = asyncio.ensure_future(rpc.run(TrainClientConfig.model_validate(client), model,
                                            SamplingConfig.model_validate(sampling), self.tasks[index]))
        waits = {run} if exited is None else {run, exited}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not run.done():
                run.cancel()  # our caller gave up (timeout) or the server died: tell the server to stop the run
        if run.done() and not run.cancelled():
            return run.result()
        if not self.spawned:
            raise EnvUnavailableError(f"verifiers env server {self.name!r} at {self.address} stopped answering health "
                                      "during a run")
        code = exited.result() if exited is not None and exited.done() else None
        try:
            await self._restart(generation, reason=f"exit code {code}")
        except (RpcError, OSError) as e:
            raise EnvUnavailableError(f"verifiers env server {self.name!r} could not be started again: {e}") from e
        raise RpcError(f"verifiers env server {self.name!r} died (exit code {code}) during a run")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        await super().close()

    async def _connect(self) -> None:
        from verifiers.v1.serve.client import EnvClient

        if self.spawned:
            await self._spawn()
        self._client = EnvClient(self.address)
        health = asyncio.ensure_future(self._client.wait_for_server_startup(self.start_timeout_s, interval=0.2))
        exited = self._server.exited
        await asyncio.wait({health} if exited is None else {health, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not health.done():
            health.cancel()
            raise RpcError(f"verifiers env server {self.name!r} exited with code {exited.result()} before "
                           "answering health; its error is in the log above")
        health.result()
        if not self.spawned:
            self._lost = asyncio.get_running_loop().create_future()
            self._watchdog = asyncio.ensure_future(self._watch())
        self.log.info("vf_env_server_ready", address=self.address, pid=self.pid, tasks=len(self.tasks))

    async def _watch(self) -> None:
        """External server: ``health`` every HEALTH_EVERY_S; HEALTH_MISSES misses in a row mark it lost (the runs in
        flight fail), an answer again marks it back."""
        misses = 0
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            try:
                healthy = await self._client.health(timeout=HEALTH_EVERY_S)
            except Exception:  # an error reply is as good as no reply
                healthy = False
            misses = 0 if healthy else misses + 1
            if misses >= HEALTH_MISSES and not self._lost.done():
                self.log.warning("env_server_lost", address=self.address, misses=misses)
                self._lost.set_result(misses)
            elif healthy and self._lost.done():
                self._lost = asyncio.get_running_loop().create_future()

    async def _spawn(self) -> None:
        self.address = self._server.socket_address(self.restarts)
        argv = [sys.executable, "-m", "workers.envs.verifiers_env", "--bind", self.address,
                "--config", json.dumps(self.config_data), "--pool", json.dumps(self.env_config.pool)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": _server_path()}
        # Its own session: a Ctrl-C or SIGTERM to the run's process group reaches the worker, which drains its
        # runs and then stops this server; the server dies with the worker all the same (PDEATHSIG).
        await self._server.start(argv, env, own_session=True)

    async def _restart(self, generation: int, reason: str) -> None:
        if not self.spawned:
            return
        async with self._lock:
            if self.restarts != generation:
                return  # a concurrent run already restarted it
            self.restarts += 1
            self.log.warning("env_server_restarted", reason=reason, restarts=self.restarts)
            if self._client is not None:
                await self._client.close()
                self._client = None
            await self._server.stop()
            await self._connect()


def _server_path() -> str:
    """The spawned server's PATH: this interpreter's bin folder first, so the ``uv`` the verifiers extra installed
    into this environment is found even when the environment is not activated."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def _first_line(error: Exception) -> str:
    return " ".join(str(error).split())[:400]


def main(argv: list[str] | None = None) -> int:
    """Serve one verifiers env (``serve_env``) at ``--bind`` until SIGTERM; what :class:`VerifiersHandle` spawns."""
    parser = argparse.ArgumentParser(prog="python -m workers.envs.verifiers_env")
    parser.add_argument("--bind", required=True, help="ZeroMQ address to bind")
    parser.add_argument("--config", required=True, help="the verifiers env config as JSON")
    parser.add_argument("--pool", default="{}", help="verifiers' serve pool config as JSON ({} = one server)")
    args = parser.parse_args(argv)
    require_verifiers()
    from verifiers.v1.configs.serve import ServeConfig, pool_serve_kwargs
    from verifiers.v1.serve import serve_env

    pool = json.loads(args.pool)
    kwargs = pool_serve_kwargs(ServeConfig(pool=pool).pool) if pool else {"max_workers": 1}
    serve_env(address=args.bind, config_data=json.loads(args.config), **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
