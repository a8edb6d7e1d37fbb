"""``docs/configuration.md``, generated: every section and field of :class:`RlbusConfig` from the pydantic
models and their docstrings, then the prime-rl and ART mappings of :mod:`workers.tools.migration`.

``rlbus config docs`` writes it; a test fails when a field has no docstring or the page is out of date.
"""

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from workers.config import RlbusConfig
from workers.tools.migration import ART, DIFFERENCES, PRIME_RL, Target

HEADER = """# Configuration reference

Generated from the config models by `rlbus config docs`; do not edit by hand. A run's config is one TOML
file (or several, merged: `rlbus ROLE @ a.toml @ b.toml`), and any key can be set on the command line
(`--packer.batch_size 64`, `--env.0.group_size 4`, top-level keys as `--group-size 4`). Unknown keys are
errors. Per-env settings that an `[[env]]` (or `[[eval.env]]`) leaves unset inherit, field by field, from the
shared ones. Migrating: `rlbus config convert --from prime-rl rl.toml` writes the fields that map and lists
the others; the tables at the end say where each prime-rl and ART setting lives.
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


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    for noise in ("workers.env_config.", "workers.batch_config.", "workers.config.", "trainer.config.",
                  "bus.config.", "pathlib.", "Annotated[", ", FieldInfo(annotation=NoneType, required=True, "
                  "discriminator='type')]"):
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


def _mapping(title: str, table: dict[str, Target], intro: str) -> list[str]:
    lines = [f"## {title}", "", intro, "", "| field | rlbus | note |", "|---|---|---|"]
    for field, target in table.items():
        rlbus = f"`{target.key}`" if target.key else "—"
        lines.append(f"| `{field}` | {rlbus} | {_cell(target.note)} |")
    return lines + [""]


def render_page() -> str:
    lines = [HEADER, "## Sections", ""]
    for header, model in sections():
        lines += _section(header, model)
    lines += _mapping("From prime-rl's orchestrator config", PRIME_RL,
                      "Paths are under `[orchestrator]`; `[]` marks an array of tables (`[[orchestrator.train.env]]`)."
                      " `rlbus config convert --from prime-rl` applies this table.")
    lines += _mapping("From ART's `PipelineTrainer`", ART, "Keyword arguments of `PipelineTrainer(...)`.")
    lines += ["## Where rlbus differs on purpose", "", "| rlbus | why |", "|---|---|"]
    lines += [f"| {_cell(what)} | {_cell(why)} |" for what, why in DIFFERENCES]
    return "\n".join(lines).rstrip() + "\n"
