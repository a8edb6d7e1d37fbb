"""The run's fork server: what it preloads, and starting it as the supervisor's first child.

Every Python worker of ``rlbus run`` (inference servers, trainer, rollout, filter, packer, feeder) used to import
torch and transformers on its own: ~1.5 CPU-seconds for torch and as much again for transformers' model code, in
each of three processes, on cores the others were starting on too. The fork server imports them once and forks the
workers (:mod:`workers.run.forkserver`); a worker restarted after a crash is forked as well, without those imports.
"""

import shutil
import tempfile
from pathlib import Path

from workers.cli import ROLES
from workers.config import RlbusConfig
from workers.forked import Forker, forkserver_argv
from workers.run.supervisor import ChildSpec, Supervisor

FORKED_ROLES = ("inference", "trainer", "rollout", "filter", "packer", "feeder")
"""Roles whose modules the server imports (the roles ``rlbus run`` starts as workers)."""


def preload_modules(config: RlbusConfig) -> list[str]:
    """The modules the run's workers import at start: the CLI, each role's module, and the built-in server's."""
    modules = ["workers.cli", *(ROLES[role][0].split(":")[0] for role in FORKED_ROLES)]
    if config.inference.backend == "transformers":
        modules.append("workers.inference.transformers_server")
    return modules


class ForkServer:
    """The server as a supervised child (stopped after every worker, so none of them gets its death signal early)
    and its socket's private folder."""

    def __init__(self, sup: Supervisor, config: RlbusConfig, env: dict[str, str]):
        self.folder = tempfile.mkdtemp(prefix="rlbus-fork-")
        socket_path = str(Path(self.folder) / "fork.sock")
        model = Path(config.model.path)
        argv = forkserver_argv(socket_path, preload_modules(config), str(model.resolve()) if model.is_dir() else None)
        server = sup.start(ChildSpec("forkserver", "forkserver", argv, env, stop_order=3))
        sup.forker = Forker(socket_path, server_alive=lambda: server.alive)

    def close(self) -> None:
        """Remove the socket's folder (once the supervisor has stopped the server)."""
        shutil.rmtree(self.folder, ignore_errors=True)
