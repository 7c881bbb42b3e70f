"""What a rank keeps between steps, measured from its tensors (the memory tests of the data-
parallel strategies and of FSDP2's compositions)."""


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(trainer) -> dict:
    """Weights / grads / optimizer states this rank keeps between steps, from the tensors."""
    s, opt = trainer.strategy, trainer.optimizer
    if s.sharded_buffers:
        grads = [b.grad_shard if b.keep_shard_only else b.grad_data for b in s.sharded_buffers]
    else:
        grads = [s.grad(p) for p in s.params]
    moments = [v for st in opt.inner.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq")]
    return {"weights": storage_bytes([p for c in trainer.model_chunks for p in c.parameters()]),
            "grads": storage_bytes(grads), "optimizer": storage_bytes(moments)}
