"""``DistributedSampler``: each rank's share of a dataset's indices, as PyTorch's."""

from __future__ import annotations

import math

from flame.utils.data.sampler import Sampler, torch_randperm


class DistributedSampler(Sampler):
    """``DistributedSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
    drop_last=False)``: rank ``rank`` of ``num_replicas`` gets every ``num_replicas``-th index
    of a permutation that every rank draws alike (seeded by ``seed + epoch``; call
    ``set_epoch`` at the start of each epoch). Without ``drop_last`` the indices are padded
    by repeating the first ones so every rank gets ``ceil(len / num_replicas)``; with it the
    tail is dropped so every rank gets ``floor``. The indices are PyTorch's for the same
    seed and epoch (its CPU ``randperm`` is reproduced), so a run ported from PyTorch visits
    the data in the same order."""

    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            import flame.distributed as dist  # only when the group is asked for

            if num_replicas is None:
                num_replicas = dist.get_world_size()
            if rank is None:
                rank = dist.get_rank()
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        size = len(dataset)
        if drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self):
        size = len(self.dataset)
        if self.shuffle:
            indices = torch_randperm(size, self.seed + self.epoch)
        else:
            indices = list(range(size))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:  # fewer items than ranks: repeat the whole list
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The permutation of the next ``iter`` is seeded by ``seed + epoch``."""
        self.epoch = epoch
