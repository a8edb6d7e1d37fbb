"""The trainer worker: ``batches:{s}`` → one optimizer step → weights → ``trained = s``.

For step ``s`` every rank reads all micro-batches of ``batches:{s}`` (XREAD BLOCK until ``count``
are there) and trains those with ``index % W == rank``. Rank 0 then writes the weights
(safetensors shards in ``output_dir/weights/step_{s}``, or a broadcast), publishes the
``weights`` event, then ``trained = s`` on ``policy``, the step's metrics, and checkpoints every
``ckpt.interval`` steps. Safetensors are written from a copy and announced while step ``s + 1``
trains (in a thread, leaving the event loop free); step ``s + 1``'s go out after them, and a
checkpoint of step ``s`` only once they are out. A resumed trainer continues at ``s + 1`` and
re-publishes the weights and ``trained`` of step ``s``. One trainer trains at a time; a second one waits as a standby
(:mod:`trainer.tenure`). ``rlbus trainer @ cfg.toml [--nproc N]``.
"""

import argparse
import asyncio
import os
import time
import uuid

import torch

from bus.archive import write_step
from bus.errors import ConfigError, RlbusError
from bus.log import configure_logging, get_logger
from bus.messages import Metric, MicroBatch, PolicyVersion, WeightUpdate
from bus.policy import PolicyTracker
from bus.resp import as_str
from bus.state import (
    DATA_EXHAUSTED,
    EVAL_HOLD_FIELD,
    LAST_STEP_FIELD,
    RUN_EPOCH_FIELD,
    exhausted_at,
    is_progress_field,
)
from bus.weight_files import weights_root
from trainer.broadcast import WeightBroadcaster
from trainer.checkpoint import Checkpointer
from trainer.dist import close_distributed, full_state_dict, init_distributed, prepare_model, spawn
from trainer.logprobs import PolicyModel
from trainer.lora import ADAPTER_CONFIG, adapter_tensors, inject, peft_config, save_adapter
from trainer.losses import loss_fns
from trainer.model import count_parameters, load_model, resolve_device, resolve_dtype
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import to_batch, train_step
from trainer.tenure import TrainerTenure
from trainer.weights import (
    INDEX_NAME,
    HostCopy,
    nonfinite_tensors,
    prune_weights,
    remove_interrupted_saves,
    save_weights,
    unique_tensors,
    verified_weights,
    weights_dir,
)
from workers.config import RlbusConfig
from workers.lifecycle import connect_bus, run_worker

PUBLISH_ON_CLOSE_S = 60.0
"""How long a trainer stopping on an error waits for the weights it was still publishing."""


