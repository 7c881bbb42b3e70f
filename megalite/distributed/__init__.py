"""Data-parallel gradient reduction (and, later, ZeRO / FSDP)."""
