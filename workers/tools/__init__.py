"""One-shot commands: ``rlbus inspect``, ``rlbus replay``, ``rlbus redis`` and ``rlbus init-model``."""
