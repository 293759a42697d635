"""Our network's parameter names against torchvision's ``resnet50``: the same tensors, named by block index here
(``5.conv1.weight``) and by layer there (``layer1.2.conv1.weight``).

``to_torchvision`` renames a state dict of ours so that ``torchvision.models.resnet50`` loads it
with ``strict=True`` (with the CIFAR stem, after ``cifar_stem`` has swapped in its first
convolution and taken out the max-pool); ``from_torchvision`` renames the other way, for a run
that starts from torchvision weights (``--model.init_from``).
"""

import pickle
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn

from multigpu.errors import UsageError
from multigpu.model.resnet import LAYERS

__all__ = ["cifar_stem", "from_torchvision", "load_torchvision_weights", "read_state_dict", "to_torchvision"]


def _block_prefixes() -> dict[str, str]:
    """Our module prefix -> torchvision's, for every module that holds tensors."""
    names = {"0.0": "conv1", "0.1": "bn1", "33.2": "fc"}
    block = 1
    for layer, (_, count, _) in enumerate(LAYERS, 1):
        for index in range(count):
            there = f"layer{layer}.{index}"
            names.update({f"{block}.{name}": f"{there}.{name}" for name in ("conv1", "bn1", "conv2", "bn2")})
            names.update(
                {f"{block + 1}.{name}": f"{there}.{name}" for name in ("conv3", "bn3", "downsample.0", "downsample.1")}
            )
            block += 2
    return names


_OURS_TO_TORCHVISION = _block_prefixes()
_TORCHVISION_TO_OURS = {there: here for here, there in _OURS_TO_TORCHVISION.items()}


def _renamed(state_dict: dict[str, Tensor], names: dict[str, str]) -> dict[str, Tensor]:
    renamed = {}
    for key, tensor in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix not in names:
            raise KeyError(f"{key} is not a tensor of ResNet-50")
        renamed[f"{names[prefix]}.{leaf}"] = tensor
    return renamed


def to_torchvision(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our network's state dict (keys ``0.0.weight`` ...) under torchvision's ``resnet50`` names."""
    return _renamed(state_dict, _OURS_TO_TORCHVISION)


def from_torchvision(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A torchvision ``resnet50`` state dict under our network's names."""
    return _renamed(state_dict, _TORCHVISION_TO_OURS)


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The state dict in ``path`` (``--model.init_from``), or a ``UsageError`` that says what the
    file is instead: missing, unreadable, or holding more than tensors (a whole model, say)."""
    if not Path(path).is_file():
        raise UsageError(
            f"--model.init_from={path} is not a file: give the path of a torchvision ResNet-50 state dict."
        )
    try:
        try:  # memory-mapped: the checks made before anything is built read the file's index, not its tensors
            source = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            source = torch.load(path, map_location="cpu", weights_only=True)  # torch's legacy format
    except pickle.UnpicklingError as error:
        if "Unsupported global" in str(error):  # torch's safe loader met something other than tensors
            raise UsageError(
                f"--model.init_from={path} holds more than tensors (a whole model?): save the model's state_dict()."
            ) from None
        raise UsageError(
            f"--model.init_from={path} cannot be read (UnpicklingError: it is truncated or not a PyTorch file): give "
            "a file written by torch.save(torchvision_model.state_dict())."
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        raise UsageError(
            f"--model.init_from={path} cannot be read ({type(error).__name__}: it is truncated or not a PyTorch "
            "file): give a file written by torch.save(torchvision_model.state_dict())."
        ) from None
    if not isinstance(source, dict) or not all(isinstance(value, Tensor) for value in source.values()):
        raise UsageError(f"--model.init_from={path} is not a state dict: save the model's state_dict(), not the model.")
    return source


def load_torchvision_weights(net: nn.Module, path: str | Path) -> str:
    """Copy into ``net`` (our blocks) every tensor of the torchvision ``resnet50`` state dict in ``path`` whose
    shape matches (ImageNet weights into the CIFAR stem leave the first convolution, a head of another width its
    classifier); the tensors of blocks this process does not hold (on the meta device) are skipped. Returns what
    it loaded and what it left at its initial value, in a line."""
    source = read_state_dict(path)
    theirs = {_TORCHVISION_TO_OURS.get(key.rpartition(".")[0]): key for key in source}
    loaded, kept = 0, []
    with torch.no_grad():
        for key, tensor in net.state_dict().items():
            if tensor.is_meta:
                continue
            prefix, _, leaf = key.rpartition(".")
            name = theirs.get(prefix) and f"{_OURS_TO_TORCHVISION[prefix]}.{leaf}"
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
                loaded += 1
            else:
                why = f"{tuple(source[name].shape)} in the file" if name in source else "not in the file"
                kept.append(f"{_OURS_TO_TORCHVISION.get(prefix, prefix)}.{leaf} ({why}, {tuple(tensor.shape)} here)")
    if not loaded:
        raise UsageError(
            f"--model.init_from={path} holds none of ResNet-50's tensors under torchvision's names: give the state "
            "dict of torchvision.models.resnet50."
        )
    left = f"; left at their initial values: {', '.join(kept)}" if kept else "; nothing left at its initial value"
    return f"init_from {path}: loaded {loaded} tensors{left}."


def cifar_stem(model: nn.Module) -> nn.Module:
    """Make torchvision's ``resnet50`` take our CIFAR stem: a 3x3 stride-1 first convolution, no max-pool."""
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
