"""Trainer checkpoints: model, optimizer, scheduler, RNG states and step, written atomically.

``output_dir/checkpoints/step_{s}/trainer.pt`` holds full (unsharded) state dicts keyed by parameter
name, so a checkpoint written by W ranks resumes on any number of ranks (a LoRA run keeps only the adapter:
the base is ``model.path``). The file and its sha256 (``trainer.pt.sha256``) are written into a temp dir, fsynced
with it, then the dir is renamed into place (:func:`trainer.durable.publish_dir`). ``keep_last`` newest checkpoints
are kept, plus every step that is a multiple of ``keep_interval``.

A checkpoint whose file does not match its sha256 or cannot be read is corrupt: resuming from the latest
(``resume_step = -1``) skips it with a ``checkpoint_corrupt`` log event and takes the newest intact one, so a
damaged newest checkpoint costs the steps since the one before it instead of a trainer that exits on every restart.
"""

import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bus.errors import ConfigError, RlbusError
from bus.log import get_logger
from bus.weight_files import sha256_of
from trainer.config import CkptConfig
from trainer.dist import DistContext, barrier
from trainer.durable import publish_dir

FILE_NAME = "trainer.pt"
DIGEST_NAME = "trainer.pt.sha256"
"""Hex sha256 of ``trainer.pt``, next to it (checkpoints written before it existed have none: read unchecked)."""


class CorruptCheckpoint(RlbusError):
    """A checkpoint file that does not match its sha256 or cannot be read."""


class Checkpointer:
    """Saves, finds, loads and prunes the trainer checkpoints of one run."""

    def __init__(self, output_dir: Path | str, cfg: CkptConfig, ctx: DistContext, trainable_only: bool = False):
        self.root = Path(output_dir) / "checkpoints"
        self.cfg, self.ctx = cfg, ctx
        self.trainable_only = trainable_only
        """Keep only the trainable parameters (a LoRA adapter; the frozen base is ``model.path``)."""
        self.log = get_logger(worker=f"trainer-{ctx.rank}", role="checkpoint")
        self._read_ahead: tuple[int, dict[str, Any]] | None = None
        """The state :meth:`resolve` read while checking a checkpoint, kept for the :meth:`load` that follows."""

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        found = (p for p in self.root.glob("step_*") if (p / FILE_NAME).exists())
        return sorted(int(p.name.removeprefix("step_")) for p in found if p.name.removeprefix("step_").isdigit())

    def resolve(self, resume_step: int | None) -> int | None:
        """The step to resume from: None = fresh start; -1 = the latest (None when there is none)."""
        if resume_step is None:
            return None
        steps = self.steps()
        if resume_step == -1:
            return self._newest_intact(steps)
        if resume_step not in steps:
            raise ConfigError(f"ckpt.resume_step={resume_step} has no checkpoint under {self.root} "
                              f"(found {steps}); use one of them or -1 for the latest")
        return resume_step

    def due(self, step: int) -> bool:
        return self.cfg.interval is not None and step % self.cfg.interval == 0

    def save(self, step: int, policy: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
             run_epoch: str | None = None, progress: dict[str, str] | None = None) -> Path:
        """Write the checkpoint of ``step`` (every rank takes part in gathering; rank 0 writes), stamped with the
        run's epoch (:data:`bus.state.RUN_EPOCH_FIELD`) and its data position (``progress``: the feeder's fields
        of the state hash), so a run restored onto an empty Redis continues where it was."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(policy, optimizer, options=options)
        if self.trainable_only:
            trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
            model_state = {name: t for name, t in model_state.items() if name in trainable}
        final = self.root / f"step_{step}"
        if self.ctx.is_main:
            state = {"step": step, "model": model_state, "optimizer": optim_state,
                     "scheduler": scheduler.state_dict(), "rng": _rng_state(), "run_epoch": run_epoch,
                     "progress": progress}
            tmp = self.root / f".tmp-step_{step}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            torch.save(state, tmp / FILE_NAME)
            (tmp / DIGEST_NAME).write_text(sha256_of(tmp / FILE_NAME))
            publish_dir(tmp, final)
            self.prune()
        barrier(self.ctx)
        return final

    def load(self, step: int, policy: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
             weights_only: bool = False) -> tuple[str | None, dict[str, str] | None]:
        """Restore model and optimizer (and, unless ``weights_only``, scheduler and RNG states) from the checkpoint
        of ``step``; returns the run epoch it was made in and its progress (None for older checkpoints)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self.read(step)
        set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True, strict=not self.trainable_only))
        if not weights_only:
            scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"])
        return state.get("run_epoch"), state.get("progress")

    def read(self, step: int) -> dict[str, Any]:
        """The saved state of ``step``; :class:`CorruptCheckpoint` when it does not match its sha256 or cannot be
        read."""
        if self._read_ahead is not None and self._read_ahead[0] == step:
            state, self._read_ahead = self._read_ahead[1], None
            return state
        path = self.root / f"step_{step}" / FILE_NAME
        digest = path.with_name(DIGEST_NAME)
        if digest.exists() and digest.read_text().strip() != sha256_of(path):
            raise CorruptCheckpoint(f"{path} does not match its sha256 ({digest.name}): it was damaged after saving")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, torn, not a checkpoint: all mean the same here
            raise CorruptCheckpoint(f"{path} cannot be read ({type(e).__name__}: {e})") from e

    def _newest_intact(self, steps: list[int]) -> int | None:
        """The newest step whose checkpoint reads (None: no checkpoint); each corrupt one is logged and skipped."""
        for step in reversed(steps):
            try:
                self._read_ahead = (step, self.read(step))
                return step
            except CorruptCheckpoint as e:
                self.log.error("checkpoint_corrupt", step=step, path=str(self.root / f"step_{step}"), error=str(e),
                               hint="falling back to the checkpoint before it")
        if steps:
            raise RlbusError(f"every checkpoint under {self.root} ({steps}) is corrupt (see checkpoint_corrupt); "
                             "restore one from a backup, or move them away and set ckpt.resume_step to start fresh")
        return None

    def prune(self) -> list[int]:
        """Delete checkpoints beyond ``keep_last``, except multiples of ``keep_interval``."""
        if self.cfg.keep_last is None:
            return []
        steps = self.steps()
        keep = set(steps[-self.cfg.keep_last :])
        if self.cfg.keep_interval:
            keep |= {s for s in steps if s % self.cfg.keep_interval == 0}
        doomed = [s for s in steps if s not in keep]
        for s in doomed:
            shutil.rmtree(self.root / f"step_{s}", ignore_errors=True)
        return doomed


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
