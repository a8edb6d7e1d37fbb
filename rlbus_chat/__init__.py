"""``rlbus-chat``: a verifiers v1 harness that plays a chat seat in-process (no program per episode).

verifiers' ``null`` harness starts a fresh Python program per episode (``uv run`` of a PEP 723 script: a package
index or a wheel cache, and seconds of start-up each). This harness runs the same tool-less chat loop inside the env
server: every model call still goes to the episode's interception ``endpoint`` with its bearer ``secret`` (the
contract :meth:`verifiers.v1.Harness.launch` documents), so the trace records the same turns, token ids and
logprobs; only the process start is gone. Select it per env: ``agent = { harness = { id = "rlbus-chat" } }``.

A top-level package because verifiers resolves a harness id by importing the package of that name.
"""

import httpx
from verifiers.v1 import Harness, HarnessConfig
from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

__all__ = ["InProcessChatHarness"]


class InProcessChatConfig(HarnessConfig):
    """The ``rlbus-chat`` harness's knobs (those every harness has)."""


class InProcessChatHarness(Harness[InProcessChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData) -> ProgramResult:
        """One chat completion through the interception endpoint: the seat's reply to the conversation so far."""
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with httpx.AsyncClient(timeout=None) as http:
            reply = await http.post(f"{endpoint.rstrip('/')}/chat/completions",
                                    headers={"Authorization": f"Bearer {secret}"},
                                    json={"model": ctx.model, "messages": messages})
        if reply.status_code != 200:
            return ProgramResult(exit_code=1, stdout="", stderr=f"chat completion failed ({reply.status_code}): "
                                 f"{reply.text[-2000:]}")
        return ProgramResult(exit_code=0, stdout="", stderr="")
