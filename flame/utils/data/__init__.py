"""``flame.utils.data``: what data-parallel training needs of ``torch.utils.data`` so far,
the samplers. FLAME has no ``DataLoader``: index a dataset with the sampler's indices."""

from flame.utils.data.distributed import DistributedSampler
from flame.utils.data.sampler import Sampler

__all__ = ["DistributedSampler", "Sampler"]
