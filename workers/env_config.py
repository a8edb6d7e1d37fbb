"""The sections of what is rolled out: ``[sampling]``, ``[[env]]`` and ``[eval]`` (with ``[[eval.env]]``).

Per-env settings inherit as in prime-rl: a field an env leaves unset takes the shared value, field by field
(an env's ``sampling`` table that sets only ``temperature`` keeps the shared ``max_completion_tokens``).
:meth:`workers.config.RlbusConfig` resolves the inheritance once, when the config is validated, so every
worker (and ``config.resolved.toml``) sees each env's effective values.
"""

import importlib.util
import warnings
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from bus.config import Section
from bus.messages import Mode
from workers.batch_config import AdvantageConfig


def _deprecate_max_tokens(data: Any) -> Any:
    if isinstance(data, dict) and "max_tokens" in data and "max_completion_tokens" not in data:
        warnings.warn("'max_tokens' is deprecated, use 'max_completion_tokens'", FutureWarning, stacklevel=3)
    return data


class _Requests(Section):
    """What every sampling request carries besides its knobs."""

    stop: list[str] = Field(default_factory=list)
    """Stop strings ending a model turn."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra fields sent with every request."""

    @model_validator(mode="before")
    @classmethod
    def _deprecations(cls, data: Any) -> Any:
        return _deprecate_max_tokens(data)


class SamplingConfig(_Requests):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (the trainer divides logits by it)."""

    max_completion_tokens: int | None = Field(
        128, ge=1, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    """Maximum tokens per model turn. None: until EOS or the context limit."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1.0 = off). Training should keep it off: logprobs are of the full distribution."""

    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 = off."""

    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling threshold; 0 = off."""