class TrainerWorker:
    """One data-parallel rank of the trainer (rank 0 also publishes weights, versions and metrics)."""

    def __init__(self, config: RlbusConfig):
        self.config = config
        self.cfg = config.trainer
        self.device = resolve_device(self.cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.ctx = init_distributed(self.device.type)
        self.output_dir = config.run.output_dir
        self.log = get_logger(worker=f"trainer-{self.ctx.rank}", run=config.run.name, role="trainer")
        self.step = 0
        self.retired = 0
        """Steps up to this one had their ``batches:*`` streams deleted (by this process)."""
        self._step_batches: list[MicroBatch] = []
        """Every micro-batch of the step being trained (each rank trains its share)."""
        self.bus = None
        self.tenure = None
        self.broadcaster = None
        self._publishing: asyncio.Task | None = None
        """The previous step's weights, being written and announced (rank 0)."""
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        """Model and optimizer, the bus; then, once this trainer holds the lease, resume and announce the version."""
        self._build_policy()
        self._build_optimizer()
        await self._connect()
        self.log.info("trainer_standby", holder=self.tenure.holder, hint="waiting for the trainer lease")
        if not await self.tenure.acquire(self._stop):
            return
        self._remove_interrupted_saves()
        resumed = await self._resume()
        await self.tenure.claim(self.step)
        self._start_broadcaster()
        self.log.info("trainer_ready", step=self.step, resumed=resumed, params=self.n_params,
                      device=str(self.device), world_size=self.ctx.world_size, model=self.config.model.path)
        await self._announce_start()

    def _build_policy(self) -> None:
        """The policy (with its LoRA adapter under ``[model.lora]``) and the frozen reference, seeded."""
        torch.manual_seed(self.config.run.seed)
        lm = load_model(self.config.model.path, self.device, resolve_dtype(self.config.model.dtype, self.device))
        self.lora = None
        if self.config.model.lora is not None:
            lora = self.config.model.lora
            self.lora = peft_config(lora.rank, lora.alpha, lora.dropout, lora.target_modules, self.config.model.path)
            inject(lm, self.lora)
        self.n_params = count_parameters(lm)
        self.lm_config = lm.config
        self.policy = prepare_model(PolicyModel(lm, self.cfg.logprob_chunk_size, compile_head=self.cfg.compile,
                                                entropy_grad=self.cfg.entropy_coef > 0,
                                                keep_bytes=self.cfg.logits_keep_mb * 2**20),
                                    self.ctx, self.device.type, self.cfg.compile)
        self.reference = self._reference()

    def _build_optimizer(self) -> None:
        """Optimizer, schedule, losses, the checkpointer and the host copy of the weights being published."""
        self.optimizer = build_optimizer(self.policy, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg, self.config.run.max_steps)
        self.loss_fns = loss_fns(self.cfg.loss)
        self.ckpt = Checkpointer(self.output_dir, self.config.ckpt, self.ctx, trainable_only=self.lora is not None)
        self.host_copy = HostCopy(snapshot=not self.ctx.distributed)  # FSDP's gathered state is a copy already

    async def _connect(self) -> None:
        self.bus = await connect_bus(self.config, f"trainer-{self.ctx.rank}")
        self.tracker = PolicyTracker(self.bus)
        self.tenure = TrainerTenure(self.bus, self.config, self.ctx)

    def _remove_interrupted_saves(self) -> None:
        """Rank 0: delete weights and checkpoints a killed trainer left half-written."""
        if not self.ctx.is_main:
            return
        for path in remove_interrupted_saves(weights_root(self.output_dir)) + remove_interrupted_saves(self.ckpt.root):
            self.log.warning("interrupted_save_removed", path=str(path))

    async def _resume(self) -> bool:
        """Load the checkpoint ``ckpt.resume_step`` names (weights only under ``ckpt.skip_progress``) and check the
        run epoch against Redis's; whether training continues from it."""
        resume = self.ckpt.resolve(self.config.ckpt.resume_step)
        made_in = progress = None
        if resume is not None and self.config.ckpt.skip_progress:
            self.ckpt.load(resume, self.policy, self.optimizer, self.scheduler, weights_only=True)
            self.log.info("trainer_weights_from_checkpoint", step=resume, hint="ckpt.skip_progress: starting at step 0")
            resume = None
        elif resume is not None:
            made_in, progress = self.ckpt.load(resume, self.policy, self.optimizer, self.scheduler)
            self.step = resume
        self.run_epoch = await self._run_epoch(resume, made_in, progress)
        return resume is not None

    def _start_broadcaster(self) -> None:
        """Rank 0 under ``trainer.weight_transport = "nccl"``: the broadcast group's sending side."""
        if self.ctx.is_main and self.cfg.weight_transport == "nccl":
            receivers = self.cfg.inference_world_size or len(self.config.inference_urls())
            self.broadcaster = WeightBroadcaster(self.cfg.nccl_host, self.cfg.nccl_port, receivers, self.device,
                                                 self.cfg.broadcast_timeout_s)

    async def _announce_start(self) -> None:
        """A resumed trainer re-publishes its step's weights and ``trained``; a fresh one ``trained = 0`` (or warns
        when the run already trained: it does not start a run's versions over)."""
        if self.step > 0:
            await self.publish_weights(self.step, republish=True)
        elif self.ctx.is_main:
            await self.tracker.refresh()
            if self.tracker.trained > 0:
                self.log.warning("trainer_fresh_start_after_training", trained=self.tracker.trained,
                                 fix="set ckpt.resume_step = -1 to continue from the latest checkpoint")
            else:
                await self.tenure.publish([(self.bus.keys.policy(), PolicyVersion(role="trained", step=0))], step=0)

    def _reference(self):
        """The frozen reference policy of ``trainer.kl_penalty_coef`` (None when the penalty is off)."""
        if not self.cfg.kl_penalty_coef:
            return None
        step = self.cfg.kl_penalty_reference_step
        path = self.config.model.path if step is None else weights_dir(self.output_dir, step)
        if step is not None and not path.exists():
            raise ConfigError(f"trainer.kl_penalty_reference_step={step}: {path} does not exist (pruned, or not "
                              "trained yet); pick a step whose weights are there, or unset it for the initial weights")
        lm = load_model(path, self.device, resolve_dtype(self.config.model.dtype, self.device))
        reference = PolicyModel(lm, self.cfg.logprob_chunk_size).eval()
        reference.requires_grad_(False)
        return reference

    async def _run_epoch(self, resume: int | None, made_in: str | None, progress: dict[str, str] | None) -> str:
        """The run's epoch in Redis (written on the first start). Resuming onto a Redis that holds nothing of the
        run restores the checkpoint's data position there first; one that holds another epoch was replaced, and
        continuing would start the data and the versions over: stop."""
        state = self.bus.keys.state()
        if not self.ctx.is_main:  # rank 0 checks (and restores); the group stops with it
            return made_in or ""
        if made_in is None:
            await self.bus.redis.hsetnx(state, RUN_EPOCH_FIELD, uuid.uuid4().hex)
            return await self.bus.state_get(RUN_EPOCH_FIELD)
        held = await self.bus.state_get(RUN_EPOCH_FIELD)
        if held is None and progress is not None:
            await self.bus.state_set(**progress, **{LAST_STEP_FIELD: resume})
            await self.bus.state_set(**{RUN_EPOCH_FIELD: made_in})  # last: the feeder waits for it (ckpt.resume_step)
            self.log.warning("redis_restored_from_checkpoint", step=resume, fields=sorted(progress),
                             hint="Redis held nothing of this run; it continues from the checkpoint's data position")
            return made_in
        if held != made_in:
            what = "holds no state of this run" if held is None else f"holds another run epoch ({held})"
            raise ConfigError(
                f"checkpoint step_{resume} of run {self.config.run.name!r} was made in run epoch {made_in}, but Redis "
                f"{what}: it was wiped or replaced since. Restore Redis's data (the AOF in output_dir/redis for "
                f"`rlbus run`) and resume, or start the run fresh (a new run.name, or ckpt.resume_step unset)"
            )
        return held

    async def run(self) -> None:
        max_steps = self.config.run.max_steps
        while not self._stop.is_set() and (max_steps is None or self.step < max_steps):
            self.tenure.check()
            step = self.step + 1
            start = time.perf_counter()
            batches = await self.read_batches(step)
            if batches is None:
                break
            # In a thread: the event loop meanwhile publishes the previous step's weights.
            metrics = await asyncio.to_thread(self.train, step, batches, time.perf_counter() - start)
            self.step = step
            t0 = time.perf_counter()
            await self.publish_weights(step)
            metrics["weights_s"] = time.perf_counter() - t0
            if self.ckpt.due(step):
                t0 = time.perf_counter()
                await self.weights_published()  # Redis records step s before a checkpoint of it exists
                self.ckpt.save(step, self.policy, self.optimizer, self.scheduler, self.run_epoch,
                               await self._progress())
                metrics["ckpt_s"] = time.perf_counter() - t0
            await self.retire_batches(step)
            await self.report(step, metrics)
        await self.weights_published()
        self.log.info("trainer_stopped", step=self.step)

    async def _progress(self) -> dict[str, str] | None:
        """The data position to keep in a checkpoint (rank 0): the feeder's fields of the state hash."""
        if not self.ctx.is_main:
            return None
        fields = await self.bus.redis.hgetall(self.bus.keys.state())
        return {as_str(k): as_str(v) for k, v in fields.items() if is_progress_field(as_str(k))}

    async def retire_batches(self, step: int) -> None:
        """Rank 0, after step ``step``: archive its micro-batches if asked, and delete the ``batches:*`` streams that
        are ``keep_batches`` steps old and covered by a checkpoint."""
        if not self.ctx.is_main:
            return
        if self.cfg.archive_batches:
            write_step(self.output_dir, step, [mb.to_fields() for mb in self._step_batches])
        if self.cfg.keep_batches == 0:
            return
        checkpoints = self.ckpt.steps()
        upto = min(step - self.cfg.keep_batches, checkpoints[-1] if checkpoints else 0)
        doomed = [self.bus.keys.batches(s) for s in range(self.retired + 1, upto + 1)]
        if doomed:
            await self.bus.redis.delete(*doomed)
            self.retired = upto

    async def read_batches(self, step: int) -> list[MicroBatch] | None:
        """Every micro-batch of ``batches:{step}`` with ``index % W == rank``; None when asked to stop first."""
        stream = self.bus.keys.batches(step)
        last_id, got, count = "0", {}, None
        while count is None or len(got) < count:
            if self._stop.is_set():
                return None
            if self._publishing is not None and self._publishing.done():  # its error stops the trainer now
                await self.weights_published()
            self.tenure.check()  # waiting for the packer is progress (trainer.progress_timeout_s)
            entries = await self.bus.read_fanout(stream, last_id, count=1000, block_ms=self.config.redis.block_ms,
                                                 replicated=True)  # a failover cannot take back what it trained on
            if not entries and count is None and await self._data_exhausted_before(step):
                self.log.info("trainer_done", step=self.step, reason=DATA_EXHAUSTED)
                return None
            for entry_id, message in entries:
                last_id = entry_id
                if isinstance(message, MicroBatch) and message.step == step:
                    got[message.index] = message
                    count = message.count
        self._step_batches = [got[i] for i in sorted(got)]
        return [got[i] for i in sorted(got) if i % self.ctx.world_size == self.ctx.rank]

    async def _data_exhausted_before(self, step: int) -> bool:
        """Whether the data ran out and the packer's last step comes before ``step`` (no batches will come)."""
        last = await exhausted_at(self.bus, self.config.feeder.max_epochs)
        return last is not None and last < step

    def train(self, step: int, micro_batches: list[MicroBatch], wait_s: float) -> dict[str, float]:
        if self.device.type == "cuda":  # the current device is per thread, and this runs in a worker thread
            torch.cuda.set_device(self.device)
        batches = [to_batch(mb, self.device, step) for mb in micro_batches]
        return train_step(self.policy, self.optimizer, self.scheduler, batches, loss_fns=self.loss_fns, ctx=self.ctx,
                          step=step, max_grad_norm=self.cfg.max_grad_norm, n_params=self.n_params, wait_s=wait_s,
                          forward_batch=self.cfg.forward_batch, reference=self.reference,
                          kl_penalty_coef=self.cfg.kl_penalty_coef, entropy_coef=self.cfg.entropy_coef)

    async def publish_weights(self, step: int, republish: bool = False) -> None:
        """Weights of ``step`` to inference servers, then ``trained = step`` (rank 0; every rank gathers). Waits for
        the previous step's weights first (versions go out in order, one at a time); this step's safetensors are
        written and announced in the background, from a copy, while the next step trains."""
        await self.weights_published()
        state = full_state_dict(self.policy, self.ctx)
        if not self.ctx.is_main:
            return
        if self.lora is not None:
            state = adapter_tensors(state)
        bad = nonfinite_tensors(state)
        if bad:
            raise RlbusError(f"weights of step {step} hold NaN or inf ({bad[:3]}); not publishing them. The trainer "
                             f"restarts from its latest checkpoint; lower trainer.lr or check the rewards if it recurs")
        if self.broadcaster is not None:
            event = self.broadcaster.event(step, state)
            await self.tenure.publish([(self.bus.keys.weights(), event)])
            await asyncio.to_thread(self.broadcaster.broadcast, event, state)
            await self.tenure.publish([self._trained(step)], step=step)
            self.log.info("weights_published", step=step, format=event.format, dir=event.dir)
        elif self.lora is not None or republish:
            await self._publish_files(step, state, republish)
        else:  # from a copy: the next step changes the parameters in place
            self._publishing = asyncio.create_task(self._publish_files(step, self.host_copy(unique_tensors(state)),
                                                                       republish=False))

    async def weights_published(self) -> None:
        """Wait for the weights being published in the background (their error is raised here)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    def _trained(self, step: int) -> tuple[str, PolicyVersion]:
        return self.bus.keys.policy(), PolicyVersion(role="trained", step=step)

    async def _publish_files(self, step: int, state, republish: bool) -> None:
        """Write (or, after a restart, verify) the safetensors of ``step``; publish them and ``trained``."""
        started = time.perf_counter()
        event = await self._save_weights(step, state, republish)
        await self.tenure.publish([(self.bus.keys.weights(), event), self._trained(step)], step=step)
        await self._prune(step)
        self.log.info("weights_published", step=step, format=event.format, dir=event.dir,
                      seconds=round(time.perf_counter() - started, 4))

    async def _save_weights(self, step: int, state, republish: bool) -> WeightUpdate:
        path = weights_dir(self.output_dir, step)
        written = path / (ADAPTER_CONFIG if self.lora is not None else INDEX_NAME)
        # After a restart the folder on disk is published again as it is, once it matches its manifest.
        files = await self._verified(path, step) if republish and written.exists() else None
        if files is None and self.lora is not None:
            files = await asyncio.to_thread(save_adapter, state, path, self.lora)
        elif files is None:
            files = await asyncio.to_thread(save_weights, state, path, self.cfg.max_shard_mb, config=self.lm_config,
                                            companions=self.config.model.path)
        adapter = None if self.lora is None else f"{self.config.model.lora.resolved_name}-step{step}"
        return WeightUpdate(step=step, format="safetensors", dir=str(path.resolve()), files=files, adapter=adapter)

    async def _verified(self, path, step: int):
        """The files of a folder written before a restart, checked against its manifest; None when it does not match
        (damaged, or written before manifests were): it is then rewritten from the restored state."""
        try:
            return await asyncio.to_thread(verified_weights, path)
        except (OSError, ValueError) as e:
            self.log.warning("weights_rewritten", step=step, dir=str(path), reason=str(e))
            return None

    async def _prune(self, step: int) -> None:
        await self.tracker.refresh()
        protected = set(self.tracker.served_by.values()) | {step, self.cfg.kl_penalty_reference_step or step}
        hold = await self.bus.state_get(EVAL_HOLD_FIELD)
        if hold is not None:  # the servers will load this step for its eval
            protected.add(int(hold))
        pruned = prune_weights(self.output_dir, self.cfg.keep_weights, protected)
        if pruned:
            self.log.debug("weights_pruned", steps=pruned, protected=sorted(protected))

    async def report(self, step: int, metrics: dict[str, float]) -> None:
        if not self.ctx.is_main:
            return
        await self.bus.publish(self.bus.keys.metrics(), Metric(source="trainer", step=step, values=metrics))
        shown = {k.replace("/", "_"): round(v, 4) if abs(v) >= 1e-3 else float(f"{v:.3g}") for k, v in metrics.items()}
        self.log.info("train_step", step=step, **shown)

    async def close(self) -> None:
        if self._publishing is not None:  # stopped by an error: the step trained before it still goes out
            try:
                await asyncio.wait_for(self.weights_published(), PUBLISH_ON_CLOSE_S)
            except Exception as e:  # noqa: BLE001 - the error that stopped the trainer is the one to raise
                self.log.warning("weights_not_published", step=self.step, error=repr(e))
        if self.tenure is not None:
            await self.tenure.close()
        if self.bus is not None:
            await self.bus.close()
        close_distributed()


def _run_rank(config: RlbusConfig) -> None:
    if config.trainer.num_threads:
        torch.set_num_threads(config.trainer.num_threads)
    configure_logging(config.log)
    asyncio.run(run_worker(TrainerWorker(config)))


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus trainer @ cfg.toml [--nproc N]``: one rank, or N ranks spawned here (torchrun sets RANK itself)."""
    parser = argparse.ArgumentParser(prog="rlbus trainer", description="Train on batches:{s}, publish weights.")
    parser.add_argument("--nproc", type=int, default=config.trainer.nproc, help="data-parallel ranks to spawn")
    args = parser.parse_args(argv)
    if args.nproc > 1 and "RANK" not in os.environ:
        config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"nproc": args.nproc})})
        spawn(args.nproc, _run_rank, (config,))
        return 0
    _run_rank(config)
    return 0
