"""``rlbus export @ cfg.toml [--step S] --out DIR``: one trained step as a Hugging Face model folder.

The step's weights folder (``output_dir/weights/step_S``), or its checkpoint when the weights were pruned. A LoRA
run's step is its adapter, merged into the base model (``model.path``) here, so ``DIR`` loads with plain
``transformers`` (``AutoModelForCausalLM.from_pretrained(DIR)``) and can be the next run's ``model.path``.
"""

import argparse
import shutil
import tempfile
from pathlib import Path

from bus.errors import ConfigError
from workers.config import RlbusConfig


def available_steps(output_dir: Path) -> tuple[set[int], set[int]]:
    """(steps with a weights folder, steps with a checkpoint)."""
    from trainer.checkpoint import FILE_NAME

    def steps(root: Path, marker) -> set[int]:
        found = set()
        for path in root.glob("step_*"):
            suffix = path.name.removeprefix("step_")
            if suffix.isdigit() and marker(path):
                found.add(int(suffix))
        return found

    weights = steps(output_dir / "weights", lambda p: any(p.glob("*.safetensors")))
    return weights, steps(output_dir / "checkpoints", lambda p: (p / FILE_NAME).exists())


def _from_checkpoint(config: RlbusConfig, step: int, scratch: Path) -> Path:
    """A weights folder (adapter or whole model) rebuilt from the checkpoint of ``step`` inside ``scratch``."""
    import torch

    from trainer.checkpoint import FILE_NAME
    from trainer.lora import adapter_tensors, peft_config, save_adapter
    from trainer.weights import save_weights

    state = torch.load(Path(config.run.output_dir) / "checkpoints" / f"step_{step}" / FILE_NAME,
                       map_location="cpu", weights_only=True)["model"]
    state = {name.removeprefix("lm."): tensor for name, tensor in state.items()}
    lora = config.model.lora
    if lora is not None:
        config_ = peft_config(lora.rank, lora.alpha, lora.dropout, lora.target_modules, config.model.path)
        save_adapter(adapter_tensors(state), scratch / "adapter", config_)
        return scratch / "adapter"
    from transformers import AutoConfig

    save_weights(state, scratch / "model", config=AutoConfig.from_pretrained(config.model.path),
                 companions=config.model.path)
    return scratch / "model"


def export(config: RlbusConfig, step: int | None, out: Path) -> tuple[int, str]:
    """Write step ``step`` (None: the newest) to ``out``; (step, where it came from)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.lora import ADAPTER_CONFIG, merged_model

    output_dir = Path(config.run.output_dir)
    weights, checkpoints = available_steps(output_dir)
    if step is None:
        if not weights | checkpoints:
            raise ConfigError(f"{output_dir} has no weights/step_* or checkpoints/step_*; train first, or fix "
                              "run.output_dir")
        step = max(weights | checkpoints)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder")
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as scratch:
        if step in weights:
            source, origin = output_dir / "weights" / f"step_{step}", "weights"
        elif step in checkpoints:
            source, origin = _from_checkpoint(config, step, Path(scratch)), "checkpoint"
        else:
            raise ConfigError(f"--step {step}: no weights/step_{step} or checkpoints/step_{step} under "
                              f"{output_dir}; steps there: {sorted(weights | checkpoints)}")
        if (source / ADAPTER_CONFIG).exists():
            model, origin = merged_model(config.model.path, source), f"{origin} (LoRA adapter merged)"
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source))
        staging = Path(scratch) / "out"
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(config.model.path).save_pretrained(staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        shutil.move(staging, out)
    return step, origin


def main(config: RlbusConfig, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus export", description=__doc__.split("\n")[0])
    parser.add_argument("--step", type=int, help="training step to export (default: the newest there is)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (new or empty)")
    args = parser.parse_args(argv)
    step, origin = export(config, args.step, args.out)
    print(f"exported step={step} from={origin} out={args.out}")
    return 0
