"""How many processes train on different samples: what the global batch and throughput count."""

from lightning.pytorch import Trainer

__all__ = ["data_parallel_rank", "data_parallel_size"]


def data_parallel_size(trainer: Trainer) -> int:
    """The number of data-parallel replicas: the world size, unless the strategy says otherwise.

    The processes of one pipeline share their samples, so a pipeline strategy gives
    ``data_parallel_size`` as the world size divided by its processes per pipeline (its stages
    divided by ``stages_per_process``).
    """
    return getattr(trainer.strategy, "data_parallel_size", trainer.world_size)


def data_parallel_rank(trainer: Trainer) -> int:
    """This process's replica, 0 .. ``data_parallel_size - 1``: the shard of the data it reads.

    Consecutive ranks form a replica (the stages of one pipeline, say).
    """
    return trainer.global_rank // (trainer.world_size // data_parallel_size(trainer))
