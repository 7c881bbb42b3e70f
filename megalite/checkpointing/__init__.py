"""Checkpoints: sharding rules, model shard files, Hugging Face conversion."""
