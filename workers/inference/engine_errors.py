"""What the engine raises to the server, which turns each into an HTTP status (see :mod:`transformers_server`)."""


class BadRequest(ValueError):
    """A request the engine cannot serve as asked; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloaded(Exception):
    """The queue holds ``max_queued`` sequences already; retry later."""


class EngineStopped(RuntimeError):
    """The engine thread has ended (stopped, or failed :data:`FAILURES_IN_A_ROW` times)."""


class EngineStepFailed(RuntimeError):
    """The step that held this request failed; the batch was dropped (retrying may succeed)."""
