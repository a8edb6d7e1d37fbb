"""``rlbus env``: serve one environment over ZeroMQ RPC, and :class:`EnvHandle`, its client side.

Server: ``rlbus env @ run.toml --name ENV_NAME [--bind ADDR]`` serves the ``[[env]]`` (or
``[[eval.env]]``) called ENV_NAME; ``rlbus env --id reverse_text --args '{"num_examples": 100}'
--bind tcp://127.0.0.1:5555`` needs no config. Methods (plain msgpack data in and out)::

    info()                          -> {name, size, max_turns, reward_names}
    example(index)                  -> dict
    initial(index)                  -> {"messages": [...], "state": {...}}
    reference(index)                -> str (the example's reference answer; envs that have them)
    step(index, messages, state)    -> {"messages": [...], "done": bool, "state": {...}}
    score(index, messages, state)   -> {"reward": float, "metrics": {name: float}}

Client: ``await EnvHandle.start(env_config, timeout_s)`` connects to ``env_config.address``, or
(no address) spawns a server process on an ipc:// socket in a temp dir and owns it: a spawned
server that dies is started again and the interrupted call retried once; ``close()`` stops it.
A server that is down (no reply, and ``info`` unanswered within :data:`HEALTH_TIMEOUT_S`; a spawned
one that cannot be started again) fails the call with :class:`~bus.errors.EnvUnavailableError`, the
infrastructure's fault, which the rollout worker waits out; until it answers ``info`` again, each
call first asks it, so a call fails fast while it is down.

User code runs off the server's event loop (:mod:`bus.rpc`), so a slow call holds up no other. A call
that does not return within ``--call-timeout-s`` (a spawned server: :data:`HUNG_FRACTION` of the
handle's per-call timeout, ``rollout.env_timeout_s``) fails with ``CallTimeout`` and the server exits
(:data:`HUNG_EXIT_CODE`), since the stuck thread cannot be stopped: the handle starts a new one and the
calls in flight on the old one are retried there.
"""

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from bus import curve
from bus.errors import ConfigError, EnvUnavailableError, RpcError, RpcTimeoutError
from bus.log import get_logger
from bus.rpc import RpcClient, RpcServer
from workers.config import RlbusConfig
from workers.env_config import EnvConfig
from workers.envs.base import Environment
from workers.envs.registry import load_env
from workers.envs.spawned import ServerHandle
from workers.lifecycle import run_worker

ARGS_VAR = "RLBUS_ENV_ARGS"
"""Environment variable a spawned server reads its env's args from (JSON), so they (secrets, possibly) stay out of
its command line."""
MAX_MESSAGE_MB = 64
"""Default cap on one inbound request (``rlbus env --max-message-mb``): a peer that sends a bigger one is
disconnected unanswered, so no one who reaches the port can make the server take a huge frame."""
HUNG_FRACTION = 0.8
"""A spawned server bounds each call at this fraction of its handle's per-call timeout, so the caller hears
``CallTimeout`` (and the server is replaced) before its own timeout fires."""
HUNG_EXIT_CODE = 3
"""Exit status of an env server that gave up on a hung call."""
HUNG_EXIT_DELAY_S = 0.2
"""How long a server that gave up on a hung call keeps going, so the ``CallTimeout`` reply goes out first."""
HEALTH_TIMEOUT_S = 5.0
"""How long a handle waits for ``info`` when it asks whether its server is up (at most its per-call timeout)."""


def build_env(env_config: EnvConfig) -> Environment:
    """The environment of one ``[[env]]``; ``max_turns`` is capped by the config's."""
    env = load_env(env_config.id, env_config.args)
    env.max_turns = min(env.max_turns, env_config.max_turns)
    return env


