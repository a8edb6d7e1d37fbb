"""Start ``rlbus inference`` as a subprocess and wait until ``/health`` answers (tests and benchmarks)."""

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import nullcontext
from pathlib import Path


class InferenceProcess:
    """``rlbus inference @ config --port PORT --server-id ID`` in a child process; a context manager."""

    def __init__(self, config_path: Path | str, port: int, server_id: str | None = None,
                 overrides: list[str] | None = None, log_path: Path | str | None = None, threads: int = 1):
        self.port = port
        self.server_id = server_id or f"127.0.0.1:{port}"
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.cmd = [sys.executable, "-m", "workers.cli", "inference", "@", str(config_path), "--port", str(port),
                    "--server-id", self.server_id, *(overrides or [])]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
                    "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> "InferenceProcess":
        with open(self.log_path, "ab") if self.log_path else nullcontext(subprocess.DEVNULL) as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inference server exited with {self.proc.returncode} before it was ready "
                                   f"(command: {' '.join(self.cmd)}; log: {self.log_path})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"inference server on port {self.port} not healthy within {timeout_s}s (log: {self.log_path})")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "InferenceProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
