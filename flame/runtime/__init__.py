"""Everything that talks to the GPU (and its stand-in, the NumPy reference interpreter)."""
