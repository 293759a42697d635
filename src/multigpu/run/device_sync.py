"""Waiting for a device's queued work before a clock is read: the one way every timing of this project (the
blocks' times, ``plan``'s profile, link probe and timed runs, the benchmarks) waits. It imports torch alone, so that
``plan``'s link probe, which imports it, starts without Lightning."""

import torch

__all__ = ["synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read covers it."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
