"""``rlbus inference``: an OpenAI-compatible server that follows ``weights``, on the configured backend.

``inference.backend = "transformers"`` runs the built-in server (:mod:`workers.inference.transformers_server`);
``"vllm"`` runs vLLM's server and drives its reloads (:mod:`workers.inference.vllm_launcher`). This module
stays free of torch so ``rlbus inference --help`` is instant.
"""

import argparse
import socket

from workers.config import RlbusConfig
from workers.inference import vllm_launcher


def parse_args(config: RlbusConfig, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlbus inference", description="OpenAI-compatible inference server")
    parser.add_argument("--port", type=int, default=config.inference.port, help="port (default inference.port)")
    parser.add_argument("--host", default=config.inference.host, help="bind address (default inference.host)")
    parser.add_argument("--server-id", default=None,
                        help="id in `served` events (default HOSTNAME:port, unique per host)")
    args = parser.parse_args(argv)
    args.server_id = args.server_id or f"{socket.gethostname()}:{args.port}"
    return args


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus inference @ cfg.toml [--port N] [--host H] [--server-id ID]``."""
    args = parse_args(config, argv)
    if config.inference.backend == "vllm":
        return vllm_launcher.main(config, args)
    from workers.inference import transformers_server  # torch and transformers: only once the args are parsed

    return transformers_server.main(config, args)
