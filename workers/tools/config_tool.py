"""``rlbus config``: the config reference page, and conversion of prime-rl configs.

    rlbus config docs [--out docs/configuration.md] [--check]
    rlbus config convert --from prime-rl rl.toml [--out rlbus.toml]
    rlbus config convert --from prime-rl orch.toml train.toml infer.toml [--out rlbus.toml]

``convert`` reads any prime-rl layout (:mod:`workers.tools.prime_rl_layout`), writes every field that maps with the
user's value (:mod:`workers.tools.prime_rl_convert`), and prime-rl's default where rlbus's differs, each with a
comment; it lists every field left behind with the reason, grouped per env, then runs ``rlbus run``'s start-up
checks (:mod:`workers.tools.startup_check`) and exits 2 when one of them would stop the run.
"""

import argparse
import re
import sys
from pathlib import Path

from bus.errors import CONFIG_EXIT_CODE, ConfigError
from workers.run.resolved import dump_toml
from workers.tools.config_docs import render_page
from workers.tools.prime_rl_convert import Conversion, convert
from workers.tools.prime_rl_layout import combine, read
from workers.tools.startup_check import startup_problems

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

ENV_ITEM = re.compile(r"^orchestrator\.(?:(train|eval)\.)?(?:env|source)\[(\d+)\]|^orchestrator\.(environment)\.")
"""The env block a source field belongs to: (train/eval/None, index) or the 2025 single ``[environment]``."""


def main(config, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus config", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    docs = commands.add_parser("docs", help="write the config reference (every section and field, the mappings)")
    docs.add_argument("--out", type=Path, default=DOCS)
    docs.add_argument("--check", action="store_true", help="exit 1 when the page is not what the models say")
    conv = commands.add_parser("convert", help="write an rlbus config from prime-rl config files")
    conv.add_argument("--from", dest="source", choices=["prime-rl"], required=True)
    conv.add_argument("files", type=Path, nargs="+", metavar="FILE",
                      help="an rl.toml, or the orchestrator, trainer and inference files of one run")
    conv.add_argument("--out", type=Path, help="where to write the rlbus TOML (default: stdout)")
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
    return _convert(args.files, args.out)


def _convert(files: list[Path], out: Path | None) -> int:
    if out is not None:
        _check_out(out)
    conversion = convert(combine([(path, read(path)) for path in files]))
    text = render(conversion, files)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    carried = len([c for c in conversion.carried if c.key is not None])
    print(f"carried over {carried} fields, {len(conversion.defaults)} prime-rl defaults written, "
          f"{len(conversion.left)} fields left behind", file=sys.stderr)
    for line in loss_lines(conversion):
        print(line, file=sys.stderr)
    problems = startup_problems(conversion.data)
    for problem in problems:
        print(f"would stop `rlbus run`: {problem}", file=sys.stderr)
    return CONFIG_EXIT_CODE if problems else 0


def _check_out(out: Path) -> None:
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file path ({out / 'rlbus.toml'})")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist; create it or write elsewhere")


def render(conversion: Conversion, files: list[Path]) -> str:
    """The rlbus TOML: a header naming the sources and what was left behind, then the config, each default that
    differs from rlbus's commented."""
    lines = [f"# Converted from prime-rl by `rlbus config convert` ({', '.join(map(str, files))})."]
    losses = loss_lines(conversion)
    if losses:
        lines += ["# Left behind, with the reason:"] + [f"#{line}" for line in losses]
    return "\n".join(lines) + "\n\n" + annotate(dump_toml(conversion.data), conversion.defaults)


def loss_lines(conversion: Conversion) -> list[str]:
    """One line per field left behind, grouped: the run's own fields, then each env's."""
    groups: dict[str, list[str]] = {}
    for field, reason in conversion.left:
        groups.setdefault(_group(field, conversion.data), []).append(f"    {field}: {reason}")
    return [line for group, fields in groups.items() for line in (f"  {group}:", *fields)]


def _group(field: str, data: dict) -> str:
    match = ENV_ITEM.match(field)
    if match is None:
        return "run"
    kind, index, single = match.groups()
    section, i = ("env", 0) if single else ("eval.env" if kind == "eval" else "env", int(index))
    envs = data.get("eval", {}).get("env", []) if section == "eval.env" else data.get("env", [])
    env = envs[i] if i < len(envs) else {}
    name = env.get("name") or env.get("id") or (env.get("taskset") or {}).get("id") or "?"
    return f"[[{section}]] {i} ({name})"


def annotate(text: str, notes: dict[str, str]) -> str:
    """``text`` (TOML from :func:`dump_toml`) with ``# note`` after the line of each dotted key in ``notes``
    (``env[0].ratio``)."""
    out, table, counts = [], "", {}
    for line in text.splitlines():
        if line.startswith("[["):
            name = line.strip("[]")
            counts[name] = counts.get(name, -1) + 1
            table = f"{name}[{counts[name]}]"
        elif line.startswith("["):
            table = line.strip("[]")
        elif " = " in line:
            key = line.split(" = ", 1)[0]
            note = notes.get(f"{table}.{key}" if table else key)
            if note:
                line = f"{line}  # {note}"
        out.append(line)
    return "\n".join(out) + "\n"
