"""Weights on disk: Hugging Face safetensors shards + index, written atomically, loaded in place.

``save_weights`` writes ``model-0000i-of-0000n.safetensors`` (each at most ``max_shard_mb``),
``model.safetensors.index.json``, ``config.json`` and a manifest of every shard's size and sha256
(``rlbus-files.json``) into a temp dir next to the target, fsyncs it, then renames it, so a reader never sees a
half-written update, not even after a power cut. A folder re-published after a restart is first checked against
its manifest (:func:`verified_weights`): a damaged one is rewritten, never published with the hashes of its damage.
Tied weights are stored once (as Hugging Face does); ``load_weights_into`` re-ties them. On GPU the tensors go
device-to-host through pinned buffers kept between steps (:class:`HostCopy`).
"""

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from bus.messages import WeightFile
from bus.weight_files import sha256_of, verify_weights, weights_root
from trainer.durable import publish_dir

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "rlbus-files.json"
"""Each shard's name, size and sha256, as measured when it was written."""


def weights_dir(output_dir: Path | str, step: int) -> Path:
    """``output_dir/weights/step_{step}``."""
    return weights_root(output_dir) / f"step_{step}"


class HostCopy:
    """Device-to-host copies of a state dict into CPU buffers reused across calls (pinned for GPU tensors); CPU
    tensors are passed through unless ``snapshot``, which copies them too (a copy the next optimizer step, changing
    the parameters in place, leaves alone)."""

    def __init__(self, snapshot: bool = False) -> None:
        self.snapshot = snapshot
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, tensor in state.items():
            tensor = tensor.detach()
            on_gpu = tensor.device.type != "cpu"
            if not on_gpu and not self.snapshot:
                out[name] = tensor
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
            buf.copy_(tensor, non_blocking=on_gpu)
            out[name] = buf
        if any(t.device.type == "cuda" for t in state.values()):
            torch.cuda.synchronize()
        return out


