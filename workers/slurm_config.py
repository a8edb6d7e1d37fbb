"""The ``[slurm]`` section: how ``rlbus slurm`` asks Slurm for nodes and places the run's roles on them
(:mod:`workers.tools.slurm_script` writes the batch script from it). No worker reads it."""

from pydantic import Field

from bus.config import Section


class SlurmConfig(Section):
    partition: str | None = None
    """Partition (``#SBATCH --partition``); None: the cluster's default partition."""

    account: str | None = None
    """Account charged for the job (``#SBATCH --account``); None: the user's default account."""

    qos: str | None = None
    """Quality of service (``#SBATCH --qos``); None: the default."""

    time: str | None = Field(None, pattern=r"^(\d+-)?\d+(:\d+){0,2}$")
    """Wall-clock limit of the run's job (``#SBATCH --time``, ``MINUTES``, ``HH:MM:SS`` or ``D-HH:MM:SS``); a
    job that reaches it is stopped and ``rlbus slurm … --resume`` continues it. None: the partition's limit."""

    nodes: int = Field(1, ge=1)
    """Nodes of the run's job. The trainer ranks take GPUs from the first node's GPU 0 on, the inference servers
    fill the GPUs after them node by node; rollout and filter workers are spread over every node."""

    gpus_per_node: int = Field(0, ge=0)
    """GPUs of each node the job asks for (``#SBATCH --gpus-per-node``); 0: a CPU run (the trainer and the
    inference servers share the first node's cores)."""

    trainer_gpus: int | None = Field(None, ge=1)
    """GPUs (one data-parallel rank each) of the trainer, all on the first node; None: ``trainer.nproc``."""

    gpus_per_server: int = Field(1, ge=1)
    """GPUs of one inference server on one node (vLLM's tensor parallelism; add ``--tensor-parallel-size`` to
    ``inference.vllm_args`` to match). ``inference.servers`` servers are started."""

    exclusive: bool = True
    """Whole nodes for the run (``#SBATCH --exclusive``); false: the job asks for one CPU per node and shares
    the nodes (small CPU clusters, tests)."""

    redis_port: int = Field(6379, ge=1, le=65535)
    """Port of the Redis that the job starts on its first node when ``redis.url`` is unset (its AOF in
    ``run.output_dir/redis``, its password in ``run.output_dir/slurm/redis.password``)."""

    launcher: str = "rlbus"
    """How a node runs rlbus after the prelude (``rlbus``, ``uv run rlbus``, ``python -m workers.cli``)."""

    prelude: list[str] = Field(default_factory=list)
    """Shell lines run on each node before any worker (``module load cuda/12.4``,
    ``source /shared/venv/bin/activate``, exports)."""

    sbatch: list[str] = Field(default_factory=list)
    """Extra ``#SBATCH`` options, one per item without the prefix (``--constraint=h100``, ``--mail-type=END``)."""

    rollout_nodes: int = Field(1, ge=1)
    """Nodes of a rollout job (``rlbus slurm … --role rollout --count N``): its N workers are spread over them."""

    stop_grace_s: int = Field(60, ge=1)
    """How long the run job waits for its workers to drain when the run ends (each gets SIGTERM); past it the job
    ends and Slurm kills what is left."""
