"""Transformer building blocks in Megatron's [sequence, batch, hidden] layout."""
