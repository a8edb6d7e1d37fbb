"""rlbus replay: entries copied with their original ids."""



def test_replay_copies_entries_with_original_ids(redis_client, redis_url, run_name):
    from bus.keys import Keys
    from workers.tools.replay import main as replay_main

    src, dst = Keys(run_name), Keys(run_name + "-b")
    ids = {step: [redis_client.xadd(src.batches(step), {"kind": "x", "step": str(step), "data": b"\x00" * 3})
                  for _ in range(2)] for step in (1, 2, 10)}
    redis_client.xadd(src.rollouts("e"), {"kind": "y", "data": b"1"})
    argv = ["--from-run", run_name, "--to-run", run_name + "-b", "--stream", "batches", "--redis-url", redis_url]
    assert replay_main(None, argv) == 0
    for step, originals in ids.items():
        copied = redis_client.xrange(dst.batches(step))
        assert [f[b"orig_id"] for _, f in copied] == originals
        assert all(f[b"orig_run"] == run_name.encode() and f[b"data"] == b"\x00" * 3 for _, f in copied)
        assert list(copied[0][1])[-1] == b"data"  # readable header first, data last
    assert not redis_client.exists(dst.rollouts("e"))
    assert replay_main(None, argv[:4] + ["--stream", "rollouts", "--env", "e", "--redis-url", redis_url]) == 0
    assert redis_client.xlen(dst.rollouts("e")) == 1
