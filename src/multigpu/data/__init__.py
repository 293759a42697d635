"""The data: CIFAR-10's and CIFAR-100's files, a folder of labelled images, the user's images, the training order,
the on-device path.

datamodule     ImageDataModule: the LightningDataModule the CLI builds (``--data.*``)
cifar10        CIFAR-10's and CIFAR-100's official files read into tensors, the transforms, a synthetic stand-in
image_folder   a folder of labelled images in ImageNet's layout (``--data.dataset=imagefolder``)
sampling       each epoch's order in global batches, resumable on any layout
on_device      whole batches cropped, flipped and normalised on the training device
image_files    the user's own images for ``predict`` (``--data.predict_dir``)
loader_workers how loader workers start (a fork server), and that they end with their training process
"""

__all__ = ["cifar10", "datamodule", "image_files", "image_folder", "loader_workers", "on_device", "sampling"]
