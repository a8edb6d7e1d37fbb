"""Everything that is not the bus or the trainer: the CLI and the config (here), the pipeline stages
(``stages/``), the env servers (``envs/``), the inference servers (``inference/``), the launcher
(``run/``) and the one-shot tools (``tools/``).
"""
