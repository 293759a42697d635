"""The peak FLOP/s of a device at a run's precision, which MFU divides by.

Dense figures (without 2:4 sparsity) from NVIDIA's datasheets, by device and by what the convolutions and matrix
multiplications run in: bf16 and fp16 (``bf16-mixed``, ``16-mixed``), TF32 (``32-true`` where cuDNN's convolutions
may use it, torch's default, or ``torch.set_float32_matmul_precision`` allows it) and fp32. Lightning's own table
(``get_available_flops``) serves the devices not named here; it does not know the name an H200 gives (``NVIDIA
H200``), and gives the L40 and L40S the L4's figures. None on the CPU.
"""

import re

import torch
from lightning.fabric.utilities.throughput import get_available_flops

__all__ = ["PEAK_TFLOPS", "peak_flops"]

# device: (bf16/fp16, tf32, fp32) TFLOP/s, dense.
PEAK_TFLOPS = {
    "h200 sxm": (989.4, 494.7, 66.9),
    "h200 nvl": (835.5, 417.5, 60.3),
    "h100 sxm": (989.4, 494.7, 66.9),
    "h100 nvl": (835.5, 417.5, 60.3),
    "h100 pcie": (756.5, 378.0, 51.2),
    "a100": (312.0, 156.0, 19.5),
    "l40s": (362.05, 183.0, 91.6),
    "l40": (181.05, 90.5, 90.5),
    "l4": (121.0, 60.0, 30.3),
}


def _chip(device_name: str) -> str | None:
    """The row of ``PEAK_TFLOPS`` for a CUDA device's name (``torch.cuda.get_device_name``), if any."""
    name = device_name.lower()
    for family in ("h200", "h100"):
        if family in name:
            form = "nvl" if "nvl" in name else "pcie" if ("pcie" in name or "hbm2e" in name) else "sxm"
            return f"{family} {form}" if f"{family} {form}" in PEAK_TFLOPS else None
    if "a100" in name:
        return "a100"
    found = re.search(r"\b(l40s|l40|l4)\b", name)
    return found.group(1) if found else None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The peak FLOP/s of ``device`` at Lightning's ``precision`` (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``,
    ...), or None where it is not known (the CPU, a device no table names)."""
    if device.type != "cuda":
        return None
    half = precision.split("-")[0] in ("bf16", "16")
    chip = _chip(torch.cuda.get_device_name(device))
    if chip is None:
        dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0], torch.float32)
        return get_available_flops(device, dtype)
    low, tf32, fp32 = PEAK_TFLOPS[chip]
    if half:
        return low * 1e12
    allows_tf32 = torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return (tf32 if allows_tf32 else fp32) * 1e12
