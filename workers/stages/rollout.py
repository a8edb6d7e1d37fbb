"""The rollout worker: ``tasks:{env}`` → scored groups in ``rollouts:{env}``.

A member of consumer group ``rollout`` on every env's task stream. Up to
``rollout.max_concurrent_groups`` groups (or the adaptive limit, :mod:`workers.stages.concurrency`) run at
once; each waits on the staleness gate, plays its episodes (:mod:`workers.stages.episode`) and commits the
RolloutGroup together with the task's XACK in one MULTI, so a group is published once or not at all. A group
waiting at the gate holds no slot: otherwise training tasks blocked while the eval hold pins ``served`` would fill
every slot and the eval tasks that release the hold could never start (a deadlock). The feeder's ``inflight`` cap
bounds how many training tasks can wait.

- Failures: an attempt that raises is retried ``env.max_retries`` times, ``rollout.retry_delay_s``
  apart; then the task goes to ``dead`` with the error, and ``inflight`` drops by its group size,
  in one MULTI. Inference servers that do not answer (refused, timed out, 5xx, 429) are the
  infrastructure's fault, not the task's: the task is held (still claimed) and retried with backoff until
  they answer (:class:`~workers.inference.client.OutageHold`, ``rollout/inference_wait_s``), without using up
  its attempts; a wrong API key crashes the worker instead of dead-lettering every task. An env server that is
  unreachable, dead or cannot be restarted (:class:`~bus.errors.EnvUnavailableError`) holds the task the same way
  (``env_unreachable``, ``rollout/env_wait_s``); an error of the env's own code, or a call that hung
  (``CallTimeout``), is an attempt of the task.
- Crashes: while a group runs, the worker re-claims its task every ``claim_idle_ms / 3``
  (XCLAIM JUSTID) so the task never looks idle; a worker killed with ``kill -9`` stops doing so
  and another worker takes the task over (``Bus.reclaim``) after ``redis.claim_idle_ms``.
- SIGTERM: no new tasks; groups past the gate finish and commit; groups still at the gate are
  handed back (ack + re-add in one MULTI) for another worker.
"""

import argparse
import asyncio
import time

from bus.commit import NotOwned
from bus.entries import Entry
from bus.errors import ConfigError, EnvUnavailableError
from bus.keys import GROUP_ROLLOUT
from bus.log import get_logger
from bus.messages import Metric, RolloutGroup, Task
from bus.policy import PolicyTracker
from bus.state import INFLIGHT_FIELD, release_inflight
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.env_config import EnvConfig, EvalEnvConfig, SamplingConfig
from workers.envs.connect import start_env
from workers.inference.client import InferenceClient, InferenceUnavailableError, OutageHold
from workers.lifecycle import connect_bus, consumer_name, run_worker
from workers.stages.concurrency import AimdController, adapt
from workers.stages.episode import AnswerRunner, ChatTokens, GroupRunner, chat_answers, reference_answers
from workers.stages.gate import StalenessGate
from workers.stages.server_load import ServerLoad
from workers.stages.traces import VerifiersReferenceRunner, VerifiersRunner


def served_adapter(config: RlbusConfig, tracker: PolicyTracker):
    """LoRA: a request asks for the adapter of the version every server serves, ``{name}-step{served}`` (the base
    model before the first update), which vLLM serves side by side with the other loaded versions; the built-in
    server ignores the name and stamps the version it served. (Not keyed on ``inference.backend``: that flag is
    often given to the inference processes only.) None without LoRA."""
    lora = config.model.lora
    if lora is None:
        return None
    return lambda: (tracker.served, f"{lora.resolved_name}-step{tracker.served}" if tracker.served else None)