class EnvServer:
    """One environment behind an :class:`RpcServer` at ``address``."""

    def __init__(self, env: Environment, address: str, name: str | None = None, call_timeout_s: float | None = None,
                 max_message_mb: float = MAX_MESSAGE_MB, curve_dir: str | None = None):
        self.env = env
        self.name = name or env.name
        self.server = RpcServer(address, call_timeout_s=call_timeout_s, on_hung=self._hung,
                                max_message_bytes=int(max_message_mb * 2**20),
                                curve_dir=Path(curve_dir) if curve_dir else None, handlers={
            "info": lambda: {**env.info(), "name": self.name},
            "example": env.example,
            "initial": env.initial,
            "reference": env.reference,
            "step": env.step,
            "score": env.score,
        })
        self.log = get_logger(worker="env", env=self.name)

    def _hung(self, method: str) -> None:
        """A call of ``method`` outlived the bound: its thread cannot be stopped, so this server exits to be
        replaced (after the ``CallTimeout`` reply is sent)."""
        self.log.error("env_call_hung", method=method, call_timeout_s=self.server.call_timeout_s,
                       hint="the env's user code did not return; the server exits and its owner starts a new one")
        asyncio.get_running_loop().call_later(HUNG_EXIT_DELAY_S, os._exit, HUNG_EXIT_CODE)

    async def setup(self) -> None:
        address = self.server.bind()
        self.log.info("env_server_started", address=address, size=len(self.env), max_turns=self.env.max_turns,
                      pid=os.getpid(), curve=self.server.curve_dir is not None)
        if address.startswith("tcp://") and self.server.curve_dir is None:
            self.log.warning("env_server_unauthenticated", address=address,
                             hint="any peer that reaches this port can call the env and read its examples; pass "
                                  "--curve-dir with the run's keys (rlbus run writes OUTPUT_DIR/curve)")

    async def run(self) -> None:
        await self.server.serve()

    async def close(self) -> None:
        await self.server.close()
        self.log.info("env_server_stopped")

    def request_stop(self) -> None:
        asyncio.ensure_future(self.server.close())


def _env_config(config: RlbusConfig | None, args: argparse.Namespace) -> EnvConfig:
    if args.id:
        args.args = args.args if args.args is not None else os.environ.get(ARGS_VAR, "{}")
        try:
            factory_args = json.loads(args.args)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--args {args.args!r} is not JSON ({e}); pass an object like '{{\"seed\": 1}}'") from e
        if not isinstance(factory_args, dict):
            raise ConfigError(f"--args {args.args!r} must be a JSON object of keyword arguments")
        return EnvConfig(id=args.id, name=args.name, args=factory_args, max_turns=args.max_turns or 8)
    if config is None or not args.name:
        raise ConfigError("rlbus env needs --name ENV_NAME (an [[env]] of the config) or --id ID [--args JSON]")
    envs = {e.resolved_name: e for e in [*config.eval.env, *config.env]}
    if args.name not in envs:
        raise ConfigError(f"no env named {args.name!r} in the config; envs are {sorted(envs)}")
    env_config = envs[args.name]
    return env_config.model_copy(update={"max_turns": args.max_turns}) if args.max_turns else env_config


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    """``rlbus env``: serve one environment until SIGTERM/SIGINT."""

    parser = argparse.ArgumentParser(prog="rlbus env", description="Serve one environment over ZeroMQ RPC.")
    parser.add_argument("--name", help="the [[env]] of the config to serve (with --id: its display name)")
    parser.add_argument("--id", help="env id without a config: built-in name or package.module:factory")
    parser.add_argument("--args", default=None,
                        help=f"JSON object of factory keyword arguments (with --id; default: ${ARGS_VAR} or {{}})")
    parser.add_argument("--max-turns", type=int, default=None, help="cap on model turns (default: the config's)")
    parser.add_argument("--bind", help="ZeroMQ address to bind (default: the env's address)")
    parser.add_argument("--call-timeout-s", type=float, default=None,
                        help="fail a call still running after this long and exit to be replaced (default: no bound)")
    parser.add_argument("--max-message-mb", type=float, default=MAX_MESSAGE_MB,
                        help="largest request accepted; a peer sending a bigger one is disconnected (default: 64)")
    parser.add_argument("--curve-dir", default=None,
                        help="CURVE key folder (rlbus run's OUTPUT_DIR/curve): serve only the run's workers; made "
                             "if missing (default: the config's rollout.curve_dir, else none)")
    args = parser.parse_args(argv)
    env_config = _env_config(config, args)
    address = args.bind or env_config.address
    if not address:
        raise ConfigError(f"env {env_config.resolved_name!r} has no address; pass --bind tcp://127.0.0.1:5555 "
                          "or set address in its [[env]]")
    curve_dir = args.curve_dir or (config.rollout.curve_dir if config is not None else None)
    if curve_dir:
        curve.generate(Path(curve_dir))
    server = EnvServer(build_env(env_config), address, env_config.resolved_name, args.call_timeout_s,
                       args.max_message_mb, curve_dir)
    return asyncio.run(run_worker(server))


