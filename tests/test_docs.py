"""The docs against the code: links and anchors resolve, the code map names every module, the key table every key,
and every ``rlbus …`` command line in a ``bash`` block parses.

What a reader follows must work: a renamed heading, page or module, or a renamed command-line option, fails here
(the site build, ``mkdocs build --strict``, checks links and anchors again on the rendered pages). Commands are
parsed in-process through the CLI's own parsers: ``@ config`` files load, ``--section.key`` overrides validate
against the config models, and the role's argparse reads its options; nothing is started.
"""

import argparse
import ast
import contextlib
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from tests.paths import REPO
from workers import cli

PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md")])
"""Every Markdown page a reader navigates."""

SOURCE_PACKAGES = ("bus", "workers", "trainer")

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)", re.M)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a page as (language, body)."""
    found, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, body = m.group(1), m.group(2), []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        found.append((lang, "\n".join(body)))
        i += 1
    return found


def without_fences(text: str) -> str:
    """A page without its fenced code blocks."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return "\n".join(out)


def prose(text: str) -> str:
    """A page without its fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", without_fences(text))


def expanded(page: Path) -> str:
    """A page with its ``--8<-- "file[:section]"`` includes (pymdownx.snippets) put in, as the site shows it."""

    def include(m: re.Match) -> str:
        name, _, section = m.group(1).partition(":")
        text = (REPO / name).read_text()
        if section:
            start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
            text = text[text.index(start) :].split("\n", 1)[1]
            text = text[: text.index(end)].rsplit("\n", 1)[0]
        return text

    return SNIPPET.sub(include, page.read_text())


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's toc ``slugify``, on the heading's text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """Every anchor the headings of a page make (a repeated one gets ``_1``, ``_2``, … as MkDocs does)."""
    counts: dict[str, int] = {}
    found = set()
    for line in without_fences(expanded(page)).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            found.add(f"{base}_{counts[base]}" if base in counts else base)
            counts[base] = counts.get(base, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}"
            )
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_slugs_are_the_ones_mkdocs_makes():
    assert slug("Redis that fails over (Sentinel)") == "redis-that-fails-over-sentinel"
    assert slug("The quick start: `configs/quickstart.toml`") == "the-quick-start-configsquickstarttoml"
    assert slug("Leases and the trainer's tenure") == "leases-and-the-trainers-tenure"
    assert slug("2026-12-04: The vLLM server's thread share") == "2026-12-04-the-vllm-servers-thread-share"


def code_map() -> dict[str, set[str]]:
    """The README's code map: folder → the names in backticks of its row."""
    text = (REPO / "README.md").read_text()
    start, end = text.index("--8<-- [start:code-map]"), text.index("--8<-- [end:code-map]")
    rows = {}
    for line in text[start:end].split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        names = set(re.findall(r"`([^`]+)`", cells[1]))
        for folder in re.findall(r"`([^`]+/)`", cells[0]):
            rows[folder] = names
    return rows


def test_the_code_map_names_every_module():
    rows = code_map()
    missing = []
    for package in SOURCE_PACKAGES:
        for module in sorted((REPO / package).rglob("*.py")):
            if module.name == "__init__.py":
                continue
            folder = module.parent.relative_to(REPO).as_posix() + "/"
            if module.stem not in rows.get(folder, set()):
                missing.append(f"{folder}{module.name}")
    assert not missing, f"README.md's code map does not name {missing}: add each to its folder's row"


def key_families() -> set[str]:
    """The family of every key ``bus/keys.py`` builds (``tasks``, ``lease``, …), read from its f-strings."""
    tree = ast.parse((REPO / "bus" / "keys.py").read_text())
    families = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and len(node.values) > 1:
            head, second = node.values[0], node.values[1]
            if isinstance(head, ast.FormattedValue) and ast.unparse(head.value) == "self.prefix":
                if isinstance(second, ast.Constant) and re.match(r"\w+", second.value):
                    families.add(re.match(r"\w+", second.value).group())
    return families


def test_the_design_key_table_names_every_key():
    text = (REPO / "docs" / "design.md").read_text()
    table = text[text.index("## Redis keys") :].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)", table, flags=re.M))
    assert key_families() >= {"tasks", "batches", "state"}, "bus/keys.py could not be read"
    assert not key_families() - listed, f"docs/design.md's key table misses {sorted(key_families() - listed)}"


def commands(page: Path) -> list[list[str]]:
    """Every ``rlbus …`` command line of a page's shell blocks, as argv after ``rlbus``."""
    found = []
    for lang, body in blocks(page.read_text()):
        if lang not in SHELL_LANGS:
            continue
        for line in body.replace("\\\n", " ").split("\n"):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            segment: list[str] = []
            for token in [*lexer, ";"]:
                if token not in SEPARATORS:
                    segment.append(token)
                    continue
                if segment and Path(segment[0]).name == "rlbus":
                    found.append(segment[1:])
                segment = []
    return found


def config_files(page: Path, tmp_path: Path) -> dict[str, Path]:
    """The TOML blocks of a page whose first line is ``# NAME.toml``, written out: NAME.toml → its path."""
    files = {}
    for lang, body in blocks(page.read_text()):
        m = re.match(r"#\s*([\w.-]+\.toml)\s*\n", body)
        if lang == "toml" and m:
            files[m.group(1)] = tmp_path / m.group(1)
            files[m.group(1)].write_text(body)
    return files


def with_configs(argv: list[str], defined: dict[str, Path]) -> list[str]:
    """``argv`` with each ``@ FILE`` made absolute: a file of the page, of the repository, or (a run's output such as
    ``outputs/A/config.resolved.toml``, which exists only after a run) the CPU default."""

    def resolve(name: str) -> str:
        if name in defined:
            return str(defined[name])
        if (REPO / name).exists() or name.startswith("configs/"):
            return str(REPO / name)
        return str(REPO / "configs" / "default.toml")

    out, after_at = [], False
    for token in argv:
        if after_at:
            out.append(resolve(token))
        elif token.startswith("@") and token != "@":
            out.append("@" + resolve(token[1:]))
        else:
            out.append(token)
        after_at = token == "@"
    return out


class Parsed(Exception):
    """Raised once a role's argparse has read its options: the command parses, and nothing starts."""


def parse_only(argv: list[str], monkeypatch) -> tuple[bool, str]:
    """Whether ``rlbus ARGV`` parses, and what it printed."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(cli, "configure_logging", lambda config: None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            ok = cli.main(argv) == 0
        except Parsed:
            ok = True
        except SystemExit as e:
            ok = e.code in (0, None)
    return ok, out.getvalue()


def test_the_pages_hold_rlbus_commands():
    assert sum(len(commands(page)) for page in PAGES) >= 30


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_rlbus_command_line_parses(page, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    defined = config_files(page, tmp_path)
    failed = []
    for argv in commands(page):
        ok, printed = parse_only(with_configs(argv, defined), monkeypatch)
        if not ok:
            failed.append(f"rlbus {shlex.join(argv)}\n{printed.strip()[-600:]}")
    assert not failed, f"{page.relative_to(REPO)}: these command lines do not parse:\n\n" + "\n\n".join(
        failed
    )
