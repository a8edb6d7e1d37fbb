"""metrics.jsonl across sessions of one run: the earlier rows stay (the stream may have trimmed them), a torn last
line goes, and the next session reads the stream after the file's last entry."""

import json

from bus.messages import Metric
from workers.config import RlbusConfig
from workers.run.metrics import MetricsWriter, read_rows, wandb_config


def test_a_resumed_writer_keeps_the_earlier_rows_and_goes_on_after_the_last(tmp_path):
    first = MetricsWriter(tmp_path, "r")
    assert first.last_id == "0" and first.rows == []
    first.write("100-0", Metric(source="trainer", step=1, values={"loss": 1.0}))
    first.write("200-0", Metric(source="trainer", step=2, values={"loss": 0.5}))
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"id": "300-0", "sour')  # the run was killed mid-write
    again = MetricsWriter(tmp_path, "r")
    assert again.last_id == "200-0" and [r["step"] for r in again.rows] == [1, 2]
    again.write("250-0", Metric(source="trainer", step=3, values={"loss": 0.25}))
    again.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["id"] for r in rows] == ["100-0", "200-0", "250-0"]


def test_the_config_sent_to_wandb_holds_no_env_args_and_no_redis_password():
    """Env args may hold secrets (a remote env's API key), and so may a Redis URL: W&B gets neither."""
    config = RlbusConfig.model_validate({
        "redis": {"url": "redis://:hunter2@host:6379/0?password=hunter2"},
        "env": [{"id": "reverse_text", "args": {"api_key": "sk-secret"}}],
        "eval": {"env": [{"id": "reverse_text", "args": {"api_key": "sk-secret"}}]},
    })
    shown = json.dumps(wandb_config(config))
    assert "sk-secret" not in shown and "hunter2" not in shown
    assert '"id": "reverse_text"' in shown
