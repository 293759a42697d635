"""The trained network out of a Lightning checkpoint, for code that knows torchvision but not this project: what
``python main.py export`` writes (its options: ``multigpu.cli.export_command``).

    python main.py export --ckpt_path last --to=torchvision --out=resnet50.pt
    python main.py export --config configs/subset.yaml --ckpt_path last --to=torchscript
    python main.py export --ckpt_path last --to=onnx --out=resnet50.onnx      # needs the onnx package

It takes ``fit``'s options, so that ``--ckpt_path last`` finds the run's newest checkpoint
(``--run_name``, ``--checkpoint_root``). The network goes into torchvision's own
``resnet50(num_classes=...)`` (its first convolution swapped for the 3x3 CIFAR stem and the
max-pool taken out, when the run used that stem), and is written as

- ``torchvision``: its state dict, which torchvision's ``resnet50`` loads with ``strict=True``;
- ``torchscript``: ``torch.jit.script`` of that model, which ``torch.jit.load`` runs without this project;
- ``onnx``: ``torch.onnx.export`` of it, any batch size, which onnxruntime runs.

Before it says done, it compares the export's logits with the checkpoint's network on a batch of
images, within ``TOLERANCE`` of their size (float32's rounding; the ONNX file only where
onnxruntime is installed, whose fused kernels round differently).
"""

from pathlib import Path
from typing import Any, Literal

import torch
import torchvision
from torch import nn

from multigpu.checkpointing.resume import ResumePoint
from multigpu.data.cifar import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.data_options import DataOptions
from multigpu.errors import UsageError
from multigpu.model.architectures import DEFAULT_ARCH, NetworkBlocks
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.model.network_options import NetworkOptions
from multigpu.model.torchvision_weights import cifar_stem, to_torchvision

__all__ = [
    "SUFFIXES",
    "TOLERANCE",
    "Format",
    "input_line",
    "input_notes",
    "network_of",
    "torchvision_load_lines",
    "torchvision_model",
    "write_export",
]

TOLERANCE = 1e-5
Format = Literal["torchvision", "torchscript", "onnx"]
SUFFIXES = {"torchvision": ".pt", "torchscript": ".torchscript.pt", "onnx": ".onnx"}


def _cut_blocks(options: NetworkOptions) -> NetworkBlocks:
    """The blocks of a network other than ResNet-50: cut from one torchvision (or the user's) network."""
    blocks = options.blocks(seed=0)
    assert isinstance(blocks, NetworkBlocks)
    return blocks


def network_of(checkpoint: dict) -> nn.Sequential:
    """The checkpoint's network (our blocks), on the CPU, in evaluation mode."""
    net = LazyBlocks(NetworkOptions.saved_in(checkpoint).blocks(seed=0))
    net.materialize()
    state = {key[len("net.") :]: value for key, value in checkpoint["state_dict"].items() if key.startswith("net.")}
    net.load_state_dict(state, strict=True)
    return net.eval()


def torchvision_model(checkpoint: dict, network: nn.Module | None = None) -> nn.Module:
    """torchvision's network (``resnet50``, or the run's ``--model.arch``) holding the checkpoint's weights (those
    of ``network``, its network once built), in evaluation mode."""
    options = NetworkOptions.saved_in(checkpoint)
    network = network if network is not None else network_of(checkpoint)
    if options.arch != DEFAULT_ARCH:
        return _cut_blocks(options).network_with(network.state_dict())
    model = torchvision.models.resnet50(num_classes=options.num_classes)
    if options.stem == "cifar":
        cifar_stem(model)
    model.load_state_dict(to_torchvision(network.state_dict()), strict=True)
    return model.eval()


