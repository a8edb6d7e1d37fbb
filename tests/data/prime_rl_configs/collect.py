"""Rebuild this corpus from a clone of prime-rl: every distinct TOML config (by content) that main's first-parent
history added or changed since 2025-07-01, stored at its first appearance as ``DATE_COMMIT8/PATH``.

    python tests/data/prime_rl_configs/collect.py /path/to/prime-rl [--since 2025-07-01]

``manifest.json`` lists each file (stored path, source path, commit, date) and, for a split orchestrator file, the
trainer and inference files beside it at that commit (``with``), which ``rlbus config convert`` is given together.
"""

import argparse
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROLES = {"trainer": ("train.toml", "trainer.toml"), "inference": ("infer.toml", "inference.toml")}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def first_appearances(repo: Path, since: str) -> list[dict]:
    log = git(repo, "log", "--first-parent", f"--since={since}", "--reverse", "--no-abbrev", "--raw", "--no-renames",
              "--format=C %H %ad", "--date=short", "HEAD", "--", "*.toml")
    seen: dict[str, dict] = {}
    commit = date = ""
    for line in log.splitlines():
        if line.startswith("C "):
            _, commit, date = line.split()
        elif line.startswith(":"):
            meta, path = line.split("\t")
            blob = meta.split()[3]
            if not blob.startswith("0000000") and not path.endswith("pyproject.toml") and blob not in seen:
                seen[blob] = {"blob": blob, "source": path, "commit": commit, "date": date,
                              "file": f"{date}_{commit[:8]}/{path}"}
    return list(seen.values())


def siblings(repo: Path, entry: dict, stored: dict[str, str]) -> dict[str, str]:
    """The trainer and inference files at the same commit: beside a split ``orch.toml``, or in the parallel
    ``configs/trainer/…`` and ``configs/inference/…`` trees of ``configs/orchestrator/…``."""
    path = Path(entry["source"])
    candidates = {role: [path.parent / n for n in names] for role, names in ROLES.items()}
    if "orchestrator" in path.parts[:-1]:
        i = path.parts.index("orchestrator")
        for role in ROLES:
            candidates[role].append(Path(*path.parts[:i], role, *path.parts[i + 1:]))
    found = {}
    for role, paths in candidates.items():
        for p in paths:
            listed = git(repo, "ls-tree", entry["commit"], str(p)).split()
            if listed and listed[2] in stored:
                found[role] = stored[listed[2]]
                break
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", type=Path)
    parser.add_argument("--since", default="2025-07-01")
    args = parser.parse_args()
    entries = first_appearances(args.repo, args.since)
    stored = {e["blob"]: e["file"] for e in entries}
    for entry in entries:
        out = HERE / entry["file"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(subprocess.run(["git", "-C", str(args.repo), "cat-file", "-p", entry["blob"]],
                                       capture_output=True, check=True).stdout)
        if Path(entry["source"]).name in ("orch.toml", "orchestrator.toml") or "orchestrator" in entry["source"]:
            entry["with"] = siblings(args.repo, entry, stored)
    manifest = [{k: e[k] for k in ("file", "source", "commit", "date", "with") if k in e} for e in entries]
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(entries)} files")


if __name__ == "__main__":
    main()
