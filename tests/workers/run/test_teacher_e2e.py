"""An sft run whose teacher is a chat-only endpoint (a stand-in for a hosted model): sampled with chat completions,
no logprobs asked, its own API key and model name; the student learns what it answers."""

import asyncio
import threading

import pytest
from aiohttp import web

from bus.local_redis import free_port
from tests.workers.run.test_session_e2e import start_run, stdout_of, summary, wait_exit


class ChatOnlyTeacher:
    """Serves ``/v1/models`` and ``/v1/chat/completions`` only: every answer is the user's text reversed."""

    def __init__(self):
        self.port = free_port()
        self.requests: list[tuple[str, dict]] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "ChatOnlyTeacher":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.headers.get("Authorization", ""), body))
        text = body["messages"][-1]["content"][::-1]
        return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            for i in range(body.get("n", 1))]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "not-this-one", "object": "model"}]})

    def _serve(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            app = web.Application()
            app.add_routes([web.post("/v1/chat/completions", self.chat), web.get("/v1/models", self.models)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        asyncio.run(main())  # closes its loop (and the loop's self-pipe) when the server stops


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_learns_from_a_chat_only_teacher_with_its_own_key(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "teacher-secret")
    monkeypatch.setenv("STUDENT_KEY", "student-secret")
    words = '{min_words = 1, max_words = 1}'
    with ChatOnlyTeacher() as teacher:
        out = tmp_path / "sft"
        proc = start_run(
            out, tiny_model_dir, "--run.max_steps", "60", "--eval.interval", "30",
            "--env.0.id", "reverse_text", "--env.0.args", words, "--env.0.mode", "sft", "--env.0.group_size", "1",
            "--teacher.base_urls", f'["http://127.0.0.1:{teacher.port}/v1"]', "--teacher.api", "chat",
            "--teacher.model", "hosted-teacher", "--teacher.api_key_var", "TEACHER_KEY",
            "--inference.api_key_var", "STUDENT_KEY", "--sampling.max_completion_tokens", "8",
            "--eval.env.0.id", "reverse_text", "--eval.env.0.name", "held_out",
            "--eval.env.0.args", '{min_words = 1, max_words = 1, num_examples = 64, seed = 1}',
            "--eval.sampling.max_completion_tokens", "8", "--trainer.lr", "1e-3")
        assert wait_exit(proc, out, 240) == 0, stdout_of(out)[-4000:]
    evals = {int(k): v["eval/held_out/reward"] for k, v in summary(out)["eval"].items()}
    assert evals[0] < 0.35 and evals[60] > 0.8, evals  # lcs of a random-init answer ≈ 0.1–0.3
    assert teacher.requests and all(auth == "Bearer teacher-secret" for auth, _ in teacher.requests)
    sent = teacher.requests[0][1]
    assert sent["model"] == "hosted-teacher" and "logprobs" not in sent and "prompt_logprobs" not in sent
    assert sent["max_completion_tokens"] == 8 and not {"top_k", "min_p", "return_token_ids"} & set(sent)
