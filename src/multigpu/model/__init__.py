"""The model: the LightningModule, the network as a sequence of blocks, and what changes how blocks compute.

classifier            ImageClassifier: the loss, the metrics, the optimizer and its schedule (``--model.*``)
recipe                Recipe: the training options (optimizer, schedule, loss) held and checked together
network_options       NetworkOptions: which network (arch, classes, stem, image size), with an old checkpoint's defaults
architectures         any torchvision classifier (``--model.arch``), or the user's network, as a sequence of blocks
resnet                torchvision's ResNet-50 as a flat sequence of blocks (the default network)
lazy_blocks           blocks built one at a time, each where a strategy places it, from its own seed
lr_schedule           the learning rate's scaling, warm-up and cosine decay
recomputation         activations recomputed in the backward pass (``--model.recompute_activations``)
deferred_batch_norm   BatchNorm statistics updated once per mini-batch of micro-batches (the pipeline)
step_batch_norm       BatchNorm statistics of replicas, as one device would make them
replica_statistics    the callback that all-reduces those statistics at each step's end
torchvision_weights   our parameter names against torchvision's (``--model.init_from``, ``export``)
"""

__all__ = [
    "architectures",
    "classifier",
    "deferred_batch_norm",
    "lazy_blocks",
    "lr_schedule",
    "network_options",
    "recipe",
    "recomputation",
    "replica_statistics",
    "resnet",
    "step_batch_norm",
    "torchvision_weights",
]
