"""The status panel and the plain status line."""



def test_status_panel_and_plain_line():
    from rich.console import Console

    from workers.run.status import Snapshot, StreamLag, plain_line, render

    snap = Snapshot(trained=3, max_steps=10, served_by={"inference-0": 3}, reward_train=0.25,
                    reward_eval={"e/reward": 0.5}, eval_step=2, gen_tokens_per_s=4200.0, train_tokens_per_s=900.0,
                    step_s=0.4, trainer_idle_s=0.1, counters={"groups_packed": 24, "groups_stale": 2},
                    dead=1, lags=[StreamLag("tasks:e", "rollout", 10, 3, 2)], restarts={"trainer": 1},
                    events=["12:00:00 trainer exited with code -9; restarting in 1s"])
    console = Console(record=True, width=140)
    console.print(render(snap, "rlbus run t"))
    text = console.export_text()
    for shown in ("step 3/10", "0.250", "e/reward 0.500", "4.2k", "24", "2 / 0 / 1", "tasks:e", "trainer×1",
                  "inference-0=3", "restarting in 1s"):
        assert shown in text, shown
    line = plain_line(snap)
    assert line.startswith("step 3/10 ") and "reward=0.250" in line and "tasks:e[rollout]=3+2" in line
