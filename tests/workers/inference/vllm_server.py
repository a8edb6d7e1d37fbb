"""One vLLM server (``rlbus inference`` with ``inference.backend = "vllm"``) for a test module: the run name, the
config and the process, started once (~40 s on CPU) and stopped at the end."""

import time
from contextlib import contextmanager
from pathlib import Path

from bus.local_redis import free_port
from tests.workers.inference.process import InferenceProcess


def run_name(prefix: str) -> str:
    """A run name no other module uses."""
    return f"{prefix}-{int(time.time() * 1000) % 10**8}"


@contextmanager
def vllm_server(out_dir: Path, server_id: str, config_text: str, inference: str = ""):
    """Write ``config_text`` (plus the vLLM [inference] section, with the lines ``inference``) to
    ``out_dir/cfg.toml`` and serve it."""
    config = out_dir / "cfg.toml"
    config.write_text(config_text + '[inference]\nbackend = "vllm"\nnum_threads = 1\nmax_model_len = 512\n'
                                    'max_batch_size = 16\n' + inference)
    proc = InferenceProcess(config, free_port(), server_id, log_path=out_dir / "vllm.log")
    start = time.monotonic()
    proc.start(timeout_s=300)  # not `with proc.start()`: entering the context would start a second server
    try:
        print(f"\nvllm_startup_s={time.monotonic() - start:.1f}")
        yield proc
    finally:
        proc.stop(timeout_s=60)
