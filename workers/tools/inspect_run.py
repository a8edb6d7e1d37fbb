"""``rlbus inspect --run NAME``: a run's streams, groups, lag and pending entries; ``--tail N`` decodes entries.

    rlbus inspect --run demo                        # table of every stream of the run
    rlbus inspect --run demo --json                 # the same, for scripts
    rlbus inspect --run demo --tail 3 --stream rollouts:reverse_text
    rlbus inspect --run demo --latency 30           # per-hop latency of the samples of the next 30 s
"""

import argparse
import json
import os
import time
from typing import Any

import msgspec
import numpy as np
import redis

from bus.clients import close_sync_client, sync_client
from bus.config import redact, redis_password
from bus.errors import ConfigError, DecodeError
from bus.keys import Keys
from bus.messages import MicroBatch, decode
from bus.observe import group_streams
from bus.raw_entries import all_entries, newest_entries, stream_report
from bus.resp import as_str
from workers.config import RlbusConfig
from workers.tools.run_follower import RunFollower

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def run_report(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Every stream of the run (sorted by key) and the state hash."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    stream_keys = sorted(
        as_str(k) for k in client.scan_iter(match=keys.pattern(), count=1000, _type="stream")
    )
    state = {as_str(k): as_str(v) for k, v in client.hgetall(keys.state()).items()}
    streams = []
    for key in stream_keys:
        try:
            streams.append({"name": key[len(keys.prefix) :], **stream_report(client, key, now_ms)})
        except redis.ResponseError:  # deleted since the scan (the trainer deletes old batches:{s})
            continue
    return {"run": keys.run, "streams": streams, "state": dict(sorted(state.items()))}


