"""``rlbus replay --from-run A --to-run B --stream rollouts|batches [--env E] [--start ID] [--end ID]``, or
``rlbus replay --from-archive DIR --to-run B --stream batches`` for steps the trainer archived on disk.

Copies the recorded entries of run A's ``rollouts:{env}`` (or every ``batches:{step}``) into the
same streams of run B, in order, with new entry ids; each copy keeps its original id and run in
the header fields ``orig_id`` and ``orig_run``. Then B's workers consume them as if produced
live: replayed rollouts are filtered, packed and trained; replayed batches go straight to a
trainer (same seed and model ⇒ the same per-step losses as run A).
"""

import argparse
import sys
from pathlib import Path

import redis

from bus.archive import archived_steps, read_step
from bus.clients import sync_client
from bus.config import redact, redis_password
from bus.errors import ConfigError
from bus.keys import Keys
from bus.raw_entries import append_entries, entry_chunks
from bus.resp import as_str
from workers.config import RlbusConfig

CHUNK = 500


def source_streams(client: redis.Redis, src: Keys, family: str, env: str | None) -> list[str]:
    """The streams of run ``src`` to copy, in order (batches by step number)."""
    if family == "rollouts" and env is not None:
        return [src.rollouts(env)] if client.exists(src.rollouts(env)) else []
    found = [as_str(k) for k in client.scan_iter(match=f"{src.prefix}{family}:*", count=1000)]
    found = [k for k in found if client.type(k) == b"stream"]
    if family == "batches":
        return sorted(found, key=lambda k: int(src.suffix(k)))
    return sorted(found)


def copy_stream(client: redis.Redis, src: Keys, dst: Keys, stream: str, start: str, end: str) -> int:
    """Copy the entries of ``stream`` with ids in [start, end] to the same stream of ``dst``; returns the count."""
    target = dst.prefix + stream[len(src.prefix):]
    copied = 0
    for rows in entry_chunks(client, stream, start, end, CHUNK):
        append_entries(client, target, [
            {**{k: v for k, v in fields.items() if k != b"data"}, b"orig_run": src.run, b"orig_id": entry_id,
             b"data": fields[b"data"]}
            for entry_id, fields in rows
        ])
        copied += len(rows)
    return copied


def replay_archive(client: redis.Redis, archive: Path, to_run: str) -> dict[str, int]:
    """Put every archived step of ``archive`` (``output_dir/batches``) into run ``to_run``'s ``batches:{s}``."""
    dst = Keys(to_run)
    copied = {}
    for step, path in archived_steps(archive):
        entries = read_step(path)
        append_entries(client, dst.batches(step), [{**fields, b"orig_archive": str(path)} for fields in entries])
        copied[str(path)] = len(entries)
    return copied


def replay(client: redis.Redis, from_run: str, to_run: str, family: str, env: str | None = None,
           start: str = "-", end: str = "+") -> dict[str, int]:
    """Copy run ``from_run``'s ``family`` streams into run ``to_run``; stream → entries copied."""
    src, dst = Keys(from_run), Keys(to_run)
    if src == dst:
        raise ConfigError(f"--from-run and --to-run are both {from_run!r}; replay into a new run name")
    return {s: copy_stream(client, src, dst, s, start, end) for s in source_streams(client, src, family, env)}


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    """``rlbus replay``: copy recorded rollouts or batches of one run into another run's streams."""
    parser = argparse.ArgumentParser(
        prog="rlbus replay", description="Copy recorded rollouts or batches of one run into another run's streams."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-run", help="run whose entries are copied")
    source.add_argument("--from-archive", type=Path, help="a run's batches archive (output_dir/batches; batches only)")
    parser.add_argument("--to-run", required=True, help="run that receives them")
    parser.add_argument("--stream", required=True, choices=("rollouts", "batches"), help="stream family to copy")
    parser.add_argument("--env", default=None, help="only rollouts:{ENV} (default: every env)")
    parser.add_argument("--start", default="-", help="first entry id to copy (default: the oldest)")
    parser.add_argument("--end", default="+", help="last entry id to copy (default: the newest)")
    parser.add_argument("--redis-url", default=None, help="Redis holding both runs (default: redis.url of the config)")
    args = parser.parse_args(argv)
    url = args.redis_url or (config.redis.url if config is not None else None)
    if not url:
        print("rlbus replay: no Redis given; pass --redis-url redis://HOST:PORT/0", file=sys.stderr)
        return 2
    password = redis_password(config.redis) if config is not None and url == config.redis.url else None
    client = sync_client(url, password=password)
    dst = Keys(args.to_run)
    if args.from_archive is not None:
        if args.stream != "batches":
            raise ConfigError("--from-archive holds batches only; pass --stream batches")
        copied = replay_archive(client, args.from_archive, args.to_run)
        nothing = f"{args.from_archive} holds no step_*.msgpack files"
        target = lambda source: f"{dst.prefix}batches"  # noqa: E731
    else:
        copied = replay(client, args.from_run, args.to_run, args.stream, args.env, args.start, args.end)
        nothing = f"run {args.from_run!r} has no {args.stream} streams in {redact(url)}"
        target = lambda source: dst.prefix + source[len(Keys(args.from_run).prefix):]  # noqa: E731
    if not copied:
        print(f"rlbus replay: {nothing}", file=sys.stderr)
        return 1
    for source, count in copied.items():
        print(f"copied {count} entries {source} → {target(source)}")
    return 0
