"""`[wandb]` for real (offline): the run's metrics, its config and report.png in a W&B run, continued on resume."""

import json
import struct
from pathlib import Path

import pytest

from tests.workers.run.test_session_e2e import metric_rows, start_run, stdout_of, wait_exit

pytest.importorskip("wandb")


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (a LevelDB-format log: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def history_and_config(out: Path) -> tuple[list[dict], dict, set[str]]:
    rows, config, ids = [], {}, set()
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "run":
                ids.add(record.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
    return rows, config, ids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_offline_wandb_run_holds_the_metrics_once_across_a_resume(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    flags = ("--wandb.project", "rlbus-test", "--eval.interval", "2", "--ckpt.interval", "2")
    assert wait_exit(start_run(out, tiny_model_dir, "--run.max_steps", "3", *flags), out, 150) == 0, stdout_of(out)
    first, _, _ = history_and_config(out)
    assert first
    assert wait_exit(start_run(out, tiny_model_dir, "--run.max_steps", "6", *flags, extra=("--resume",)), out,
                     150) == 0, stdout_of(out)
    rows, config, ids = history_and_config(out)
    assert len(ids) == 1, ids  # one W&B run, continued
    is_report = lambda row: any(k.startswith("report/") for k in row)  # noqa: E731  (an image's fields)
    metrics = [r for r in rows if not is_report(r)]
    assert len(metrics) == len(metric_rows(out))  # every metrics.jsonl row once: none twice after the resume
    trained = [r["step"] for r in metrics if "trainer/loss" in r]  # in order; the resumed trainer redid step 3
    assert trained == [r["step"] for r in metric_rows(out) if r["source"] == "trainer" and "loss" in r], trained
    assert set(trained) == {1, 2, 3, 4, 5, 6}
    assert sum(map(is_report, rows)) == 2  # each session's report.png
    assert config["trainer"]["lr"] == 5e-4 and config["run"]["max_steps"] in (3, 6)
