"""Environments: datasets, prompts, rubrics and multi-turn replies, served by ``rlbus env``."""

from workers.envs.base import Environment, RewardFunc, Rubric, last_reply, replies
from workers.envs.registry import BUILTIN, load_env

__all__ = ["BUILTIN", "Environment", "RewardFunc", "Rubric", "last_reply", "load_env", "replies"]
