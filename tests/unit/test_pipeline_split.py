"""The one pipeline stage-split rule, and converted checkpoints that load into the runtime's
stages for uneven, interleaved and embedding/loss-counting layouts (no processes: each
rank's chunks are built with a group-less ParallelState)."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from megalite.checkpointing.model_io import (full_state_dict_from_checkpoint, load_model_shards,
                                             read_metadata)
from megalite.checkpointing.sharding import shard_tensor, unshard_tensors
from megalite.config import ConfigError, MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.split import pipeline_split, split_layers
from megalite.models.stages import build_model_chunks
from megalite.checkpointing.checkpoint import save_model_checkpoint
from megalite.planner import model_spec as ms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rule_covers_every_layer_once_and_places_embedding_and_output():
    cases = [dict(num_layers=8, pp=4), dict(num_layers=10, pp=4, first=1, last=3),
             dict(num_layers=7, pp=2, first=2), dict(num_layers=7, pp=2, last=3),
             dict(num_layers=8, pp=2, vpp=2), dict(num_layers=6, pp=2, vpp=2,
                                                    account_for_embedding=True,
                                                    account_for_loss=True),
             dict(num_layers=2, pp=2, vpp=2, account_for_embedding=True, account_for_loss=True),
             dict(num_layers=126, pp=16, vpp=4, account_for_embedding=True,
                  account_for_loss=True)]
    for kw in cases:
        s = split_layers(**kw)
        # block order (chunk c of rank r = block c*P + r) visits the layers 0..L-1 in order
        order = [n for c in range(s.vpp) for r in range(s.pp) for n in s.layers(r, c)]
        assert order == list(range(kw["num_layers"])), kw
        assert sum(s.counts()) == kw["num_layers"]
        assert s.embedding_stage == (0, 0) and s.output_stage == (s.pp - 1, s.vpp - 1)
        assert s.holds_embedding(0, 0) and s.holds_output(s.pp - 1, s.vpp - 1)
        for n in range(kw["num_layers"]):
            r, c = s.stage_of_layer(n)
            assert n in s.layers(r, c)
    assert split_layers(10, 4, first=1, last=3).counts() == [1, 3, 3, 3]
    both = split_layers(2, 2, 2, account_for_embedding=True, account_for_loss=True)
    assert both.chunks == (((), (1,)), ((0,), ()))     # embedding-only and loss-only chunks
    for bad in (dict(num_layers=9, pp=4, first=2), dict(num_layers=7, pp=2),
                dict(num_layers=8, pp=3, vpp=2), dict(num_layers=7, pp=2, vpp=2, first=1),
                dict(num_layers=6, pp=4, account_for_loss=True)):
        with pytest.raises(ValueError):
            split_layers(**bad)
    with pytest.raises(ValueError, match="outside"):
        split_layers(8, 2).layers(2)


def test_planner_and_runtime_use_the_same_rule():
    m = ModelConfig(num_layers=10, hidden_size=16, num_attention_heads=2)
    layouts = [dict(pp=4, first=1, last=3), dict(pp=2, first=4), dict(pp=5), dict(pp=1)]
    for kw in layouts:
        cfg = MegaliteConfig(model=m, parallel=ParallelConfig(
            pipeline_model_parallel_size=kw["pp"],
            decoder_first_pipeline_num_layers=kw.get("first"),
            decoder_last_pipeline_num_layers=kw.get("last")))
        s = pipeline_split(cfg)
        assert ms.layers_per_stage(m, kw["pp"], kw.get("first"), kw.get("last")) == s.counts()
        for r in range(kw["pp"]):
            assert ms.stage_layer_ids(m, kw["pp"], r, 1, kw.get("first"), kw.get("last")) == \
                s.rank_layers(r)


def test_split_module_imports_no_torch():
    code = ("import sys, megalite.pipeline_parallel.split as s; "
            "assert s.split_layers(4, 2).counts() == [2, 2]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


# -- converter output == what the runtime builds at that layout ---------------------------

LAYOUTS = {  # name: (layers, tp, pp, parallel flags, tied)
    "uneven": (5, 2, 3, dict(decoder_first_pipeline_num_layers=1,
                             decoder_last_pipeline_num_layers=2), True),
    "account_both_vpp": (6, 1, 2, dict(num_virtual_stages_per_pipeline_rank=2,
                                       account_for_embedding_in_pipeline_split=True,
                                       account_for_loss_in_pipeline_split=True), True),
    "account_loss": (3, 2, 2, dict(account_for_loss_in_pipeline_split=True), False),
    "embedding_only_chunks": (2, 2, 2, dict(num_virtual_stages_per_pipeline_rank=2,
                                            account_for_embedding_in_pipeline_split=True,
                                            account_for_loss_in_pipeline_split=True), True),
    "interleaved": (8, 1, 2, dict(num_virtual_stages_per_pipeline_rank=2), False),
}


def layout_cfg(layers, tp, pp, flags, tied, seed=1):
    cfg = MegaliteConfig(
        model=ModelConfig(num_layers=layers, hidden_size=16, num_attention_heads=4,
                          seq_length=8, vocab_size=40, make_vocab_size_divisible_by=8,
                          normalization="RMSNorm", position_embedding_type="rope",
                          swiglu=True, add_bias_linear=False,
                          untie_embeddings_and_output_weights=not tied),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                **flags),
        world_size=tp * pp)
    cfg.training.seed = seed
    return cfg


def rank_chunks(cfg, tp_rank, pp_rank):
    grid = RankGrid(cfg.world_size, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                    vpp=cfg.parallel.virtual_stages(cfg.model.num_layers))
    state = ParallelState.build(grid, tp_rank + cfg.parallel.tp * pp_rank, create_groups=False)
    assert (state.tp.rank, state.pp.rank) == (tp_rank, pp_rank)
    return build_model_chunks(cfg, state), state


def _sizes(cfg):
    p = cfg.parallel
    return {"tp": p.tp, "pp": p.pp, "vpp": p.virtual_stages(cfg.model.num_layers)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_converted_checkpoint_loads_into_every_runtime_stage(tmp_path, name):
    """The converter's writer (full tensors -> the training format, cut for this layout):
    every (tp, pp) rank of the layout -- its chunks as the runtime builds them, tied copy on
    the last stage included -- loads exactly its shard of every tensor it holds."""
    layers, tp, pp, flags, tied = LAYOUTS[name]
    cfg = layout_cfg(layers, tp, pp, flags, tied)
    ref = build_model(MegaliteConfig(model=cfg.model), single_rank_state())
    full = {n: unshard_tensors([p.detach()], spec) for n, p, spec in ref.param_table.named(ref)}
    save_model_checkpoint(str(tmp_path), dataclasses.asdict(cfg.model), full, _sizes(cfg),
                          iteration=3)
    assert read_metadata(str(tmp_path))["pipeline_model_parallel_size"] == pp
    other = layout_cfg(layers, tp, pp, flags, tied, seed=99)   # different init, same layout
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            chunks, state = rank_chunks(other, tp_rank, pp_rank)
            assert load_model_shards(str(tmp_path), chunks, other, state) == 3
            for c in chunks:
                for n, p, spec in c.param_table.named(c):
                    assert torch.equal(p.detach(), shard_tensor(full[n], spec, tp_rank, tp)), n
    _, back = full_state_dict_from_checkpoint(str(tmp_path))
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)


def test_convert_tool_target_layout_flags(tmp_path, capsys):
    """The converter's --target-* flags are checked by the runtime's split rule, the written
    checkpoint (DCP) loads into every stage of that layout (and of another one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "convert_tool", os.path.join(ROOT, "tools", "checkpoint", "convert.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    layers, tp, pp, flags, tied = LAYOUTS["account_both_vpp"]
    cfg = layout_cfg(layers, tp, pp, flags, tied)
    ref = build_model(MegaliteConfig(model=cfg.model), single_rank_state())
    full = {n: unshard_tensors([p.detach()], spec) for n, p, spec in ref.param_table.named(ref)}
    save_model_checkpoint(str(tmp_path / "src"), dataclasses.asdict(cfg.model), full,
                          {"tp": 1})
    argv = ["--source-format", "megalite", "--target-format", "megalite",
            "--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "dst"),
            "--target-pipeline-parallel-size", "2"]
    assert tool.main(argv + ["--target-num-virtual-stages-per-pipeline-rank", "2",
                             "--target-account-for-embedding-in-pipeline-split",
                             "--target-account-for-loss-in-pipeline-split"]) == 0
    out = capsys.readouterr().out
    assert "VPP=2" in out and "--num-virtual-stages-per-pipeline-rank 2" in out
    for layout in (cfg, layout_cfg(layers, 2, 3, {}, tied, seed=5)):
        for tp_rank in range(layout.parallel.tp):
            for pp_rank in range(layout.parallel.pp):
                chunks, state = rank_chunks(layout, tp_rank, pp_rank)
                load_model_shards(str(tmp_path / "dst"), chunks, layout, state)
                for c in chunks:
                    for n, p, spec in c.param_table.named(c):
                        assert torch.equal(p.detach(),
                                           shard_tensor(full[n], spec, tp_rank,
                                                        layout.parallel.tp)), n
    with pytest.raises(SystemExit) as exc:        # 6 layers do not split evenly over PP 4
        tool.main(argv[:-1] + ["4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "target layout" in err and err.count("\n") == 1
    assert "--target-pipeline-model-parallel-size" in err


def test_megatron_layout_string_gives_the_counts_and_each_mistake_is_one_line():
    """--pipeline-model-parallel-layout (config/pipeline_layout.py): the same chunks as the
    rule it spells out, repeats and cosmetic commas expanded, VPP from its stage count."""
    from megalite.config.pipeline_layout import parse_layout, virtual_stages_of

    assert split_layers(6, 2, 2, layout="Et|tt|tt|tL") == \
        split_layers(6, 2, 2, account_for_embedding=True, account_for_loss=True)
    assert split_layers(8, 2, 2, layout="E(tt|)*3,ttL").chunks == \
        split_layers(8, 2, 2).chunks
    lay = parse_layout("Et*3|(tt|)*2,t,mL", 2, 8, 1)          # "Ettt|tt|tt|tmL"
    assert lay.stages == ("Ettt", "tt", "tt", "tmL") and lay.layer_counts() == (3, 2, 2, 1)
    assert virtual_stages_of("Et|(tt|)*30mL", 8) == 4
    cfg = MegaliteConfig(model=ModelConfig(num_layers=5, hidden_size=32, num_attention_heads=4),
                         parallel=ParallelConfig(pipeline_model_parallel_size=2,
                                                 pipeline_model_parallel_layout="Ettt|t|t|L"),
                         world_size=2)
    assert cfg.parallel.virtual_stages(5) == 2
    assert pipeline_split(cfg).chunks == (((0, 1, 2), (4,)), ((3,), ()))
    for text, pp, layers, mtp, says in [
            ("Etx|tL", 2, 2, 0, "unknown character(s) 'x'"),
            ("Et|tt|L", 2, 3, 0, "has 3 stages, not a multiple of"),
            ("Et|tL", 2, 3, 0, "places 2 transformer layers ('t'), but --num-layers is 3"),
            ("t|EtL", 2, 2, 0, "'E' (embedding) must appear once, in the first stage"),
            ("Et|tmL", 2, 2, 2, "has 1 MTP depths ('m'), but --mtp-num-layers is 2"),
            ("Etm|tL", 2, 2, 1, "must all be in the last stage"),
            ("Et|mtL", 2, 2, 1, "transformer layers must come before the MTP depths")]:
        with pytest.raises(ConfigError, match=re.escape(says)) as e:
            parse_layout(text, pp, layers, mtp)
        assert str(e.value).startswith(f"--pipeline-model-parallel-layout {text!r}")
