"""The gloo weight broadcast reaches a receiver in another process."""

import multiprocessing as mp

import torch

from tests.trainer.helpers import tiny_lm

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _receive(fields, queue):
    torch.set_num_threads(1)
    from bus.messages import WeightUpdate
    from trainer.broadcast import receive_weights

    got = receive_weights(WeightUpdate.from_fields(fields), "cpu", timeout_s=60)
    queue.put({k: v.numpy() for k, v in got.items()})  # numpy: plain pickling, no fd sharing


def test_gloo_broadcast_reaches_a_receiver_in_another_process():
    from bus.local_redis import free_port
    from trainer.broadcast import WeightBroadcaster

    state = tiny_lm(seed=4).state_dict()
    sender = WeightBroadcaster("127.0.0.1", free_port(), receivers=1, device=CPU, timeout_s=60)
    spawn_ctx = mp.get_context("spawn")
    for step in (1, 2):
        event = sender.event(step, state)
        assert "lm_head.weight" not in [t.name for t in event.tensors]
        queue = spawn_ctx.Queue()
        proc = spawn_ctx.Process(target=_receive, args=(event.to_fields(), queue))
        proc.start()
        sender.broadcast(event, state)
        got = queue.get(timeout=60)
        proc.join(timeout=30)
        assert set(got) == {t.name for t in event.tensors}
        for name, tensor in got.items():
            assert torch.equal(torch.from_numpy(tensor), state[name])
