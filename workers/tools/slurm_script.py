"""The batch scripts of ``rlbus slurm``: where each role runs on the job's nodes (:func:`place`), and the bash that
starts them (:func:`run_script`, :func:`rollout_script`).

The scripts name no host: each reads its nodes from ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``) and
their addresses from ``scontrol show node``, starts Redis (unless ``redis.url`` names one) on the first node, and
hands every worker the Redis URL and the inference servers' URLs built from them. The run job writes both into
``run.output_dir/slurm/endpoints.env``, where a later rollout job finds them. Each worker is one job step
(``srun --overlap`` pinned to its node), GPU workers with ``CUDA_VISIBLE_DEVICES`` set to the GPUs placed here.
"""

import shlex
from dataclasses import dataclass
from pathlib import Path

from bus.config import split_password
from bus.errors import ConfigError
from workers.config import RlbusConfig

PASSWORD_VAR = "RLBUS_REDIS_PASSWORD"
"""The variable that carries the password of the Redis the job starts (read from ``slurm/redis.password``)."""

HEALTH_TIMEOUT_S = 900
"""How long the run job waits for each inference server's ``/health`` before it gives up."""


@dataclass(frozen=True)
class Launch:
    """One worker of the run job: a job step on node ``node`` (index in the job's node list)."""

    name: str
    node: int
    role: str
    options: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    after_servers: bool = False
    """Started once every inference server answers (the feeder and the rollout workers)."""
    port: int | None = None
    """The inference server's port."""


def _gpu_slots(config: RlbusConfig) -> list[tuple[int, int]]:
    """Every (node, gpu) of the job, node by node."""
    cfg = config.slurm
    return [(node, gpu) for node in range(cfg.nodes) for gpu in range(cfg.gpus_per_node)]


def _servers(config: RlbusConfig, free: list[tuple[int, int]]) -> list[Launch]:
    """The inference servers: ``gpus_per_server`` GPUs of one node each, first fit; on CPU all on node 0."""
    cfg, count = config.slurm, config.inference.servers
    launches, ports_used = [], {}
    for i in range(count):
        node, gpus = 0, ()
        if cfg.gpus_per_node:
            fits = [n for n in range(cfg.nodes) if sum(1 for f in free if f[0] == n) >= cfg.gpus_per_server]
            if not fits:
                raise ConfigError(
                    f"inference.servers={count} × slurm.gpus_per_server={cfg.gpus_per_server} GPUs do not fit beside "
                    f"the trainer's {trainer_gpus(config)} in slurm.nodes={cfg.nodes} × gpus_per_node="
                    f"{cfg.gpus_per_node}; add nodes or lower inference.servers")
            node = fits[0]
            gpus = tuple(g for n, g in free if n == node)[:cfg.gpus_per_server]
            free[:] = [f for f in free if not (f[0] == node and f[1] in gpus)]
        port = config.inference.port + ports_used.get(node, 0)
        ports_used[node] = ports_used.get(node, 0) + 1
        launches.append(Launch(f"inference-{i}", node, "inference",
                               ("--host", "0.0.0.0", "--port", str(port), "--server-id", f"inference-{i}"),
                               gpus, port=port))
    return launches


def trainer_gpus(config: RlbusConfig) -> int:
    """GPUs (= ranks) of the trainer: ``slurm.trainer_gpus``, else ``trainer.nproc``."""
    return config.slurm.trainer_gpus or config.trainer.nproc


def place(config: RlbusConfig) -> list[Launch]:
    """Every worker of the run job and its node: the trainer on node 0 (GPUs 0…), inference servers in the GPUs
    after it, feeder and packer on node 0, rollout and filter workers round-robin from the last node back."""
    cfg = config.slurm
    ranks = trainer_gpus(config)
    free = _gpu_slots(config)
    if cfg.gpus_per_node and ranks > cfg.gpus_per_node:
        raise ConfigError(f"the trainer's {ranks} GPUs do not fit on one node of slurm.gpus_per_node="
                          f"{cfg.gpus_per_node}; rlbus slurm keeps the trainer's ranks on one node, so lower "
                          "slurm.trainer_gpus (or trainer.nproc)")
    trainer = tuple(g for _, g in free[:ranks]) if cfg.gpus_per_node else ()
    free = free[len(trainer):]
    launches = [Launch("trainer", 0, "trainer", ("--nproc", str(ranks)) if ranks > 1 else (), trainer)]
    launches += _servers(config, free)
    launches.append(Launch("packer", 0, "packer"))
    spread = [cfg.nodes - 1 - i % cfg.nodes for i in range(max(config.rollout.workers, config.filter.workers))]
    launches += [Launch(f"filter-{i}", spread[i], "filter", ("--consumer", f"filter-{i}"))
                 for i in range(config.filter.workers)]
    launches.append(Launch("feeder", 0, "feeder", after_servers=True))
    launches += [Launch(f"rollout-{i}", spread[i], "rollout", ("--consumer", f"rollout-{i}"), after_servers=True)
                 for i in range(config.rollout.workers)]
    return launches


