"""Every derived config value that some reader uses, asserted at a setting where it differs
from the naive value (a formula checked only where it is trivial passes when it is wrong):
the data-parallel size with CP and PP, the micro-batch count of the *fitted* world when
ranks wait as spares (evaluation, the dry-run banner and the elastic line read it), the
padded vocabulary at TP > 1, the batch ramp's micro-batches, and the model's resolved
sizes (kv channels, query groups, FFN, experts, MTP layers, MoE layer pattern)."""
from megalite.cli.arguments import parse_args
from megalite.config import ModelConfig, ParallelConfig
from megalite.config.microbatches import BatchSizeSchedule
from megalite.cli import elastic_fit
from megalite.training.entry import describe_batch

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "100", "--train-iters", "1",
        "--lr", "1e-4", "--attention-dropout", "0"]


def _cfg(world, *flags):
    return parse_args([*TINY, "--world-size", str(world), *flags])


def test_data_parallel_size_divides_out_tp_cp_and_pp():
    cfg = _cfg(16, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
               "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
               "--global-batch-size", "16")
    assert cfg.data_parallel_size == 2                  # not 16 / TP = 8
    assert cfg.num_micro_batches == 4                   # 16 / (2 x DP 2)
    assert cfg.padded_vocab_size == 256                 # a multiple of 128 x TP 2, not 128


def test_spare_ranks_take_the_micro_batch_count_of_the_fitted_world(capsys):
    """World 6 at TP2: DP3 x micro-batch 2 does not divide the global batch of 8, the
    largest fitting world is 4 (DP2): 8 / (2 x 2) = 2 micro-batches per DP rank (what
    evaluation runs and the banners print), not the launched world's 8 // (2 x 3) = 1.
    (The dry run validates the launched world as given: no spares there.)"""
    cfg = _cfg(6, "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
               "--global-batch-size", "8", "--elastic")
    assert (cfg.world_size, cfg.launched_world_size) == (4, 6)
    assert (cfg.data_parallel_size, cfg.num_micro_batches) == (2, 2)
    assert "micro-batch 2 x 2 micro-batches x DP 2 = global batch 8" in describe_batch(cfg)
    assert "TP2 CP1 PP1 DP2, 2 micro-batches of 2 per DP rank" in elastic_fit.describe(cfg)
    assert "ranks 4-5 wait as spares" in capsys.readouterr().out
    schedule = BatchSizeSchedule(8, 2, cfg.data_parallel_size)
    assert schedule.num_micro_batches_at(0) == cfg.num_micro_batches


def test_batch_ramp_micro_batches_follow_the_ramp_and_dp():
    s = BatchSizeSchedule(32, 2, 2, rampup=(8, 8, 96))     # 3 increments over 96 samples
    assert [s.global_batch_size_at(c) for c in (0, 31, 32, 64, 96, 97)] == \
        [8, 8, 16, 24, 32, 32]
    assert [s.num_micro_batches_at(c) for c in (0, 32, 97)] == [2, 4, 8]
    # ramp: 8 (0), 8 (8), 8 (16), 8 (24), 16 (32), 16 (48), 24 (64), 24 (88), 32 (112 > 96)
    assert s.train_iters(176) == 9 + (176 - 144) // 32
    assert BatchSizeSchedule(32, 2, 2).train_iters(100) == 3


def test_model_sizes_resolve_from_what_is_given():
    m = ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6)
    assert m.resolved_kv_channels() == 16 and m.resolved_query_groups() == 6
    assert ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6,
                       kv_channels=8).resolved_kv_channels() == 8
    assert ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6,
                       group_query_attention=True,
                       num_query_groups=2).resolved_query_groups() == 2
    assert ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6,
                       num_query_groups=2).resolved_query_groups() == 6   # GQA off
    assert m.resolved_ffn_hidden_size() == 4 * 96
    swiglu = ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6, swiglu=True)
    assert swiglu.resolved_ffn_hidden_size() != 4 * 96
    moe = ModelConfig(num_layers=4, hidden_size=96, num_attention_heads=6, num_experts=4,
                      ffn_hidden_size=200, moe_layer_freq=2, mtp_num_layers=2)
    assert moe.resolved_moe_ffn_hidden_size() == 200
    assert moe.num_transformer_layers() == 6
    assert [moe.is_moe_layer(n) for n in range(6)] == [True, False, True, False, False, False]
    # the MTP layers (4, 5) are built like the last layer (3: dense)


def test_parallel_derived_values():
    p = ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                       num_layers_per_virtual_pipeline_stage=1,
                       account_for_embedding_in_pipeline_split=True,
                       account_for_loss_in_pipeline_split=True)
    assert p.etp == 4 and p.pipeline_slots(6) == 8 and p.virtual_stages(6) == 4
    assert ParallelConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=1).etp == 1
    assert not ParallelConfig(sequence_parallel=True).sequence_parallel_active
    assert ParallelConfig(tensor_model_parallel_size=2,
                          sequence_parallel=True).sequence_parallel_active


def test_per_split_data_paths_fill_the_missing_splits_with_empty_blends():
    from megalite.config import DataConfig

    assert DataConfig().per_split_data_path() is None
    d = DataConfig(valid_data_path=["0.5", "v1", "0.5", "v2"])
    assert d.per_split_data_path() == ([], ["0.5", "v1", "0.5", "v2"], [])