class RolloutWorker:
    """Rolls out tasks of every configured env (train and eval) until stopped."""

    def __init__(self, config: RlbusConfig, worker: str | None = None):
        self.config = config
        self.worker = consumer_name("rollout", worker)
        self.log = get_logger(worker=self.worker, run=config.run.name, role="rollout")
        self.train_envs: dict[str, EnvConfig] = {e.resolved_name: e for e in config.env}
        self.eval_envs: dict[str, EnvConfig] = {e.resolved_name: e for e in config.eval.env}
        self.envs = {**self.eval_envs, **self.train_envs}
        """Every env whose tasks this worker reads (an eval env named like a train env shares its server)."""
        self.bus: Bus | None = None
        self.handles: dict = {}
        self.clients: list = []
        self.runner: GroupRunner | None = None
        self.sft_runner: GroupRunner | AnswerRunner | None = None
        self.vf_sft_runner: VerifiersRunner | None = None
        self.gate: StalenessGate | None = None
        self.streams: list[str] = []
        self._running: dict[tuple[str, str], Entry] = {}
        self._gated = 0
        """Groups waiting at the staleness gate (they hold no concurrency slot)."""
        self._stop = asyncio.Event()
        self._next_start = 0.0
        self.groups_done = 0
        rollout = config.rollout
        self.concurrency = AimdController(rollout.concurrency, rollout.max_concurrent_groups)
        """The limit on groups in flight (fixed at ``max_concurrent_groups`` unless ``concurrency.adaptive``)."""
        self._peak_busy = 0
        """The most groups that ran at once since the controller last looked."""
        self.servers: ServerLoad | None = None
        """The inference servers' load, polled with ``concurrency.adaptive``."""

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        cfg = self.config
        self.bus = await connect_bus(cfg, self.worker)
        self.streams = [self.bus.keys.tasks(name) for name in self.envs]
        for stream in self.streams:
            await self.bus.ensure_group(stream, GROUP_ROLLOUT)
        handles = await asyncio.gather(
            *(start_env(env, cfg.rollout.env_timeout_s, curve_dir=cfg.rollout.curve_dir) for env in self.envs.values())
        )
        self.handles = dict(zip(self.envs, handles, strict=True))
        from transformers import AutoTokenizer  # heavy: only once the worker really starts

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model.path)
        chat = ChatTokens(tokenizer)
        inf = cfg.inference
        tracker = PolicyTracker(self.bus)
        client = self._client(cfg.inference_urls(), "inference.base_urls", timeout_s=inf.request_timeout_s,
                              max_retries=inf.max_retries, api_key_var=inf.api_key_var,
                              headers_from_env=inf.headers_from_env, adapter=served_adapter(cfg, tracker))
        teacher = None
        if any(e.mode == "opd" or (e.mode == "sft" and e.sft_source == "teacher") for e in self.envs.values()):
            t = cfg.teacher
            teacher = self._client(t.base_urls, "teacher.base_urls", timeout_s=t.request_timeout_s,
                                   max_retries=t.max_retries, api_key_var=t.api_key_var,
                                   headers_from_env=t.headers_from_env, model=t.model)
        self.gate = StalenessGate(tracker, cfg.packer.max_off_policy_steps, cfg.packer.prefetch,
                                  cfg.redis.block_ms)
        served = lambda: tracker.served  # noqa: E731
        self.runner = GroupRunner(chat, client, teacher, cfg.inference.max_model_len, fallback_version=served)
        if teacher is not None and cfg.teacher.api == "chat":
            self.sft_runner = AnswerRunner(chat, inf.max_model_len, served, chat_answers(teacher), "teacher")
        elif teacher is not None:
            self.sft_runner = GroupRunner(chat, teacher, teacher, inf.max_model_len, fallback_version=served)
        self.vf_runner = VerifiersRunner(client, served, cfg.model.path, inf.api_key_var, teacher=teacher)
        if teacher is not None and cfg.teacher.api == "completions":
            self.vf_sft_runner = VerifiersRunner(teacher, served, cfg.model.path, cfg.teacher.api_key_var)
        self.vf_reference_runner = VerifiersReferenceRunner(cfg.model.path, served, inf.max_model_len)
        self.reference_runner = AnswerRunner(chat, inf.max_model_len, served, reference_answers, "reference")
        self.log.info("rollout_ready", envs=list(self.envs), max_concurrent_groups=cfg.rollout.max_concurrent_groups,
                      adaptive=cfg.rollout.concurrency.adaptive)

    def _client(self, base_urls: list[str], name: str, **settings) -> InferenceClient:
        """A client of one pool (the student's servers or the teacher's), with that pool's own settings."""
        if not base_urls:
            raise ConfigError(f"{name} is empty; list the servers (http://HOST:PORT/v1) or let `rlbus run` start them")
        client = InferenceClient(base_urls, **settings)
        self.clients.append(client)
        return client

    async def run(self) -> None:
        active: set[asyncio.Task] = set()
        heartbeat = asyncio.create_task(self.bus.keep_claimed(GROUP_ROLLOUT, lambda: self._running))
        adapting = self._start_adapting()
        try:
            while not self._stop.is_set():
                if heartbeat.done():
                    heartbeat.result()  # it gave up: the running tasks may be another worker's now
                if adapting is not None and adapting.done():
                    adapting.result()
                await self.bus.trim_consumed_every(self.streams)
                busy, limit = len(active) - self._gated, self.concurrency.limit
                self._peak_busy = max(self._peak_busy, busy)
                if busy >= limit:
                    # Re-check every block_ms: a group that reaches the gate frees its slot without finishing.
                    await asyncio.wait(active, timeout=self.config.redis.block_ms / 1000,
                                       return_when=asyncio.FIRST_COMPLETED)
                elif await self._rate_limit():
                    count = 1 if self.config.rollout.tasks_per_minute else limit - busy
                    for entry in await self._next_entries(count):
                        self._running[(entry.stream, entry.id)] = entry
                        active.add(asyncio.create_task(self._handle(entry)))
                for done in [t for t in active if t.done()]:
                    active.discard(done)
                    done.result()  # anything but a rollout failure (Redis down, a bug) crashes the worker
            if active:
                self.log.info("rollout_draining", groups=len(active))
                await asyncio.gather(*active)
        finally:
            heartbeat.cancel()
            if adapting is not None:
                adapting.cancel()
        self.log.info("rollout_stopped", groups_done=self.groups_done)

    def _start_adapting(self) -> asyncio.Task | None:
        """``rollout.concurrency.adaptive``: the task that moves the limit with the servers' load (else None)."""
        if not self.config.rollout.concurrency.adaptive:
            return None
        self.servers = ServerLoad(self.config.inference_urls(), self.clients[0].headers,
                                  self.config.rollout.concurrency.interval_s)
        return asyncio.create_task(adapt(self.concurrency, self.servers, self._take_peak_busy, self.log))

    def _take_peak_busy(self) -> int:
        peak, self._peak_busy = self._peak_busy, 0
        return peak

    async def _rate_limit(self) -> bool:
        """tasks_per_minute: wait for the next start slot; False when a stop came first."""
        per_minute = self.config.rollout.tasks_per_minute
        if per_minute is None:
            return True
        wait_s = self._next_start - time.monotonic()
        if wait_s > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=wait_s)
                return False
            except TimeoutError:
                pass
        self._next_start = max(self._next_start, time.monotonic()) + 60.0 / per_minute
        return True

    async def _next_entries(self, count: int) -> list[Entry]:
        """Tasks of dead consumers first (Bus.reclaim), else new ones (XREADGROUP BLOCK)."""
        entries: list[Entry] = []
        for stream in self.streams:
            if len(entries) < count:
                claimed = await self.bus.reclaim(
                    stream, GROUP_ROLLOUT, count=count - len(entries), on_dead=release_inflight(self.bus.keys.state())
                )
                entries += [e for e in claimed if (e.stream, e.id) not in self._running]
        if entries:
            for entry in entries:
                self.log.info("task_reclaimed", stream=entry.stream, entry_id=entry.id, deliveries=entry.deliveries)
            return entries
        return await self.bus.read_group(self.streams, GROUP_ROLLOUT, count=count, block_ms=self.config.redis.block_ms)

    async def _handle(self, entry: Entry) -> None:
        try:
            if not isinstance(entry.message, Task):
                await self.bus.dead_letter(entry, reason=f"expected a task, got {entry.message.KIND!r}",
                                           group=GROUP_ROLLOUT)
                return
            await self._rollout(entry, entry.message)
        finally:
            self._running.pop((entry.stream, entry.id), None)

    async def _rollout(self, entry: Entry, task: Task) -> None:
        envs = self.eval_envs if task.eval_step is not None else self.train_envs
        env = envs.get(task.env)
        if env is None:
            await self._dead_letter(entry, task, f"task for env {task.env!r}, which is not configured here "
                                    f"(envs: {sorted(self.envs)})")
            return
        started = time.monotonic()
        log = self.log.bind(task_id=task.task_id, env=task.env)
        error, attempt = None, 0
        outage, env_outage = OutageHold(log), OutageHold(log, "env")
        while attempt <= env.max_retries:
            wait_gate_s = 0.0
            if task.mode != "sft":  # a teacher's or a reference's answer does not depend on the policy's version
                self._gated += 1
                try:
                    wait_gate_s = await self.gate.wait(task.eval_step, stop=self._stop)
                finally:
                    self._gated -= 1
                if not self.gate.is_open(task.eval_step):
                    await self._hand_back(entry, task)
                    log.info("task_handed_back", reason="stopping while the staleness gate is closed")
                    return
            limit = asyncio.timeout(env.rollout_timeout_s)
            try:
                runner = self._runner(task, env)
                async with limit:
                    samples, timings = await runner.run(task, self.handles[task.env], self._sampling(env),
                                                        env.max_turns, env.max_total_completion_tokens)
                break
            except InferenceUnavailableError as e:  # the servers are down, not the task bad: hold it
                if not await outage.wait(e, self._stop):
                    await self._hand_back(entry, task)
                    log.info("task_handed_back", reason="stopping while the inference servers do not answer")
                    return
            except EnvUnavailableError as e:  # the env server is down, not the task bad: hold it
                if not await env_outage.wait(e, self._stop):
                    await self._hand_back(entry, task)
                    log.info("task_handed_back", reason="stopping while the env server does not answer")
                    return
            except ConfigError:
                raise  # a wrong API key: every task would fail alike
            except Exception as e:  # the one boundary: retry, then dead-letter
                error = f"{type(e).__name__}: {e}"
                if limit.expired():
                    error = f"TimeoutError: the rollout took longer than rollout_timeout_s={env.rollout_timeout_s}"
                log.warning("rollout_failed", attempt=attempt + 1, max_retries=env.max_retries, error=error)
                attempt += 1
                if attempt <= env.max_retries:
                    await asyncio.sleep(self.config.rollout.retry_delay_s)
        else:
            await self._dead_letter(entry, task, f"{error} (after {env.max_retries + 1} attempts)")
            return
        outage.recovered()
        env_outage.recovered()
        timings = {**timings, "wait_gate_s": wait_gate_s, "inference_wait_s": outage.held_s,
                   "env_wait_s": env_outage.held_s,
                   "total_s": time.monotonic() - started}
        group = RolloutGroup(task_id=task.task_id, env=task.env, example_id=task.example_id,
                             example_index=task.example_index, epoch=task.epoch, mode=task.mode, samples=samples,
                             eval_step=task.eval_step, timings=timings)
        generated = sum(int(s.loss_mask.sum()) for s in samples)
        metric = Metric(source="rollout", values={"tokens_generated": float(generated), "group_s": timings["total_s"],
                                                  "wait_gate_s": wait_gate_s,
                                                  "rollout/inference_wait_s": outage.held_s,
                                                  "rollout/env_wait_s": env_outage.held_s,
                                                  "rollout/train_groups": float(task.eval_step is None),
                                                  "rollout/concurrency_limit": float(self.concurrency.limit)})
        try:
            await self.bus.commit([(entry.stream, GROUP_ROLLOUT, entry.id)],
                                  [(self.bus.keys.rollouts(task.env), group), (self.bus.keys.metrics(), metric)],
                                  extra=self._recount(task, len(samples)))
        except NotOwned as e:
            log.warning("group_abandoned", error=str(e), hint="another worker reclaimed the task; its group counts")
            return
        self.groups_done += 1
        log.info("group_done", reward=round(group.reward, 4), tokens=group.tokens, policy_version=group.policy_version,
                 total_s=round(timings["total_s"], 3))

    def _recount(self, task: Task, samples: int):
        """A training group of other than ``group_size`` samples (a verifiers episode may have several trainable
        branches) moves ``inflight`` by the difference in its commit, so the feeder's count stays exact."""
        if task.eval_step is not None or samples == task.group_size:
            return None
        state = self.bus.keys.state()
        return lambda pipe: pipe.hincrby(state, INFLIGHT_FIELD, samples - task.group_size)

    def _runner(self, task: Task, env: EnvConfig):
        """Who makes the task's samples: the policy's servers, the teacher's (sft), or the env's reference (sft
        from data); for a verifiers env, its runs (its harness calls the policy's servers, or the teacher's for
        sft, itself) or its tasks' answers."""
        if task.mode != "sft":
            return self.vf_runner if env.kind == "verifiers" else self.runner
        if env.kind == "verifiers":
            return self.vf_reference_runner if env.sft_source == "reference" else self.vf_sft_runner
        return self.reference_runner if env.sft_source == "reference" else self.sft_runner

    def _sampling(self, env: EnvConfig) -> SamplingConfig:
        if isinstance(env, EvalEnvConfig):
            return self.config.eval_sampling(env)
        return self.config.env_sampling(env)

    async def _hand_back(self, entry: Entry, task: Task) -> None:
        """Ack the task and add it again (one MULTI) so another worker takes it now."""
        try:
            await self.bus.commit([(entry.stream, GROUP_ROLLOUT, entry.id)], [(entry.stream, task)])
        except NotOwned:
            pass  # another worker has it already

    async def _dead_letter(self, entry: Entry, task: Task, reason: str) -> None:
        """Dead-letter the task with its error and release its in-flight samples, in one MULTI."""
        release = release_inflight(self.bus.keys.state())
        await self.bus.dead_letter(entry, reason=reason, group=GROUP_ROLLOUT, extra=lambda pipe: release(entry, pipe))
        self.log.error("task_dead_lettered", task_id=task.task_id, env=task.env, reason=reason)

    async def close(self) -> None:
        if self.servers is not None:
            await self.servers.close()
        for client in self.clients:
            await client.close()
        for handle in self.handles.values():
            await handle.close()
        if self.bus is not None:
            await self.bus.close()


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus rollout @ cfg.toml [--consumer NAME]``: roll out tasks until SIGTERM."""
    parser = argparse.ArgumentParser(prog="rlbus rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--consumer", default=None, help="consumer name in group 'rollout' (default rollout-HOST-PID)")
    args = parser.parse_args(argv)
    return asyncio.run(run_worker(RolloutWorker(config, worker=args.consumer)))