def _header(config: RlbusConfig, job: str, nodes: int, out: Path, workdir: Path, *, gpus: bool,
            exclusive: bool) -> list[str]:
    cfg = config.slurm
    options = [f"--job-name={job}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    options += ["--exclusive"] if exclusive else []
    options += [f"--gpus-per-node={cfg.gpus_per_node}"] if gpus and cfg.gpus_per_node else []
    options += [f"--{key}={value}" for key, value in (("partition", cfg.partition), ("account", cfg.account),
                                                      ("qos", cfg.qos), ("time", cfg.time)) if value]
    options += [f"--chdir={workdir}", f"--output={out}/slurm/{job}-%j.out", "--open-mode=append", "--requeue"]
    options += cfg.sbatch
    return ["#!/bin/bash", *(f"#SBATCH {option}" for option in options)]


def _common(config: RlbusConfig, out: Path, generated_redis: bool) -> list[str]:
    """Lines both scripts share: the prelude, the launcher, the nodes and their addresses, the password."""
    cfg = config.slurm
    lines = ["set -uo pipefail", *cfg.prelude,
             f"RLBUS=({cfg.launcher})",
             f"OUT={shlex.quote(str(out))}",
             'CONFIG="$OUT/slurm/config.toml"',
             'mkdir -p "$OUT/slurm/logs"',
             'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
             "addr() { scontrol show node \"$1\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }",
             'ADDR=(); for node in "${NODES[@]}"; do ADDR+=("$(addr "$node")"); done',
             'echo "rlbus: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${NODES[*]} (${ADDR[*]})"',
             "PIDS=()",
             "step() {  # step NODE NAME GPUS ARGS...: one worker as a job step on node NODE, its log in slurm/logs",
             '    local node=$1 name=$2 gpus=$3; shift 3',
             '    srun --overlap --nodes=1 --ntasks=1 --nodelist="${NODES[$node]}" --job-name="$name" \\',
             '        --output="$OUT/slurm/logs/$name.log" --open-mode=append \\',
             '        env ${gpus:+CUDA_VISIBLE_DEVICES=$gpus} "${RLBUS[@]}" "$@" &',
             '    PIDS+=($!)',
             "}",
             'alive() { for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }',
             "stop() {  # SIGTERM to every worker (they drain); one still running after slurm.stop_grace_s ends",
             "          # with the job (Slurm kills every step then)",
             '    scancel --signal=TERM "$SLURM_JOB_ID"  # the job steps only (srun signalled would abort its step)',
             f"    for _ in $(seq {cfg.stop_grace_s}); do alive || break; sleep 1; done",
             "}"]
    if generated_redis:
        lines.append(f'export {PASSWORD_VAR}="$(cat "$OUT/slurm/redis.password")"')
    return lines


def _redis_lines(config: RlbusConfig) -> list[str]:
    """Redis on the first node (AOF in ``run.output_dir/redis``), or the URL of ``redis.url``; sets ``REDIS_URL``
    and ``REDIS`` (the workers' Redis options)."""
    if config.redis.url is not None:  # its password, if any, comes from redis.password_var (config.toml says which)
        return [f"REDIS_URL={shlex.quote(split_password(config.redis.url)[0])}", "REDIS=()"]
    port = config.slurm.redis_port
    return ['mkdir -p "$OUT/redis"',
            'REDIS_URL="redis://${ADDR[0]}:' + str(port) + '/0"',
            f'printf "requirepass %s\\n" "${PASSWORD_VAR}" | redis-server - --port {port} --bind 0.0.0.0 '
            '--protected-mode no --dir "$OUT/redis" --appendonly yes --save "" --daemonize no \\',
            '    >> "$OUT/slurm/logs/redis.log" 2>&1 &',
            "REDIS_PID=$!",
            f'for _ in $(seq 60); do (exec 3<>"/dev/tcp/${{ADDR[0]}}/{port}") 2>/dev/null && break; sleep 0.5; done',
            f'REDIS=(--redis.url "$REDIS_URL" --redis.password_var {PASSWORD_VAR})']


def _step(launch: Launch) -> str:
    args = " ".join(shlex.quote(a) for a in (launch.role, *launch.options))
    return f'step {launch.node} {launch.name} "{",".join(map(str, launch.gpus))}" {args} "${{COMMON[@]}}"'


SERVER_WAIT = [
    "for url in $(echo \"$URLS\" | tr -d '[]\"' | tr , ' '); do  # the feeder and rollouts once every server answers",
    f"    for _ in $(seq {HEALTH_TIMEOUT_S}); do python3 -c 'import sys, urllib.request; urllib.request.urlopen("
    "sys.argv[1][:-3] + \"/health\", timeout=2)' \"$url\" 2>/dev/null && break; sleep 1; done",
    "done"]


def run_script(config: RlbusConfig, out: Path, workdir: Path, *, init_model: bool) -> str:
    """The run's batch script: Redis, the watcher (``rlbus run --attach``) and every worker of :func:`place`."""
    cfg, launches = config.slurm, place(config)
    lines = _header(config, f"rlbus-{config.run.name}", cfg.nodes, out, workdir, gpus=True,
                    exclusive=cfg.exclusive)
    lines += [f"# rlbus run {config.run.name!r}, written by `rlbus slurm`. A node lost requeues the job; the requeued",
              "# job (like `rlbus slurm ... --resume`) continues from Redis's AOF and the trainer's checkpoints."]
    lines += _common(config, out, config.redis.url is None) + _redis_lines(config)
    urls = ",".join(f'\\"http://${{ADDR[{s.node}]}}:{s.port}/v1\\"' for s in launches if s.role == "inference")
    lines += [f'URLS="[{urls}]"',
              ('printf "RLBUS_REDIS_URL=%q\\nRLBUS_INFERENCE_URLS=%q\\n" "$REDIS_URL" "$URLS" '
               '> "$OUT/slurm/endpoints.env"'),
              'COMMON=(@ "$CONFIG" "${REDIS[@]}" --inference.base_urls "$URLS")',
              "# The watcher (status, metrics.jsonl, eval, summary.json) on this node; it ends at run.max_steps.",
              '"${RLBUS[@]}" run "${COMMON[@]}" --attach >> "$OUT/slurm/logs/run.log" 2>&1 &',
              "WATCHER=$!",
              "trap 'kill -TERM $WATCHER 2>/dev/null; stop; exit 143' TERM INT"]
    if init_model:
        path = shlex.quote(config.model.path)
        lines.append(f'[ -e {path} ] || "${{RLBUS[@]}}" init-model --out {path} --preset {config.model.init_preset} '
                     f"--seed {config.run.seed}")
    for launch in launches:
        lines += SERVER_WAIT if launch.name == "feeder" else []
        lines += [_step(launch)] + (["TRAINER=${PIDS[-1]}"] if launch.role == "trainer" else [])
    lines += ["# The run ends when the watcher does (run.max_steps) or the trainer stops (`scancel --signal=TERM`",
              "# stops every worker): the workers drain against a live Redis, then the watcher writes summary.json.",
              'while kill -0 "$WATCHER" 2>/dev/null && kill -0 "$TRAINER" 2>/dev/null; do sleep 2; done',
              "stop", 'kill -TERM "$WATCHER" 2>/dev/null; wait "$WATCHER"; code=$?']
    if config.redis.url is None:
        lines += ['kill -TERM "$REDIS_PID"; wait "$REDIS_PID"']
    lines += ['echo "rlbus: run ended (watcher exit $code)"', "exit $code"]
    return "\n".join(lines) + "\n"


def rollout_script(config: RlbusConfig, out: Path, workdir: Path, count: int, tag: str) -> str:
    """A job of ``count`` more rollout workers for a running run: each reads the run's endpoints from
    ``slurm/endpoints.env`` and is restarted with them (a requeued run job moves Redis) until the run stops it."""
    cfg = config.slurm
    nodes = min(cfg.rollout_nodes, count)
    lines = _header(config, f"rlbus-{config.run.name}-rollout", nodes, out, workdir, gpus=False, exclusive=False)
    lines += [f"# {count} more rollout workers for rlbus run {config.run.name!r}; `scancel` takes them away again."]
    lines += _common(config, out, config.redis.url is None)
    redis = f'--redis.url "$RLBUS_REDIS_URL" --redis.password_var {PASSWORD_VAR}' if config.redis.url is None else ""
    lines += ["worker() {  # worker I: rollout worker I of this job, restarted until it exits 0 (the run stopped)",
              '    while true; do',
              '        source "$OUT/slurm/endpoints.env"',
              f'        srun --overlap --nodes=1 --ntasks=1 --nodelist="${{NODES[$(($1 % ${{#NODES[@]}}))]}}" '
              f'--job-name="rollout-{tag}-$1" \\',
              f'            --output="$OUT/slurm/logs/rollout-{tag}-$1.log" --open-mode=append \\',
              f'            "${{RLBUS[@]}}" rollout @ "$CONFIG" {redis} --inference.base_urls "$RLBUS_INFERENCE_URLS" '
              f'--consumer "rollout-{tag}-$1" && break',
              "        sleep 5",
              "    done",
              "}",
              f"for i in $(seq 0 {count - 1}); do worker \"$i\" & PIDS+=($!); done",
              "trap 'stop; exit 143' TERM INT",
              "wait"]
    return "\n".join(lines) + "\n"
