"""Train ResNet-50 on CIFAR-10 with every way of using several GPUs, from one Lightning CLI."""

from typing import Any

__all__ = ["CIFAR10DataModule", "ResNet50Classifier"]


def __getattr__(name: str) -> Any:
    # Imported when first asked for: a process that needs one small module (plan's link probe) skips Lightning.
    if name == "CIFAR10DataModule":
        from multigpu.data.datamodule import CIFAR10DataModule

        return CIFAR10DataModule
    if name == "ResNet50Classifier":
        from multigpu.model.classifier import ResNet50Classifier

        return ResNet50Classifier
    raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
