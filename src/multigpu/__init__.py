"""Train ResNet-50 on CIFAR-10 with every way of using several GPUs, from one Lightning CLI."""

from typing import Any

__all__ = ["ImageClassifier", "ImageDataModule"]


def __getattr__(name: str) -> Any:
    # Imported when first asked for: a process that needs one small module (plan's link probe) skips Lightning.
    if name == "ImageDataModule":
        from multigpu.data.datamodule import ImageDataModule

        return ImageDataModule
    if name == "ImageClassifier":
        from multigpu.model.classifier import ImageClassifier

        return ImageClassifier
    if name in ("ResNet50Classifier", "CIFAR10DataModule"):  # renamed: ``renamed_options`` says to what
        from multigpu.renamed_options import RENAMED_CLASSES, renamed_class

        return renamed_class(__name__, name, {RENAMED_CLASSES[name]: __getattr__(RENAMED_CLASSES[name])})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
