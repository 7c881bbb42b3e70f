"""The sharded-state format every owner of state exposes: each tensor as its global shape and
the local chunks this rank holds (``dcp_format``), built from the parameter table
(``sharded_state``).  torch.distributed.checkpoint saves and reshards it; the RNG tracker,
the optimizer and the data-parallel strategies sit above this package, the checkpointer
above them."""
