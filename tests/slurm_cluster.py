"""A real Slurm cluster on this machine for tests: munged with a temporary key, slurmctld on a controller host and
one slurmd per compute node, every host a network namespace of :class:`tests.hosts.SimulatedHosts` (own address,
one bridge). Everything lives in one temporary folder and is gone after :meth:`SlurmCluster.stop`.

Debian's slurm-wlm is built without ``--enable-multiple-slurmd``; several slurmd still run on one machine because
each has a namespace of its own (its own address, so every node keeps the default SlurmdPort) and ``-N NAME``
names the node; the spool and pid files are per node through ``%n``. The node's filesystem is the machine's, as a
shared filesystem is on a real cluster.

    cluster = SlurmCluster(tmp_path, nodes=3).start()
    cluster.run("sbatch", "--wrap", "hostname")     # any Slurm command, from the controller host
    cluster.lose("n2")                               # slurmd and every process of node n2 killed -9
    cluster.stop()
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.hosts import SimulatedHosts, netns_available

SLURM_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel",
                  "sinfo", "nsenter")
NODE_CPUS = 16
"""CPUs each node claims (``SlurmdParameters=config_overrides``): room for every worker of a CPU run per node."""


def slurm_missing() -> str | None:
    """None when a Slurm cluster can be built here, else why not (a skip reason naming the fix)."""
    if (reason := netns_available()) is not None:
        return reason
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"a Slurm cluster needs {', '.join(missing)}: apt-get install slurm-wlm munge"
    return None


def slurm_conf(root: Path, control_addr: str, nodes: dict[str, str]) -> str:
    """slurm.conf of a cluster whose files all live under ``root``; ``nodes``: name → address."""
    lines = [
        "ClusterName=rlbustest",
        f"SlurmctldHost={socket.gethostname()}({control_addr})",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root / 'munge.socket'}",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root / 'ctld'}", f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd'}-%n.log",
        "SlurmctldDebug=info", "SlurmdDebug=info",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "SlurmdParameters=config_overrides",
        # A lost node is noticed in seconds and its jobs requeued (Slurm then holds a requeued job 120 s); a
        # returning slurmd rejoins by itself.
        "SlurmdTimeout=10", "SlurmctldTimeout=10", "MessageTimeout=5", "KillWait=5", "MinJobAge=600",
        "JobRequeue=1", "ReturnToService=2", "InactiveLimit=0", "SchedulerParameters=bf_interval=1",
        *(f"NodeName={name} NodeAddr={addr} CPUs={NODE_CPUS} State=UNKNOWN" for name, addr in nodes.items()),
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]
    return "\n".join(lines) + "\n"


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.hosts = SimulatedHosts(["ctl", *self.nodes])
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        """The environment of every Slurm command and of what the jobs start (they inherit it)."""
        self.munged: subprocess.Popen | None = None

    def address(self, node: str) -> str:
        return self.hosts.address(node)

    def start(self) -> "SlurmCluster":
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.hosts.start()
            self._munge()
            for sub in ("ctld", "spool"):
                (self.root / sub).mkdir()
            nodes = {name: self.address(name) for name in self.nodes}
            self.conf.write_text(slurm_conf(self.root, self.address("ctl"), nodes))
            self.hosts.popen("ctl", ["slurmctld", "-D", "-i", "-f", str(self.conf)], self.root / "ctl.out",
                             env=self.env)
            for node in self.nodes:
                self.start_node(node)
            self.wait_idle(self.nodes, 60)
        except BaseException:
            self.stop()
            raise
        return self

    def _munge(self) -> None:
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        key.chmod(0o400)
        socket_path = self.root / "munge.socket"
        argv = ["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}"]
        with open(self.root / "munged.out", "ab") as out:
            self.munged = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not socket_path.exists():
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {(self.root / 'munged.out').read_text()[-2000:]}")
            time.sleep(0.1)

    def start_node(self, node: str) -> None:
        """Start (or restart) the slurmd of ``node``."""
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        # nsenter enters the node's network only: `ip netns exec` would also remount /sys, hiding the cgroup
        # filesystems that slurmd's cgroup plugin must find at start-up.
        argv = ["nsenter", f"--net=/run/netns/{self.hosts.netns[node]}", "slurmd", "-D", "-N", node, "-f",
                str(self.conf)]
        with open(self.root / f"{node}.out", "ab") as out:
            self.hosts.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def run(self, *argv: str, timeout_s: float = 30, check: bool = True, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
        """A command on the controller host (sbatch, squeue, scontrol, or ``rlbus slurm``), run in ``cwd``."""
        done = subprocess.run(["ip", "netns", "exec", self.hosts.netns["ctl"], *argv], capture_output=True,
                              text=True, env=self.env, timeout=timeout_s, cwd=cwd)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done

    def node_states(self) -> dict[str, str]:
        listed = self.run("sinfo", "-N", "-h", "-o", "%N %t").stdout.split("\n")
        return dict(line.split() for line in listed if line.strip())

    def wait_idle(self, nodes: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes never came up: {states}\n{self.logs()}")
            time.sleep(0.5)

    def hostnames(self, nodelist: str) -> list[str]:
        """``n[1-2]`` → ``["n1", "n2"]``."""
        return self.run("scontrol", "show", "hostnames", nodelist).stdout.split()

    def lose(self, node: str) -> None:
        """Node ``node`` is gone: its slurmd and every process on it killed -9, its link cut."""
        self.hosts.lose(node)

    def logs(self, tail: int = 1500) -> str:
        files = sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out"))
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in files)

    def stop(self) -> None:
        self.hosts.stop()
        if self.munged is not None:
            self.munged.kill()
            self.munged.wait(10)
