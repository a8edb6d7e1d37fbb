"""Workers of rlbus: the CLI, feeder, rollout, filter, packer, env servers and inference servers."""
