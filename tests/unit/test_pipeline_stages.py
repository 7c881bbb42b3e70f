"""Layer assignment, model chunks and schedule selection (no process groups needed)."""
import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel import schedules
from megalite.models.stages import build_model_chunks
from megalite.pipeline_parallel.stages import layers_of_stage


def cfg_for(layers=8, pp=4, vpp=None, first=None, last=None, schedule="auto", tied=True):
    return MegaliteConfig(
        model=ModelConfig(num_layers=layers, hidden_size=16, num_attention_heads=2,
                          seq_length=8, vocab_size=40, make_vocab_size_divisible_by=8,
                          untie_embeddings_and_output_weights=not tied),
        parallel=ParallelConfig(pipeline_model_parallel_size=pp,
                                num_virtual_stages_per_pipeline_rank=vpp,
                                decoder_first_pipeline_num_layers=first,
                                decoder_last_pipeline_num_layers=last,
                                pipeline_schedule=schedule),
        world_size=pp)


def test_even_split():
    cfg = cfg_for(8, 4)
    assert [layers_of_stage(cfg, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_interleaved_blocks():
    cfg = cfg_for(8, 2, vpp=2)   # 4 blocks of 2: chunk v of rank r holds block v*p + r
    assert layers_of_stage(cfg, 0, 0) == [0, 1] and layers_of_stage(cfg, 1, 0) == [2, 3]
    assert layers_of_stage(cfg, 0, 1) == [4, 5] and layers_of_stage(cfg, 1, 1) == [6, 7]
    cfg = cfg_for(8, 4, vpp=2)
    assert layers_of_stage(cfg, 3, 0) == [3] and layers_of_stage(cfg, 0, 1) == [4]


def test_uneven_split():
    cfg = cfg_for(10, 4, first=1, last=3)
    assert [layers_of_stage(cfg, r) for r in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    cfg = cfg_for(7, 2, first=2)
    assert [layers_of_stage(cfg, r) for r in range(2)] == [[0, 1], [2, 3, 4, 5, 6]]
    with pytest.raises(ValueError):
        layers_of_stage(cfg_for(9, 4, first=2), 1)   # 7 layers over 3 stages


def _chunks(cfg, pp_rank):
    grid = RankGrid(cfg.world_size, pp=cfg.parallel.pp,
                    vpp=cfg.parallel.virtual_stages(cfg.model.num_layers))
    state = ParallelState.build(grid, grid.groups("pp")[0][pp_rank], create_groups=False)
    return build_model_chunks(cfg, state), state


@pytest.mark.parametrize("vpp", [None, 2])
def test_chunks_pre_post_and_tied_embedding_marks(vpp):
    cfg = cfg_for(8, 2, vpp=vpp)
    first, s0 = _chunks(cfg, 0)
    last, s1 = _chunks(cfg, 1)
    assert s0.virtual_pipeline_rank == 0      # restored after building
    v = vpp or 1
    assert len(first) == len(last) == v
    assert first[0].pre_process and not any(c.pre_process for c in first[1:] + last)
    assert last[-1].post_process and not any(c.post_process for c in first + last[:-1])
    emb = first[0].embedding.word_embeddings.weight
    copy = last[-1].output_layer.weight
    assert first[0].param_table.spec("embedding.word_embeddings.weight").tied == "owner"
    assert last[-1].param_table.spec("output_layer.weight").tied == "copy"
    assert torch.equal(emb, copy)             # same name-seeded init
    names = [n for c in first + last for n, _ in c.canonical_named_parameters()]
    assert names.count("embedding.word_embeddings.weight") == 2


def test_untied_has_no_shared_marks():
    first, _ = _chunks(cfg_for(4, 2, tied=False), 0)
    last, _ = _chunks(cfg_for(4, 2, tied=False), 1)
    assert not any(spec.tied for c in first + last for spec in c.param_table.specs.values())


def test_schedule_selection():
    def pick(cfg):
        grid = RankGrid(cfg.world_size, pp=cfg.parallel.pp,
                        vpp=cfg.parallel.virtual_stages(cfg.model.num_layers))
        state = ParallelState.build(grid, 0, create_groups=False)
        return schedules.get_forward_backward_func(cfg, state)
    assert pick(cfg_for(4, 1)) is schedules.forward_backward_no_pipelining
    assert pick(cfg_for(4, 2)).name == "1f1b"
    assert pick(cfg_for(8, 2, vpp=2)).name == "interleaved"
    assert pick(cfg_for(4, 2, schedule="zero-bubble")).name == "zero-bubble"


def account_cfg(layers, pp, vpp=None, emb=False, loss=False):
    cfg = cfg_for(layers, pp, vpp=vpp)
    cfg.parallel.account_for_embedding_in_pipeline_split = emb
    cfg.parallel.account_for_loss_in_pipeline_split = loss
    return cfg


def table(cfg):
    v = cfg.parallel.virtual_stages(cfg.model.num_layers)
    return [[layers_of_stage(cfg, r, c) for c in range(v)] for r in range(cfg.parallel.pp)]


def test_account_for_embedding_and_loss_split():
    # 6 layers + embedding + loss = 8 slots over PP2 x VPP2: blocks of 2 slots; the
    # embedding takes block 0's first slot, the loss block 3's last (Megatron's offsets).
    assert table(account_cfg(6, 2, 2, emb=True, loss=True)) == [[[0], [3, 4]], [[1, 2], [5]]]
    # Loss only, no interleaving: 7 + 1 = 8 slots over 4 stages.
    assert table(account_cfg(7, 4, loss=True)) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6]]]
    # Embedding only, interleaved: 7 + 1 = 8 slots over PP2 x VPP2.
    assert table(account_cfg(7, 2, 2, emb=True)) == [[[0], [3, 4]], [[1, 2], [5, 6]]]
    # Llama 3 405B: 126 + 2 = 128 slots over PP16 x VPP4 -> 2 per chunk, 1 on the ends.
    cfg = account_cfg(126, 16, 4, emb=True, loss=True)
    t = table(cfg)
    counts = [[len(c) for c in rank] for rank in t]
    assert counts[0] == [1, 2, 2, 2] and counts[-1] == [2, 2, 2, 1]
    assert all(c == [2, 2, 2, 2] for c in counts[1:-1])
    assert sorted(n for rank in t for c in rank for n in c) == list(range(126))
    assert t[1][0] == [1, 2] and t[0][1] == [31, 32]           # block 16 = slots 32-33


def test_account_for_split_chunks_put_embedding_and_loss_on_the_ends():
    cfg = account_cfg(6, 2, 2, emb=True, loss=True)
    first, _ = _chunks(cfg, 0)
    last, _ = _chunks(cfg, 1)
    assert [c.layer_numbers for c in first] == [[0], [3, 4]]
    assert [c.layer_numbers for c in last] == [[1, 2], [5]]
    assert first[0].pre_process and last[-1].post_process