def summarize(value: Any) -> Any:
    """A message as JSON-able data with arrays shortened to dtype, shape and a few values."""
    if isinstance(value, np.ndarray):
        head = value[:6].tolist()
        return {"dtype": value.dtype.name, "shape": list(value.shape), "head": head}
    if isinstance(value, msgspec.Struct):
        return {k: summarize(getattr(value, k)) for k in value.__struct_fields__}
    if isinstance(value, dict):
        return {str(k): summarize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summarize(v) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def tail(client: redis.Redis, keys: Keys, stream: str, count: int) -> dict[str, Any]:
    """The last ``count`` entries of ``stream`` (short name like ``dead`` or a full key), oldest first."""
    key = stream if stream.startswith(keys.prefix) else keys.prefix + stream
    if not client.exists(key):
        raise ConfigError(f"run {keys.run!r} has no stream {stream!r}; `rlbus inspect --run {keys.run}` lists them")
    entries = []
    for entry_id, fields in newest_entries(client, key, count):
        headers = {as_str(k): as_str(v) for k, v in fields.items() if k != b"data"}
        try:
            message: Any = summarize(decode(fields))
        except DecodeError as e:
            message = {"decode_error": str(e)}
        entries.append({"id": entry_id, "headers": headers, "message": message})
    return {"run": keys.run, "stream": key, "entries": entries}


def audit(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """What ``batches:*`` trained, sample by sample (task id, index in its group), and every sample trained twice."""
    steps_of: dict[tuple[str, int], list[int]] = {}
    micro_batches = steps = 0
    for key in client.scan_iter(match=f"{keys.prefix}batches:*", count=1000, _type="stream"):
        steps += 1
        for _, fields in all_entries(client, as_str(key)):
            try:
                mb = decode(fields)
            except DecodeError:
                continue
            if not isinstance(mb, MicroBatch):
                continue
            micro_batches += 1
            for task_id, index in zip(mb.task_ids, mb.sample_indices.tolist(), strict=False):
                if task_id:  # padding samples have none
                    steps_of.setdefault((task_id, index), []).append(mb.step)
    twice = [{"task_id": t, "index": i, "steps": sorted(s)} for (t, i), s in sorted(steps_of.items()) if len(s) > 1]
    return {"run": keys.run, "steps": steps, "micro_batches": micro_batches,
            "samples": sum(len(s) for s in steps_of.values()), "trained_twice": twice}


def latency(client: redis.Redis, keys: Keys, seconds: float) -> dict[str, Any]:
    """Follow the run for ``seconds`` and return, per hop, the count and the mean, p50, p90, p99 and max seconds."""
    envs = sorted({keys.suffix(k) for k in group_streams(client, keys)})
    follower = RunFollower(client, keys.run, envs, keep_values=True)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        follower.poll(block_ms=max(1, int(min(left, 1.0) * 1000)))
    hops = {}
    for hop, hist in follower.latency.hops.items():
        q = hist.quantiles()
        hops[hop] = {"count": hist.count, **({} if q is None else {
            "mean_s": hist.total / hist.count, "p50_s": q[0], "p90_s": q[1], "p99_s": q[2], "max_s": max(hist.values)})}
    return {"run": keys.run, "seconds": seconds, "envs": envs, "hops": hops}


def format_latency(result: dict[str, Any]) -> str:
    lines = [f"run {result['run']}: where a training sample's time went over {result['seconds']:.0f}s "
             f"(envs {', '.join(result['envs']) or 'none'}), seconds",
             f"{'hop':<12} {'count':>6} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}"]
    for hop, row in result["hops"].items():
        cells = [f"{row[k]:>8.3f}" if k in row else f"{'-':>8}" for k in ("mean_s", "p50_s", "p90_s", "p99_s", "max_s")]
        lines.append(f"{hop:<12} {row['count']:>6} " + " ".join(cells))
    return "\n".join(lines)


def format_audit(result: dict[str, Any]) -> str:
    lines = [f"run {result['run']}: {result['samples']} samples in {result['micro_batches']} micro-batches of "
             f"{result['steps']} steps"]
    for row in result["trained_twice"]:
        lines.append(f"trained twice: {row['task_id']} sample {row['index']} at steps "
                     + ", ".join(map(str, row["steps"])))
    if not result["trained_twice"]:
        lines.append("trained twice: none")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """The run report as a plain-text table."""
    lines = [f"run {report['run']}: {len(report['streams'])} streams"]
    header = f"{'stream':<28} {'length':>7} {'group':<10} {'consumers':>9} {'lag':>6} {'pending':>7} {'oldest_s':>9}"
    lines.append(header)
    for s in report["streams"]:
        rows = s["groups"] or [None]
        for i, g in enumerate(rows):
            name, length = (s["name"], str(s["length"])) if i == 0 else ("", "")
            if g is None:
                lines.append(f"{name:<28} {length:>7} {'-':<10}")
                continue
            age = "-" if g["oldest_pending_age_s"] is None else f"{g['oldest_pending_age_s']:.1f}"
            lag = "?" if g["lag"] is None else str(g["lag"])
            lines.append(
                f"{name:<28} {length:>7} {g['name']:<10} {len(g['consumers']):>9} {lag:>6} {g['pending']:>7} {age:>9}"
            )
    if report["state"]:
        lines.append("state: " + ", ".join(f"{k}={v}" for k, v in report["state"].items()))
    return "\n".join(lines)


def format_tail(result: dict[str, Any]) -> str:
    lines = [f"{result['stream']}: last {len(result['entries'])} entries"]
    for entry in result["entries"]:
        lines.append(f"{entry['id']}  " + " ".join(f"{k}={v}" for k, v in entry["headers"].items()))
        lines.append("  " + json.dumps(entry["message"], default=str))
    return "\n".join(lines)


def parse_args(argv: list[str], config: RlbusConfig | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlbus inspect", description="Show a run's streams and entries.")
    parser.add_argument("--run", default=config.run.name if config else None, help="run name (default: run.name)")
    parser.add_argument(
        "--redis-url",
        default=(config.redis.url if config else None) or os.environ.get("RLBUS_REDIS_URL", DEFAULT_URL),
        help=f"Redis URL (default: redis.url, else $RLBUS_REDIS_URL, else {DEFAULT_URL})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--tail", type=int, metavar="N", help="decode the last N entries of --stream")
    parser.add_argument("--stream", help="stream for --tail: short name (dead, rollouts:ENV) or full key")
    parser.add_argument("--latency", type=float, nargs="?", const=10.0, metavar="SECONDS",
                        help="follow the run this long (default 10) and print where a sample's time goes, hop by hop")
    parser.add_argument("--audit", action="store_true",
                        help="check batches:* for samples trained twice (exit 1 when there are any)")
    args = parser.parse_args(argv)
    if args.run is None:
        parser.error("--run NAME is required (or give a config with run.name)")
    if (args.tail is None) != (args.stream is None):
        parser.error("--tail N and --stream NAME go together")
    return args


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    args = parse_args(argv, config)
    keys = Keys(args.run)
    # The config's password (redis.password_var, or the password_file of `rlbus run`'s private Redis) goes with the
    # config's URL only.
    password = redis_password(config.redis) if config is not None and args.redis_url == config.redis.url else None
    client = sync_client(args.redis_url, password=password)
    try:
        client.ping()
    except redis.ConnectionError as e:
        raise ConfigError(f"cannot reach Redis at {redact(args.redis_url)}: {e}; pass --redis-url") from e
    try:
        if args.audit:
            result = audit(client, keys)
            print(json.dumps(result, indent=2) if args.json else format_audit(result))
            return 1 if result["trained_twice"] else 0
        if args.latency is not None:
            result = latency(client, keys, args.latency)
            print(json.dumps(result, indent=2) if args.json else format_latency(result))
            return 0
        if args.tail is not None:
            result = tail(client, keys, args.stream, args.tail)
            print(json.dumps(result, indent=2, default=str) if args.json else format_tail(result))
        else:
            report = run_report(client, keys)
            print(json.dumps(report, indent=2) if args.json else format_report(report))
    finally:
        close_sync_client(client)
    return 0
