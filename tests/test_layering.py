"""The layers of the code, read from its imports with ``ast``: each broken rule names the import and the rule.

- Modules are ranked (``RANKS``): the bus < the config (every section's model and the loader) < the shared
  runtime (the worker lifecycle, the weight format and model loading both the trainer and the inference servers
  use) < the roles (every other module). A module imports only modules of its own rank or a lower one, so the
  bus never imports the config, and the config never imports a trainer or worker module that could import it
  back.
- No stage imports another stage: what two stages share lives in ``bus/`` (or, for the sample
  filters that both the filter and the packer run, in ``workers/stages/sample_filters.py``).
- The trainer and the inference server import nothing from ``workers/run/`` (the launcher) or
  ``workers/tools/``; neither do the stages or the env servers.
- No import circles, counting imports inside functions too (a deferred import hides a circle, it
  does not remove it).
- Raw Redis stream calls (``xadd``, ``xreadgroup``, ``xrange``, …) only in ``bus/``: a worker reads and writes
  messages through :class:`bus.streams.Bus` (size check, delivery count, dead letters) and an operator tool reads
  raw entries through :mod:`bus.raw_entries`. ``tests/`` and ``benchmarks/`` are not scanned: they call Redis
  directly to check what the bus wrote and to measure it against bare redis-py.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bus", "workers", "trainer")

RANKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("bus", ("bus",)),
    ("config", ("workers.config", "workers.config_loader", "workers.batch_config", "workers.env_config",
                "workers.slurm_config", "workers.monitor_config", "workers.concurrency_config", "workers.model_config",
                "trainer.config")),
    ("shared runtime", ("workers.lifecycle", "trainer.weights", "trainer.broadcast", "trainer.lora", "trainer.model",
                        "trainer.durable")),
    ("roles", ("workers", "trainer")),
)
"""Each rank, lowest first, and the modules (or packages) it holds; a module takes the first rank that names it."""

STAGES: dict[str, set[str]] = {
    "feeder": {"feeder"},
    "rollout": {"rollout", "episode", "gate", "traces", "concurrency", "server_load"},
    "filter": {"filter", "advantages"},
    "packer": {"packer", "packing"},
}
"""Each pipeline stage and the modules of ``workers/stages/`` that belong to it."""

SHARED_STAGE_MODULES = {"sample_filters"}
"""Modules of ``workers/stages/`` that more than one stage uses (they import no stage themselves)."""

LAUNCHER_PREFIXES = ("workers.run", "workers.tools")
"""The launcher (``rlbus run`` and its parts) and the one-shot tools: nothing in the pipeline imports them."""

PIPELINE_PREFIXES = ("trainer", "workers.inference", "workers.stages", "workers.envs")
"""What runs a run's data: the trainer, the inference servers, the stages and the env servers."""


