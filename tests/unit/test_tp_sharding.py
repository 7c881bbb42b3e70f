"""TP shard/unshard rules shared by init, checkpoints and the converter."""
import pytest
import torch

from megalite.checkpointing.sharding import shard_tensor, unshard_tensors
from megalite.param_spec import ParamSpec, Split


def tp_spec(full_shape, tensor_model_parallel=False, partition_dim=0, partition_blocks=1,
              pad_multiple=None):
    """The TP-only split these tests were written with, as a ``ParamSpec``."""
    if not tensor_model_parallel:
        return ParamSpec(full_shape)
    return ParamSpec.split(full_shape, partition_dim, "tp", partition_blocks, pad_multiple)


def _roundtrip(full, meta, tp):
    shards = [shard_tensor(full, meta, r, tp) for r in range(tp)]
    assert all(s.shape == meta.local_shape({"tp": tp}) for s in shards)
    assert torch.equal(unshard_tensors(shards, meta), full)
    return shards


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_and_replicated_roundtrip(tp):
    full = torch.arange(8 * 12, dtype=torch.float32).view(8, 12)
    col = _roundtrip(full, tp_spec((8, 12), True, 0), tp)
    assert torch.equal(col[tp - 1], full[8 - 8 // tp:])
    row = _roundtrip(full, tp_spec((8, 12), True, 1), tp)
    assert torch.equal(row[0], full[:, :12 // tp])
    rep = _roundtrip(full, tp_spec((8, 12)), tp)
    assert all(torch.equal(r, full) for r in rep)


def test_partition_blocks_give_each_rank_a_piece_of_every_block():
    gate = torch.arange(8.0)[:, None].repeat(1, 3)
    up = 100 + gate
    full = torch.cat([gate, up])                       # fused [gate; up]
    meta = tp_spec((16, 3), True, 0, partition_blocks=2)
    shards = _roundtrip(full, meta, 2)
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    g, u = shards[1].chunk(2)                           # local SwiGLU split stays valid
    assert torch.equal(g, gate[4:]) and torch.equal(u, up[4:])


def test_vocab_padding_depends_on_tp_and_unshards_to_logical_size():
    full = torch.randn(70, 4)
    meta = tp_spec((70, 4), True, 0, 1, pad_multiple=16)
    assert [meta.splits[0].padded_size(70, t) for t in (1, 2, 4)] == [80, 96, 128]
    shards = _roundtrip(full, meta, 4)
    assert shards[3].abs().sum() == 0 and shards[2][6:].abs().sum() == 0   # zero padding rows
    assert torch.equal(shards[2][:6], full[64:])


def test_grouped_qkv_contiguous_chunks_hold_whole_query_groups():
    groups, r, d, h = 4, 2, 3, 5
    # tag each row with its group id
    full = torch.cat([torch.full(((r + 2) * d, h), float(g)) for g in range(groups)])
    meta = tp_spec(tuple(full.shape), True, 0)
    for rank, shard in enumerate(_roundtrip(full, meta, 2)):
        assert set(shard[:, 0].tolist()) == {2.0 * rank, 2.0 * rank + 1}


def test_bad_shapes_are_rejected():
    meta = tp_spec((6, 2), True, 0)
    with pytest.raises(ValueError, match="does not split"):
        meta.local_shape({"tp": 4})
    with pytest.raises(ValueError, match="expected"):
        shard_tensor(torch.zeros(5, 2), meta, 0, 2)


def test_meta_dict_keeps_the_checkpoint_format():
    meta = tp_spec((70, 4), True, 0, 2, 16)
    d = meta.to_meta_dict()       # the keys checkpoint files have always carried
    assert d == {"full_shape": [70, 4], "tensor_model_parallel": True, "partition_dim": 0,
                 "partition_blocks": 2, "pad_multiple": 16}
    assert ParamSpec.from_meta_dict(d) == meta
    assert ParamSpec((3, 2)).to_meta_dict() == {
        "full_shape": [3, 2], "tensor_model_parallel": False, "partition_dim": 0,
        "partition_blocks": 1, "pad_multiple": None}
    expert = ParamSpec((4, 6, 2), (Split(0, "ep"), Split(1, "expert-tp")), expert=True)
    back = ParamSpec.from_meta_dict(expert.to_meta_dict())
    assert back.same_split(expert) and not back.expert   # split only: flags live in the model
    with pytest.raises(ValueError, match="split over"):
        shard_tensor(torch.zeros(4, 6, 2), expert, 0, 2)