def write_export(checkpoint: dict, to: Format, out: Path) -> str:
    """Write the checkpoint's network to ``out`` in format ``to``, and check the file's logits against the
    checkpoint's network: what the check found, or a ``UsageError`` where the logits differ."""
    network = network_of(checkpoint)  # built once: the export's source and the logits it must give
    model = torchvision_model(checkpoint, network)
    shape = NetworkOptions.saved_in(checkpoint).image_shape
    images = torch.randn(8, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = network(images)
        if to == "torchvision":
            torch.save(model.state_dict(), out)
            got = model(images)
        elif to == "torchscript":
            torch.jit.script(model).save(str(out))
            got = torch.jit.load(str(out))(images)
        else:
            got = _export_onnx(model, images, out)
    if got is None:
        return "not run here: pip install onnxruntime to check it"
    if not torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE, equal_nan=True):
        raise UsageError(
            f"{out}: the export's logits differ from the checkpoint's by {(got - expected).abs().max():g}."
        )
    return f"its logits match the checkpoint's within {TOLERANCE:g} (relative) on {len(images)} images"


def input_notes(checkpoint: dict) -> dict[str, Any]:
    """What the exported network expects of its input, and what its outputs mean: written beside the export (the
    data's mean, std and class names as the run saved them; CIFAR-10's in a checkpoint from before)."""
    options = NetworkOptions.saved_in(checkpoint)
    classes = options.num_classes
    data = ResumePoint.of(checkpoint).data
    saved = DataOptions.of(data)  # the mean and std the run normalised with
    names = data.get("classes") or (list(CIFAR10_CLASSES) if classes == len(CIFAR10_CLASSES) else list(range(classes)))
    return {
        "shape": ["batch", *options.image_shape],
        "layout": "NCHW: channels first",
        "channels": "RGB",
        "dtype": "float32",
        "scale": "pixel values divided by 255, in [0, 1]",
        "normalise": "(x - mean) / std, per channel",
        "mean": list(saved.mean or CIFAR10_MEAN),
        "std": list(saved.std or CIFAR10_STD),
        "output": "logits, one per class; softmax gives the probabilities",
        "classes": names,
    }


def input_line(notes: dict[str, Any]) -> str:
    """``input_notes`` in one line."""
    mean, std = (", ".join(f"{value:.4f}" for value in notes[key]) for key in ("mean", "std"))
    return (
        f"input: float32 batches of {' x '.join(map(str, notes['shape'][1:]))} images, {notes['channels']}, channels "
        f"first, pixel values / 255 normalised with mean ({mean}) and std ({std}); output: {len(notes['classes'])} "
        "logits."
    )


def torchvision_load_lines(checkpoint: dict, out: Path) -> str:
    """The lines of Python that load a ``torchvision`` export at ``out`` into the run's torchvision network."""
    options = NetworkOptions.saved_in(checkpoint)
    arch, classes = options.arch, options.num_classes
    stem = "model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)\n    model.maxpool = torch.nn.Identity()\n"
    resnet = arch == DEFAULT_ARCH or _cut_blocks(options).is_resnet
    if "." in arch:  # the user's own network
        build = f"{arch}(num_classes={classes})"
    else:
        size = f", image_size={options.image_size}" if arch.startswith("vit_") else ""
        build = f"torchvision.models.get_model({arch!r}, num_classes={classes}{size})"
    return (
        f"    model = {build}\n"
        + (f"    {stem}" if resnet and options.stem == "cifar" else "")
        + f"    model.load_state_dict(torch.load({str(out)!r}))"
    )


def _export_onnx(model: nn.Module, images: torch.Tensor, out: Path) -> torch.Tensor | None:
    """Write the ONNX file; its logits from onnxruntime, or None without it."""
    try:
        torch.onnx.export(
            model,
            (images,),
            str(out),
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            verbose=False,  # its 8 progress lines, each "... ✅", say nothing a user can act on
        )
    except ImportError as error:  # torch's exporter needs the onnx package (and onnxscript)
        raise UsageError(
            f"--to=onnx needs {error.name or 'the onnx packages'}: pip install onnx onnxscript."
        ) from error
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
