"""The data: CIFAR-10's files and the user's images, the training order, the on-device path.

datamodule     CIFAR10DataModule: the LightningDataModule the CLI builds (``--data.*``)
cifar10        the official files read into tensors, the transforms, a synthetic stand-in
sampling       each epoch's order in global batches, resumable on any layout
on_device      whole batches cropped, flipped and normalised on the training device
image_files    the user's own images for ``predict`` (``--data.predict_dir``)
"""

__all__ = ["cifar10", "datamodule", "image_files", "on_device", "sampling"]
