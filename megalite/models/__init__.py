"""Model definitions built from the tensor-parallel transformer blocks."""
