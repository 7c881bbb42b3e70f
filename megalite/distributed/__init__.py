"""Data-parallel gradient reduction and the distributed (ZeRO-1/2) optimizer."""
