"""What would stop ``rlbus run`` at start, without starting anything: a config (as a dict) → one line per problem.

The same checks ``rlbus run`` makes before it starts a process (:func:`workers.run.checks.run_problems`, which
``rlbus run --dry-run`` reports too), after the config model's own validation, one line per env or field. Whether
an env runs is the env registry's and the config model's to say (an env form this checkout does not know fails
validation, and is reported as such).
"""

from pydantic import ValidationError

from workers.config import RlbusConfig
from workers.run.checks import run_problems


def startup_problems(data: dict) -> list[str]:
    """One line per problem that would stop ``rlbus run`` with this config; empty when it would start."""
    try:
        config = RlbusConfig.model_validate(data)
    except ValidationError as e:
        return _validation_lines(e.errors())
    except ValueError as e:
        return [str(e)]
    return run_problems(config)


def _validation_lines(errors: list[dict]) -> list[str]:
    """One line per env (``env.0: id: Field required; taskset: not a field …``) or other field."""
    lines: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
        head = 2 if loc[:1] == ["env"] else 3 if loc[:2] == ["eval", "env"] else len(loc)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "not a field this rlbus knows"
        where, rest = ".".join(loc[:head]) or "the config", ".".join(loc[head:])
        lines.setdefault(where, []).append(f"{rest}: {message}" if rest else message)
    return [f"{where}: {'; '.join(messages)}" for where, messages in lines.items()]
