"""Train ResNet-50 on CIFAR-10 with every way of using several GPUs, from one Lightning CLI."""

from multigpu.data import CIFAR10DataModule
from multigpu.model import ResNet50Classifier

__all__ = ["CIFAR10DataModule", "ResNet50Classifier"]