RAW_STREAM_CALLS = frozenset({
    "xadd", "xreadgroup", "xread", "xrange", "xrevrange", "xack", "xclaim", "xautoclaim", "xpending",
    "xpending_range", "xgroup_create", "xgroup_createconsumer", "xgroup_delconsumer", "xgroup_destroy",
    "xgroup_setid", "xinfo_consumers", "xinfo_groups", "xinfo_stream", "xtrim", "xdel", "xlen",
})
"""redis-py's stream commands: called only in ``bus/`` (also as ``execute_command("XADD", …)``)."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_of(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to: itself, or its longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module in ``path``, at any depth (functions and TYPE_CHECKING blocks too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        rel = str(path.relative_to(ROOT))
        for name in names:
            target = _resolve(name, modules) if name.split(".")[0] in PACKAGES else None
            if target is not None and target != module:
                found.append(Import(module, target, rel, node.lineno))
    return found


def import_graph() -> list[Import]:
    modules = project_modules()
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules)]


def _under(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def stage_of(module: str) -> str | None:
    """The stage a module of ``workers/stages/`` belongs to (None outside stages and for shared modules)."""
    if not _under(module, "workers.stages") or module == "workers.stages":
        return None
    leaf = module.split(".")[2]
    for stage, members in STAGES.items():
        if leaf in members:
            return stage
    if leaf in SHARED_STAGE_MODULES:
        return None
    raise AssertionError(f"workers/stages/{leaf}.py belongs to no stage; add it to STAGES or SHARED_STAGE_MODULES")


def rank_of(module: str) -> int:
    """The index in ``RANKS`` of the rank ``module`` belongs to."""
    for rank, (_, members) in enumerate(RANKS):
        if _under(module, members):
            return rank
    raise AssertionError(f"{module} belongs to no rank; add it to RANKS")


RANK_RULE = " < ".join(name for name, _ in RANKS)


def layer_violations(imports: list[Import]) -> list[str]:
    """Every import that breaks a layering rule, with the rule it breaks."""
    out = []
    for imp in imports:
        source_rank, target_rank = rank_of(imp.source), rank_of(imp.target)
        if target_rank > source_rank:
            out.append(f"{imp}: {RANKS[source_rank][0]} module {imp.source} imports {RANKS[target_rank][0]} module "
                       f"{imp.target}; a module imports only its own rank or a lower one ({RANK_RULE}): move what "
                       f"it needs down, or {imp.source} up (RANKS in tests/test_layering.py)")
        source_stage, target_stage = stage_of(imp.source), stage_of(imp.target)
        if _under(imp.source, "workers.stages") and target_stage is not None and target_stage != source_stage:
            who = f"stage {source_stage!r}" if source_stage else "a shared stage module"
            out.append(f"{imp}: {who} imports stage {target_stage!r}; no stage imports another (share it through bus/)")
        if _under(imp.source, PIPELINE_PREFIXES) and _under(imp.target, LAUNCHER_PREFIXES):
            out.append(f"{imp}: the trainer, inference servers, stages and env servers import nothing from "
                       f"workers/run/ or workers/tools/ (move the shared name into bus/ or workers/lifecycle.py)")
    return out


def circles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_code_keeps_its_layers():
    violations = layer_violations(import_graph())
    assert not violations, "layering rules broken:\n" + "\n".join(violations)


def raw_stream_calls(source: str, where: str) -> list[str]:
    """Every raw Redis stream call in the module ``source`` (the file ``where``), as ``where:line calls name``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name == "execute_command" and node.args and isinstance(node.args[0], ast.Constant):
            name = str(node.args[0].value).lower()
        if name in RAW_STREAM_CALLS:
            found.append((node.lineno, name))
    return [f"{where}:{line} calls {name}" for line, name in sorted(found)]


def test_raw_stream_calls_live_only_in_bus():
    found = [call for module, path in project_modules().items() if not _under(module, "bus")
             for call in raw_stream_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("raw Redis stream calls outside bus/ (read and write through bus.streams.Bus, or "
                       "bus.raw_entries for a tool that shows or copies raw entries):\n" + "\n".join(found))


def test_there_are_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (imports inside functions count):\n" + "\n".join(" ↔ ".join(c) for c in found)


def test_every_stage_module_belongs_to_a_stage():
    for module in project_modules():
        stage_of(module)


def test_every_ranked_name_is_a_module():
    modules = project_modules()
    stale = [name for _, members in RANKS for name in members if name not in modules]
    assert not stale, f"RANKS names modules that do not exist: {stale}"


def test_the_rules_name_a_forbidden_import():
    graph = import_graph()
    planted = [
        Import("bus.streams", "workers.config", "bus/streams.py", 1),
        Import("trainer.config", "trainer.losses", "trainer/config.py", 6),
        Import("workers.stages.packer", "workers.stages.filter", "workers/stages/packer.py", 2),
        Import("trainer.worker", "workers.run.eval", "trainer/worker.py", 3),
        Import("workers.inference.server", "workers.run.status", "workers/inference/server.py", 4),
    ]
    violations = layer_violations(graph + planted)
    assert len(violations) == 5
    assert ("bus/streams.py:1 imports workers.config: bus module bus.streams imports config module workers.config; "
            "a module imports only its own rank or a lower one (bus < config < shared runtime < roles)"
            ) in violations[0]
    assert ("trainer/config.py:6 imports trainer.losses: config module trainer.config imports roles module"
            in violations[1])
    assert "stage 'packer' imports stage 'filter'" in violations[2]
    assert "trainer/worker.py:3 imports workers.run.eval" in violations[3]
    assert "workers/inference/server.py:4 imports workers.run.status" in violations[4]
    circle = circles(graph + [Import("bus.resp", "bus.codec", "bus/resp.py", 5)])
    assert ["bus.codec", "bus.resp"] in circle
    planted_calls = 'await bus.redis.xrange(key)\npipe.execute_command("XADD", key, "*", "a", 1)\nbus.publish(k, m)\n'
    assert raw_stream_calls(planted_calls, "workers/x.py") == ["workers/x.py:1 calls xrange",
                                                                "workers/x.py:2 calls xadd"]