class EvalSamplingConfig(_Requests):
    """Eval sampling: every knob None by default, and a None knob is not sent (the server's default applies)."""

    temperature: float | None = Field(None, ge=0)
    """Sampling temperature; None defers to the inference server's default."""

    max_completion_tokens: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    """Maximum tokens per model turn; None: until EOS or the context limit."""

    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling threshold; None defers to the server."""

    top_k: int | None = Field(None, ge=-1)
    """Top-k sampling; None defers to the server."""

    min_p: float | None = Field(None, ge=0, le=1)
    """Min-p sampling threshold; None defers to the server."""

    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    """Reasoning effort of reasoning models (sent as ``reasoning_effort``); None: not sent."""


VERIFIERS_INSTALL = "pip install 'rlbus[verifiers]'"
OPENENV_INSTALL = "pip install 'rlbus[openenv]'"


class OpenEnvConfig(Section):
    """An OpenEnv environment server: spawned from an installed package's app, or an external one."""

    app: str | None = None
    """The server's ASGI app, ``package.module:app`` (served with ``uvicorn``); None: use ``base_url``."""

    base_url: str | None = None
    """An external server (``http://host:8000``); None: spawn ``app``."""

    num_episodes: int = Field(1000, ge=1)
    """Episodes in the env's dataset: episode ``i`` is ``reset(seed=i)``."""

    action_field: str = "message"
    """The action field the model's reply goes into."""

    observation_field: str = "message"
    """The observation field that becomes the next user turn (the whole observation when it has none)."""

    reset_args: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of every ``reset``."""

    start_timeout_s: float = Field(180.0, gt=0)
    """Seconds a spawned server has to answer ``/health``."""

    @model_validator(mode="after")
    def _one_server(self) -> "OpenEnvConfig":
        if (self.app is None) == (self.base_url is None):
            raise ValueError('openenv needs exactly one of app = "package.module:app" or base_url = "http://..."')
        return self


class EnvConfig(Section):
    id: str = ""
    """Built-in env name (``reverse_text``, ``echo_chars``, ``guess_number``) or import path ``package.module:factory``.
    With ``taskset``: verifiers' env id (``best-of-n``), "" for the taskset's own env."""

    taskset: dict[str, Any] | None = None
    """A verifiers v1 env (prime-rl's form): the taskset package and its own args, ``{id = "reverse-text", ...}``;
    None: an rlbus env named by ``id``. Needs the verifiers extra (see docs/environments.md)."""

    agent: dict[str, Any] | None = None
    """verifiers: the agent seat as verifiers' ``AgentConfig`` takes it (``harness``, ``runtime``, ``max_turns``,
    ``timeout``, ...); unset harness: ``rlbus-chat`` (in-process), unset runtime: ``subprocess``."""

    seats: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """verifiers: the env's other agent seats by name, each as ``agent`` takes it (verifiers' openenv taskset seats
    a ``player``). A table written beside ``taskset`` under a seat's name (``player = {max_turns = 4}``, as prime-rl
    writes it) lands here; verifiers rejects a name its env has no seat for."""

    timeout: dict[str, Any] = Field(default_factory=dict)
    """verifiers: the env's own timeouts in seconds (``{episode = 120, finalize = 30}``); {}: none."""

    pool: dict[str, Any] = Field(default_factory=dict)
    """verifiers: how ``serve_env`` hosts the env (``{type = "static", num_workers = 2}``); {}: one server process."""

    max_tasks: int | None = Field(None, ge=1)
    """verifiers: tasks taken from the taskset (required for an infinite one); None: all of them."""

    openenv: OpenEnvConfig | None = None
    """An OpenEnv environment server (``{app = "pkg.server:app"}`` or ``{base_url = "http://..."}``); None: not one.
    Needs the openenv extra."""

    name: str | None = None
    """Display name in keys, logs and metrics; defaults to the id. Unique per run; ``all`` is reserved."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env factory."""

    ratio: float | None = Field(None, gt=0)
    """Relative sampling weight; set on all train envs or on none (uniform over examples)."""

    group_size: int = Field(8, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Completions sampled per example (the GRPO group); unset: the top-level ``group_size``."""

    mode: Mode = "rl"
    """Training mode of this env's samples: rl, opd (needs [teacher]) or sft; unset: the top-level
    ``training_mode``."""

    sft_source: Literal["teacher", "reference"] = "teacher"
    """Where an sft env's completions come from: the teacher's servers (``[teacher]``), or each example's
    reference answer (envs whose examples carry one, such as ``dataset`` and ``reasoning_gym``; a verifiers
    taskset's ``answer`` field): prompt + reference, chat template applied, loss on the assistant tokens, no
    teacher. One sample per task (group_size 1)."""

    address: str | None = None
    """ZeroMQ address of an external env server (``tcp://host:5555``); None: the rollout worker spawns one."""

    max_retries: int = Field(3, ge=0)
    """Times a failed rollout of this env is retried before it is dead-lettered; unset: the top-level
    ``max_retries``."""

    max_turns: int = Field(8, ge=1)
    """Model turns per episode in multi-turn envs."""

    rollout_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit of one rollout of a group (all its turns); past it the attempt fails and is retried like
    any failed rollout (prime-rl's ``timeout.rollout``). None: no limit."""

    max_total_completion_tokens: int | None = Field(None, ge=1)
    """Budget of model tokens over all turns of one episode (prime-rl's ``max_output_tokens``); an episode that
    spends it ends truncated. None: only the per-turn ``max_completion_tokens`` and the context limit apply."""

    sampling: SamplingConfig | None = None
    """Per-env sampling; unset fields inherit from [sampling], field by field."""

    advantage: AdvantageConfig | None = None
    """Per-env advantage settings (the seed's per-env ``algo``); unset fields inherit from [filter.advantage]."""

    @property
    def resolved_name(self) -> str:
        if self.name:
            return self.name
        if self.taskset is not None:
            return str(self.taskset.get("id", "")).rsplit("/", 1)[-1].split("@", 1)[0]
        if self.openenv is not None:
            return "openenv"
        return self.id.rsplit(":", 1)[-1]

    @property
    def kind(self) -> Literal["rlbus", "verifiers", "openenv"]:
        """Who serves the env: rlbus's env server, verifiers' (``taskset`` set) or an OpenEnv server (``openenv``)."""
        if self.openenv is not None:
            return "openenv"
        return "verifiers" if self.taskset is not None else "rlbus"

    @property
    def vf_id(self) -> str:
        """verifiers' env id ("" = the taskset's own env); "" for an rlbus env."""
        return self.id if self.kind == "verifiers" else ""

    @property
    def roles(self) -> dict[str, dict[str, Any]]:
        """verifiers: the agent seats this block sets, by seat name."""
        agent = {} if self.agent is None else {"agent": dict(self.agent)}
        return {**agent, **{name: dict(seat) for name, seat in self.seats.items()}}

    @model_validator(mode="before")
    @classmethod
    def _collect_seats(cls, data: Any) -> Any:
        """A verifiers block's tables under names rlbus does not know are its seats (``player = {...}``)."""
        if not isinstance(data, dict) or data.get("taskset") is None:
            return data
        known = set(cls.model_fields) | {"rollouts_per_example", "num_workers"}
        seats = {k: v for k, v in data.items() if k not in known and isinstance(v, dict)}
        if not seats:
            return data
        return {**{k: v for k, v in data.items() if k not in seats}, "seats": {**data.get("seats", {}), **seats}}

    @model_validator(mode="before")
    @classmethod
    def _removed_num_workers(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_workers" in data:
            if data["num_workers"] != "auto":
                raise ValueError(
                    f"num_workers={data['num_workers']!r} was removed (prime-rl moved it to an env `pool`); rlbus runs "
                    "one env server per rollout worker: set rollout.workers and rollout.max_concurrent_groups instead"
                )
            warnings.warn("env num_workers = 'auto' is the default and deprecated; remove it", FutureWarning,
                          stacklevel=2)
            data = {k: v for k, v in data.items() if k != "num_workers"}
        return data

    @model_validator(mode="after")
    def _check_kind(self) -> "EnvConfig":
        if self.openenv is not None:
            if self.taskset is not None or self.id:
                raise ValueError("an env is one of id = ..., taskset = {...} or openenv = {...}; set only one")
            if importlib.util.find_spec("openenv") is None:
                raise ValueError(f"openenv = {{...}} is an OpenEnv env: {OPENENV_INSTALL}")
            return self
        if self.taskset is None:
            if not self.id:
                raise ValueError('an env needs id = "..." (an rlbus env), taskset = {id = "..."} (verifiers v1) or '
                             'openenv = {app = "..."} (OpenEnv)')
            verifiers_fields = ("agent", "seats", "timeout", "pool", "max_tasks")
            stray = [f for f in verifiers_fields if getattr(self, f) not in (None, {})]
            if stray:
                raise ValueError(f"{stray} are verifiers fields; set taskset = {{id = ...}} or drop them")
            return self
        if not self.taskset.get("id"):
            raise ValueError('taskset needs an id: taskset = {id = "my-taskset", ...}')
        if importlib.util.find_spec("verifiers") is None:
            raise ValueError(f"taskset = {{id = {self.taskset['id']!r}}} is a verifiers env: {VERIFIERS_INSTALL}")
        return self

    @model_validator(mode="after")
    def _check_name(self) -> "EnvConfig":
        if self.resolved_name == "all":
            raise ValueError('env name "all" is reserved for aggregate metrics; set name = "..." to something else')
        if any(c in self.resolved_name for c in "{}: *?[]"):
            raise ValueError(f"env name {self.resolved_name!r} cannot be used in a Redis key; set name = ...")
        return self


class EvalEnvConfig(EnvConfig):
    num_examples: int = Field(-1, ge=-1)
    """Examples to evaluate; -1 = all; unset: [eval].num_examples."""

    interval: int = Field(100, ge=1)
    """Evaluate every this many steps; unset: [eval].interval."""

    group_size: int = Field(1, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Samples per example (pass@k for binary rewards uses k ≤ group_size); unset: [eval].group_size."""

    sampling: EvalSamplingConfig | None = None
    """Per-env eval sampling; unset fields inherit from [eval.sampling], field by field."""


class EvalConfig(Section):
    env: list[EvalEnvConfig] = Field(default_factory=list)
    """Eval environments (``[[eval.env]]``); empty = no eval."""

    interval: int = Field(100, ge=1)
    """Default steps between evals (each eval env may set its own)."""

    num_examples: int = Field(-1, ge=-1)
    """Default examples per eval env; -1 = all."""

    group_size: int = Field(1, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Default samples per example of an eval env."""

    max_retries: int = Field(3, ge=0)
    """Default retries of a failed eval rollout."""

    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    """Eval sampling, separate from training sampling; None knobs defer to the server."""

    skip_first_step: bool = False
    """Skip the eval of the initial policy (step 0)."""

    timeout_s: float | None = Field(600.0, gt=0)
    """An eval not complete this many seconds after it was issued finishes with the groups it has
    (``eval/{env}/groups_missing`` counts the rest, ``eval/{env}/timed_out`` = 1), so a lost eval task never pins
    ``eval:hold`` and the run; None = wait forever. Dead-lettered eval tasks count as done (missing) at once."""

    @model_validator(mode="after")
    def _resolve(self) -> "EvalConfig":
        check_unique_names(self.env, "eval env", "[[eval.env]]")
        for env in self.env:
            for field in ("num_examples", "interval", "group_size", "max_retries"):
                if field not in env.model_fields_set:
                    setattr(env, field, getattr(self, field))
            env.sampling = inherit(self.sampling, env.sampling)
        return self


def check_unique_names(envs: list[EnvConfig], what: str, table: str) -> None:
    """A ValueError naming the names that more than one env of ``envs`` has."""
    names = [e.resolved_name for e in envs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate {what} names {dupes}; give each {table} a unique name")


def inherit(shared: Section, own: Section | None) -> Section:
    """``own``'s explicitly set fields over ``shared`` (a copy); every field counts as set in the result, so
    resolving twice (a worker re-reading ``config.resolved.toml``) changes nothing."""
    if own is None:
        return type(shared).model_validate(shared.model_dump())
    return type(shared).model_validate(shared.model_dump() | own.model_dump(exclude_unset=True))
