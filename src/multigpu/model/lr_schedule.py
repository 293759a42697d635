"""Learning-rate arithmetic: scaling with the global batch, warm-up, cosine decay."""

import math

__all__ = ["scaled_lr", "warmup_cosine"]


def scaled_lr(base_lr: float, global_batch_size: int) -> float:
    """The linear scaling rule: ``base_lr`` is the rate for 256 images per optimizer step."""
    return base_lr * global_batch_size / 256


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak rate at optimizer step ``step`` (0-based).

    Rises linearly from ``1 / (warmup_steps + 1)`` to 1 over ``warmup_steps`` steps,
    then follows a half cosine down to 0 at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
