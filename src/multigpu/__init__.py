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
    from multigpu.renamed_options import renamed_class

    return renamed_class(__name__, name, {new: __getattr__(new) for new in __all__})