class _ServerExited(Exception):
    pass


class EnvHandle(ServerHandle):
    """Async client of one env server; owns (spawns, restarts, stops) it unless the config gives an address.

    Calls are safe to run concurrently. Every method takes keyword arguments as in the module docstring.
    """

    def __init__(self, env_config: EnvConfig, timeout_s: float, curve_dir: str | None = None):
        super().__init__()
        self.env_config = env_config
        self.curve_dir = Path(curve_dir) if curve_dir and (env_config.address or "").startswith("tcp://") else None
        """CURVE keys of a server at a ``tcp://`` address (a spawned one listens on a private ipc:// socket)."""
        self.name = env_config.resolved_name
        self.timeout_s = timeout_s
        self.spawned = env_config.address is None
        self.address = env_config.address or ""
        self.restarts = 0
        self._client: RpcClient | None = None
        self._lock = asyncio.Lock()
        self._down = False
        """The server did not answer ``info``: every call asks it first until it does."""
        self.log = get_logger(worker="env_handle", env=self.name)

    @classmethod
    async def start(cls, env_config: EnvConfig, timeout_s: float = 30.0, start_timeout_s: float = 60.0,
                    curve_dir: str | None = None) -> "EnvHandle":
        """Connect (or spawn and connect) and wait until ``info`` answers; per-call timeout ``timeout_s``."""
        handle = cls(env_config, timeout_s, curve_dir)
        return await handle._connected(handle._connect(start_timeout_s))

    async def _connect(self, start_timeout_s: float) -> None:
        if self.spawned:
            await self._spawn(start_timeout_s)
        else:
            self._client = RpcClient(self.address, self.timeout_s, curve_dir=self.curve_dir)
            await self._client.call("info")

    async def info(self) -> dict[str, Any]:
        return await self.call("info")

    async def example(self, index: int) -> dict[str, Any]:
        return await self.call("example", index=index)

    async def initial(self, index: int) -> dict[str, Any]:
        return await self.call("initial", index=index)

    async def reference(self, index: int) -> str:
        return await self.call("reference", index=index)

    async def step(self, index: int, messages: list[dict], state: dict) -> dict[str, Any]:
        return await self.call("step", index=index, messages=messages, state=state)

    async def score(self, index: int, messages: list[dict], state: dict) -> dict[str, Any]:
        return await self.call("score", index=index, messages=messages, state=state)

    async def release(self, state: dict) -> None:
        """An episode that ends unscored (its attempt failed): nothing to free, its state travels with each call."""

    async def call(self, method: str, **kwargs: Any) -> Any:
        """Call ``method``; a spawned server that has died (or answers nothing, not even ``info``) is restarted and
        the call retried once. EnvUnavailableError: the server is down (see the module docstring)."""
        if not self.spawned:
            return await self._call_external(method, kwargs)
        async with self._lock:  # not while a restart is under way
            generation = self.restarts
        try:
            return await self._call_spawned(method, kwargs)
        except _ServerExited as e:
            reason = str(e)
        except RpcTimeoutError as e:
            if await self._answers():
                raise  # it answers: this call was slow, which is the task's (its data's) doing
            reason = f"not answering ({e})"
        await self._restart_or_unavailable(generation, reason, method)
        if self._server.exited is None or self._server.exited.done():  # a concurrent call's restart failed
            raise EnvUnavailableError(f"env server {self.name!r} is not running (its restart failed)")
        try:
            return await self._call_spawned(method, kwargs)
        except _ServerExited as e:
            raise RpcError(f"env server {self.name!r} died again after a restart during {method!r}: {e}") from e

    async def _call_external(self, method: str, kwargs: dict[str, Any]) -> Any:
        """A call to the server at ``address``; while it is marked down, ``info`` first (fails fast)."""
        assert self._client is not None
        if self._down:
            await self._check(method, "it was down")
        try:
            return await self._client.call(method, **kwargs)
        except RpcTimeoutError as e:
            await self._check(method, str(e))
            raise  # it answers: this call was slow, which is the task's (its data's) doing

    async def _check(self, method: str, why: str) -> None:
        """Ask the server at ``address`` for ``info``: EnvUnavailableError (and marked down) when it does not
        answer."""
        try:
            await self._client.call("info", timeout_s=min(HEALTH_TIMEOUT_S, self.timeout_s))
        except RpcError as e:
            self._down = True
            raise EnvUnavailableError(f"env server {self.name!r} at {self.address} does not answer "
                                      f"({method!r}: {why}; then 'info': {e})") from e
        self._down = False

    async def _answers(self) -> bool:
        """Whether the spawned server answers ``info`` within :data:`HEALTH_TIMEOUT_S`."""
        try:
            await self._call_spawned("info", {}, timeout_s=min(HEALTH_TIMEOUT_S, self.timeout_s))
        except (RpcError, _ServerExited):
            return False
        return True

    async def _restart_or_unavailable(self, generation: int, reason: str, method: str) -> None:
        """Start the spawned server again; EnvUnavailableError when it cannot be started."""
        try:
            await self._restart(generation, reason=reason)
        except (RpcError, OSError) as e:
            raise EnvUnavailableError(f"env server {self.name!r} could not be started again during {method!r}: "
                                      f"{e}") from e

    async def close(self) -> None:
        """Close the connection and stop the spawned server (SIGTERM, then SIGKILL after 5 s)."""
        if self._client is not None:
            await self._client.close()
            self._client = None
        await super().close()

    async def _call_spawned(self, method: str, kwargs: dict[str, Any], timeout_s: float | None = None) -> Any:
        """One call that fails fast with _ServerExited when the server process dies first."""
        exited = self._server.exited
        if exited is None or exited.done():
            raise _ServerExited("not running" if exited is None else f"exit code {exited.result()}")
        assert self._client is not None
        return await self._client.call(method, timeout_s=timeout_s, **kwargs)

    async def _restart(self, generation: int, reason: str) -> None:
        async with self._lock:
            if self.restarts != generation:
                return  # a concurrent call already restarted it
            self.restarts += 1
            self.log.warning("env_server_restarted", reason=reason, restarts=self.restarts)
            if self._client is not None:
                await self._client.close()
            await self._server.stop()
            await self._spawn(max(self.timeout_s, 60.0))

    async def _spawn(self, start_timeout_s: float) -> None:
        self.address = self._server.socket_address(self.restarts)
        cfg = self.env_config
        argv = [sys.executable, "-m", "workers.cli", "env", "--id", cfg.id, "--name", self.name,
                "--max-turns", str(cfg.max_turns), "--bind", self.address,
                "--call-timeout-s", str(HUNG_FRACTION * self.timeout_s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", ARGS_VAR: json.dumps(cfg.args)}
        await self._server.start(argv, env)
        self._client = client = RpcClient(self.address, self.timeout_s)
        self._server.exited.add_done_callback(lambda exited: exited.cancelled() or client.fail_pending(
            _ServerExited(f"exit code {exited.result()}")))  # its calls fail now, not at their timeout
        try:
            await self._call_spawned("info", {}, timeout_s=start_timeout_s)
        except _ServerExited as e:
            raise RpcError(f"env server {self.name!r} ({cfg.id}) exited before answering ({e}); "
                           "its error is in the log above") from e
        self.log.info("env_server_spawned", pid=self.pid, address=self.address, forked=self._server.forked)
