"""The data: CIFAR-10's and CIFAR-100's files, a folder of labelled images, the user's images, the training order,
the on-device path.

datamodule     ImageDataModule: the LightningDataModule the CLI builds (``--data.*``): loaders, sharding, its order
data_options   DataOptions: its options, read once and handed inward
source         what a source of images says and makes (``ImageSource``); one per kind:
cifar            CifarFiles: CIFAR-10's and CIFAR-100's official files read into tensors
image_folder     ImageFolderSource: a folder of labelled images in ImageNet's layout (``--data.dataset=imagefolder``)
synthetic        SyntheticImages: random images of CIFAR's shape (``--data.synthetic``)
sampling       each epoch's order in global batches, resumable on any layout; where a run starts (TrainingOrder)
transforms     what every source does to its images (augmentation, normalisation); images in memory
on_device      whole batches cropped, flipped and normalised on the training device
image_files    the user's own images for ``predict`` (``--data.predict_dir``)
loader_workers how loader workers start (a fork server), and that they end with their training process
"""

__all__ = [
    "cifar",
    "data_options",
    "datamodule",
    "image_files",
    "image_folder",
    "loader_workers",
    "on_device",
    "sampling",
    "source",
    "synthetic",
    "transforms",
]
