"""``docs/configuration.md``, generated: every section and field of :class:`RlbusConfig` from the pydantic
models and their docstrings, then the prime-rl and ART mappings of :mod:`workers.tools.migration`.

``rlbus config docs`` writes it; a test fails when a field has no docstring or the page is out of date.
"""

import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from workers.config import RlbusConfig
from workers.tools.migration import Target
from workers.tools.migration_art import ART
from workers.tools.migration_prime_rl import DEFAULTS, ENV, ENV_ARRAYS, PRIME_RL, VERIFIERS_ENV

HEADER = """# Configuration reference

Generated from the config models by `rlbus config docs`; do not edit by hand. A run's config is one TOML
file (or several, merged: `rlbus ROLE @ a.toml @ b.toml`), and any key can be set on the command line
(`--packer.batch_size 64`, `--env.0.group_size 4`, top-level keys as `--group-size 4`). Unknown keys are
errors. Per-env settings that an `[[env]]` (or `[[eval.env]]`) leaves unset inherit, field by field, from the
shared ones. Migrating: `rlbus config convert --from prime-rl rl.toml` writes the fields that map and lists
the others (`docs/migrating.md`); the tables at the end say where each prime-rl and ART setting lives.
"""


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (Optional, unions, Annotated, list[...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated, list):
        return [m for a in typing.get_args(annotation) for m in models_in(a)]
    return []


def sections(model: type[BaseModel] = RlbusConfig, path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of every section, depth first, in field order; ``[]`` marks an array of tables
    (``env[]`` is ``[[env]]``)."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        nested = models_in(field.annotation)
        many = typing.get_origin(field.annotation) is list or any(
            typing.get_origin(a) is list for a in typing.get_args(field.annotation))
        for sub in nested:
            if sub is RlbusConfig:
                continue  # a stage's config: the whole page again
            header = (f"{path}.{name}" if path else name) + ("[]" if many else "")
            if len(nested) > 1:
                header += f" (type = {sub.model_fields['type'].default!r})"
            out += sections(sub, header)
    return out


def missing_docstrings() -> list[str]:
    """``Model.field`` of every field without a docstring."""
    return [f"{m.__name__}.{name}" for _, m in sections() for name, f in m.model_fields.items() if not f.description]


MODULE_PATH = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Za-z_])")
"""A dotted module path before a name in a type's text (``typing.``, ``pathlib.``, ``workers.env_config.``)."""


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = MODULE_PATH.sub("", text or str(annotation))  # workers.model_config.LoraConfig -> LoraConfig
    for noise in ("Annotated[", ", FieldInfo(annotation=NoneType, required=True, discriminator='type')]"):
        text = text.replace(noise, "")
    return text


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel) or (isinstance(value, list) and value and isinstance(value[0], BaseModel)):
        return "(section)"
    try:
        return json.dumps(value, default=str)
    except TypeError:
        return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(header: str, model: type[BaseModel]) -> list[str]:
    title = header or "top level"
    lines = [f"### `{title}`" if header else "### Top-level keys", ""]
    if model.__doc__ and model is not RlbusConfig and not model.__doc__.startswith("!"):
        lines += [_cell(model.__doc__), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if models_in(field.annotation) and model is RlbusConfig or models_in(field.annotation) == [RlbusConfig]:
            continue  # sections get their own table; a stage's config is this whole page
        aliases = [a for a in getattr(field.validation_alias, "choices", []) if a != name]
        key = f"`{name}`" + (f" (also `{'`, `'.join(aliases)}`)" if aliases else "")
        lines.append(f"| {key} | `{_cell(_type(field.annotation))}` | `{_default(field)}` | "
                     f"{_cell(field.description or '')} |")
    return lines + [""]


DIFFERENCES: list[tuple[str, str]] = [
    ("group_size = 8 by default", "prime-rl's is 1; a GRPO group needs more than one sample to have a signal"),
    ("batch sizes count samples", "ART counts groups; prime-rl's batch_size counts samples, as rlbus's"),
    ("filter.advantage.std_normalize = false", "ART normalises by default; Dr. GRPO showed the std division biases"
     " toward easy and hard prompts"),
    ("[[env]] and [sampling] at the top level", "prime-rl nests them under [orchestrator.train]; rlbus has one "
     "training pool"),
    ("model.path instead of model.name", "a local folder or a hub id, as transformers reads it; a missing local "
     "folder gets the random-init preset, so a tiny run needs no download"),
    ("prefetch_steps (1)", "rlbus builds a step ahead of the trainer; it is capped at max_off_policy_steps, so "
     "0 stays strictly on-policy"),
    ("trainer.loss = dppo", "ART defaults to cispo; dppo is prime-rl's default"),
    ("an empty Redis restores from the checkpoint", "prime-rl's orchestrator keeps its progress in its own "
     "checkpoint; rlbus keeps it in Redis and copies it into every trainer checkpoint"),
]
"""Where rlbus differs on purpose: (what, why)."""


def _rows(table: dict[str, Target]) -> list[str]:
    lines = ["| field | rlbus | note |", "|---|---|---|"]
    for field, target in table.items():
        rlbus = f"`{target.key}`" if target.key else ("(rlbus's default)" if target.same else "—")
        if target.each:
            rlbus = f"`{target.each}` (item by item)" + (f", or `{target.key}`" if target.key else "")
        lines.append(f"| `{field}` | {rlbus} | {_cell(target.note)} |")
    return lines + [""]


def _prime_rl() -> list[str]:
    env_rows = tuple(f"{array}." for array in ENV_ARRAYS)
    return [
        "## From prime-rl", "",
        "Paths are those of a combined `rl.toml` (a split orchestrator, trainer or inference file is read under "
        "`orchestrator.`, `trainer.`, `inference.`); `[]` marks an array of tables. `rlbus config convert --from "
        "prime-rl` applies these tables; `—` is a field left behind, with the reason. See `docs/migrating.md`.", "",
        *_rows({k: t for k, t in PRIME_RL.items() if not k.startswith(env_rows)}),
        "### prime-rl env blocks", "",
        f"The same rows hold under each of {', '.join(f'`{a}`' for a in ENV_ARRAYS)}: train arrays become "
        "`[[env]]`, eval arrays `[[eval.env]]` (which add `num_examples` and `interval`). A block named by `id`:", "",
        *_rows({f"[].{k}": t for k, t in ENV.items()}),
        "A block of the verifiers form (`taskset`, `agent`, `harness`, or a source's `env` table) carries over 1:1, "
        "by the same names:", "",
        *_rows({f"[].{k}": t for k, t in VERIFIERS_ENV.items() if k not in ENV or VERIFIERS_ENV[k] != ENV[k]}),
        "### Defaults that differ", "",
        "Written into the converted config, with a comment, where the prime-rl config leaves them unset:", "",
        "| prime-rl field | rlbus key | prime-rl's default | why |", "|---|---|---|---|",
        *[f"| `{f}` | `{k}` | `{v}` | {_cell(why)} |" for f, k, v, why in DEFAULTS], "",
    ]


def render_page() -> str:
    lines = [HEADER, "## Sections", ""]
    for header, model in sections():
        lines += _section(header, model)
    lines += _prime_rl()
    lines += ["## From ART's `PipelineTrainer`", "", "Keyword arguments of `PipelineTrainer(...)` (`pipeline.*`: its "
              "`PipelineRuntimeConfig`); ART's deprecated direct settings and earlier names are listed as aliases.",
              "", *_rows(ART)]
    lines += ["## Where rlbus differs on purpose", "", "| rlbus | why |", "|---|---|"]
    lines += [f"| {_cell(what)} | {_cell(why)} |" for what, why in DIFFERENCES]
    return "\n".join(lines).rstrip() + "\n"
