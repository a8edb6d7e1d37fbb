"""The trainer: model loading, chunked logprobs, losses by training mode, the optimizer step,
weight publishing (safetensors shards or an nccl/gloo broadcast), checkpoints and data parallelism.

``rlbus trainer`` runs :func:`trainer.worker.main`. Importing this package imports no torch.
"""