def unique_tensors(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop later names of tensors sharing storage (tied embeddings: keep ``embed_tokens``, drop ``lm_head``)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape))
        if tensor.device.type != "meta" and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def nonfinite_tensors(state: Mapping[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf. One fused norm over all of them first (0.2 ms
    for the default's model where a check per tensor took 1.6): a norm is finite when every value is, unless huge
    finite values overflow it, so the check per tensor runs only when one is not."""
    floats = {name: tensor for name, tensor in state.items() if tensor.is_floating_point()}
    if not floats:
        return []
    norms = torch.stack([norm.float() for norm in torch._foreach_norm(list(floats.values()))])
    if bool(norms.isfinite().all()):
        return []
    return [name for name, tensor in floats.items() if not tensor.isfinite().all()]


COMPANION_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template*", "generation_config.json")
"""Files of the model folder that make a weights directory a whole Hugging Face folder (tokenizer, template)."""


def save_weights(
    model: nn.Module | Mapping[str, Tensor], dir: Path | str, max_shard_mb: float = 1024,
    host_copy: HostCopy | None = None, config: object | None = None, companions: Path | str | None = None,
) -> list[WeightFile]:
    """Write the model's (or a state dict's) weights as HF safetensors shards to ``dir`` atomically; with
    ``companions`` (the model folder), also its tokenizer files, so ``dir`` loads as a model of its own (the next
    stage's ``model.path``)."""
    if isinstance(model, nn.Module):
        config = config or getattr(model, "config", None)
        model = model.state_dict()
    tensors = (host_copy or HostCopy())(unique_tensors(model))
    return [WeightFile(name=n, bytes=b, sha256=h)
            for n, b, h in write_shards(tensors, dir, max_shard_mb, config, companions)]


def link_companions(source: Path, dir: Path) -> None:
    """Hard-link (else copy) the tokenizer files of ``source`` into ``dir``."""
    for pattern in COMPANION_FILES:
        for path in source.glob(pattern):
            if path.is_file():
                try:
                    os.link(path, dir / path.name)
                except OSError:
                    shutil.copy2(path, dir / path.name)


def write_shards(
    tensors: Mapping[str, Tensor], dir: Path | str, max_shard_mb: float, config: object | None = None,
    companions: Path | str | None = None,
) -> list[tuple[str, int, str]]:
    """Write host tensors as shards + index (+ config.json, + the companions' tokenizer files) into a temp dir,
    rename it to ``dir``; (name, bytes, sha256)."""
    dir = Path(dir)
    shards = _plan_shards(tensors, int(max_shard_mb * 2**20))
    tmp = dir.parent / f".tmp-{dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    weight_map, digests = {}, []
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashing (GIL released) overlaps the next shard's write
        for i, names in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
            save_file({n: tensors[n].contiguous() for n in names}, str(tmp / name), metadata={"format": "pt"})
            digests.append((name, pool.submit(sha256_of, tmp / name)))
            weight_map.update(dict.fromkeys(names, name))
        files = [(name, (tmp / name).stat().st_size, d.result()) for name, d in digests]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(tmp / "config.json")
    if companions is not None and Path(companions).is_dir():
        link_companions(Path(companions), tmp)
    write_manifest(tmp, [WeightFile(name=n, bytes=b, sha256=h) for n, b, h in files])
    publish_dir(tmp, dir)
    return files


def write_manifest(dir: Path, files: list[WeightFile]) -> None:
    """Record each file's size and sha256 as written, for :func:`verified_weights`."""
    manifest = [{"name": f.name, "bytes": f.bytes, "sha256": f.sha256} for f in files]
    (dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def remove_interrupted_saves(root: Path | str) -> list[Path]:
    """Delete the ``.tmp-*`` directories a save killed midway left under ``root`` (weights or checkpoints); the
    finished ones are renamed into place, so a ``.tmp-`` directory is never read. Returns what was removed."""
    root = Path(root)
    removed = sorted(p for p in root.glob(".tmp-*") if p.is_dir()) if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _plan_shards(tensors: Mapping[str, Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def read_weights(dir: Path | str, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Every tensor of a weights directory (index json or a single ``model.safetensors``)."""
    dir = Path(dir)
    index = dir / INDEX_NAME
    names = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    tensors: dict[str, Tensor] = {}
    for name in names:
        tensors.update(load_file(dir / name, device=str(device)))
    return tensors


def load_tensors_into(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the model's parameters/buffers in place (all or none: every name and shape is checked
    first); a tied head may be absent."""
    params = model.state_dict(keep_vars=True)
    missing = set(params) - set(tensors)
    tied = {name for name in missing if _is_tied(model, name)}
    if missing - tied:
        raise ValueError(f"weights are missing {sorted(missing - tied)[:5]} (of {len(missing - tied)}); "
                         "they were saved from a different model architecture")
    unknown = set(tensors) - set(params)
    if unknown:
        raise ValueError(f"weights hold tensors the model does not have: {sorted(unknown)[:5]}")
    wrong = [name for name, tensor in tensors.items() if params[name].shape != tensor.shape]
    if wrong:  # checked before any copy: a refused update leaves the model as it was
        name = wrong[0]
        raise ValueError(f"{name}: weights shape {tuple(tensors[name].shape)} != model shape "
                         f"{tuple(params[name].shape)} ({len(wrong)} tensors differ)")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor, non_blocking=True)


def _is_tied(model: nn.Module, name: str) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return head is not None and emb is not None and head.weight is emb.weight and name.endswith("lm_head.weight")


def load_weights_into(model: nn.Module, dir: Path | str) -> None:
    """Load a weights directory written by :func:`save_weights` (or any HF safetensors folder) into ``model``."""
    device = next(model.parameters()).device
    load_tensors_into(model, read_weights(dir, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prune_weights(output_dir: Path | str, keep: int, protected: set[int]) -> list[int]:
    """Delete ``step_*`` weight dirs beyond the newest ``keep``, never one in ``protected`` (served, eval hold)."""
    root = Path(output_dir) / "weights"
    steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                   if p.name.removeprefix("step_").isdigit())
    doomed = [s for s in steps[:-keep] if s not in protected] if len(steps) > keep else []
    for s in doomed:
        shutil.rmtree(root / f"step_{s}", ignore_errors=True)
    return doomed


def verified_weights(dir: Path | str) -> list[WeightFile]:
    """The WeightFile list of a folder :func:`save_weights` wrote, after checking every shard against the manifest
    written with it; ValueError when a shard differs or the manifest is missing (rewrite the folder then)."""
    manifest = Path(dir) / MANIFEST_NAME
    if not manifest.exists():
        raise ValueError(f"{dir} has no {MANIFEST_NAME}: its shards cannot be checked")
    files = [WeightFile(name=f["name"], bytes=f["bytes"], sha256=f["sha256"]) for f in json.loads(manifest.read_text())]
    verify_weights(dir, files)
    return files


def describe_weights(dir: Path | str) -> list[WeightFile]:
    """The WeightFile list (size, sha256) of any weights directory as it is now (a model folder made elsewhere; for
    a folder this run wrote, :func:`verified_weights` checks it first)."""
    dir = Path(dir)
    files = []
    for path in sorted(dir.glob("*.safetensors")):
        files.append(WeightFile(name=path.name, bytes=path.stat().st_size, sha256=sha256_of(path)))
    return files
