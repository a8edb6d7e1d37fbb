"""metrics.jsonl across sessions of one run: the earlier rows stay (the stream may have trimmed them), a torn last
line goes, and the next session reads the stream after the file's last entry."""


from bus.messages import Metric
from workers.run.metrics import MetricsWriter, read_rows


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
