"""Data parallelism: the strategies that own gradients and their reductions (DDP, the
distributed (ZeRO-1/2) optimizer; ``data_parallel``), flat sharded buffers, and replicas."""
