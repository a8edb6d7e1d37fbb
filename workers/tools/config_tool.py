"""``rlbus config``: the config reference page, and conversion of a prime-rl orchestrator config.

    rlbus config docs [--out docs/configuration.md] [--check]
    rlbus config convert --from prime-rl rl.toml [--out rlbus.toml]

``convert`` writes the fields that map (see :mod:`workers.tools.migration`) as an rlbus TOML, checks that it
loads, and lists on stderr every field it could not carry over, with the reason.
"""

import argparse
import sys
import tomllib
from pathlib import Path

from bus.errors import ConfigError
from workers.config import RlbusConfig
from workers.config_loader import apply_override, read_toml
from workers.run.resolved import dump_toml
from workers.tools.config_docs import render_page
from workers.tools.migration import PRIME_RL, flatten, lookup

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_SECTION_ALIASES = {"env": "train.env", "sampling": "train.sampling"}
"""prime-rl's deprecated shorthands (``[[orchestrator.env]]``, ``[orchestrator.sampling]``) → their place."""


def convert_prime_rl(data: dict) -> tuple[dict, list[tuple[str, str]]]:
    """An rlbus config (as a dict) from a prime-rl config, and the (field, reason) pairs left behind."""
    data = data.get("orchestrator", data)
    for short, full in _SECTION_ALIASES.items():
        if short in data:
            section, key = full.split(".")
            data = {**data, section: {**data.get(section, {}), key: data[short]}}
            data = {k: v for k, v in data.items() if k != short}
    if "student" in data:
        data = {**{k: v for k, v in data.items() if k != "student"}, "model": data["student"]}
    out: dict = {}
    left: list[tuple[str, str]] = []
    for path, indices, value in flatten(data, PRIME_RL):
        target = lookup(path, PRIME_RL)
        shown = _indexed(path, indices)
        if target is None:
            left.append((shown, "not a prime-rl orchestrator field rlbus knows"))
            continue
        if target.key is None:
            left.append((shown, target.note))
            continue
        apply_override(out, _indexed(target.key, indices).replace("[", ".").replace("]", ""),
                       target.value(value) if target.value else value)
    return out, left


def _indexed(path: str, indices: list[int]) -> str:
    for i in indices:
        path = path.replace("[]", f"[{i}]", 1)
    return path


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus config", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    docs = commands.add_parser("docs", help="write the config reference (every section and field, the mappings)")
    docs.add_argument("--out", type=Path, default=DOCS)
    docs.add_argument("--check", action="store_true", help="exit 1 when the page is not what the models say")
    convert = commands.add_parser("convert", help="write an rlbus config from another tool's config")
    convert.add_argument("--from", dest="source", choices=["prime-rl"], required=True)
    convert.add_argument("file", type=Path)
    convert.add_argument("--out", type=Path, help="where to write the rlbus TOML (default: stdout)")
    args = parser.parse_args(argv)
    if args.command == "docs":
        page = render_page()
        if args.check:
            if not args.out.exists() or args.out.read_text() != page:
                print(f"{args.out} is out of date; run `rlbus config docs`", file=sys.stderr)
                return 1
            return 0
        args.out.write_text(page)
        print(f"wrote {args.out}")
        return 0
    return _convert(args.file, args.out)


def _convert(path: Path, out: Path | None) -> int:
    data, left = convert_prime_rl(read_toml(path))
    text = dump_toml(data)
    try:
        RlbusConfig.model_validate(tomllib.loads(text))
    except ValueError as e:
        raise ConfigError(f"the converted config does not load: {e}") from e
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    for field, reason in left:
        print(f"not carried over: {field}: {reason}", file=sys.stderr)
    return 0
