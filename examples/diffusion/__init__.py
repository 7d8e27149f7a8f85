"""Diffusion training with FLAME: the denoisers (``models``) and what trains them."""
