"""The local backend's CUDA-path pieces that can be checked on CPU: the background
prefetcher (order, end, errors; CPU runs never wrap their iterator) and ``--compile``
(per layer, in place: names and values unchanged)."""
import dataclasses
import os
import shutil

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.backends import compile as compile_mod
from megalite.config import MegaliteConfig, ModelConfig
from megalite.data.device_prefetch import DevicePrefetcher, prefetch_to_device
from megalite.models.gpt import GPTModel, build_chunk, single_rank_state
from megalite.models.parallelize import parallelize_chunk


def batches(n):
    for i in range(n):
        yield {"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), -i)}


def test_prefetcher_keeps_order_and_ends_cleanly():
    it = DevicePrefetcher(batches(7), "cpu", depth=3)
    got = [int(b["tokens"][0, 0]) for b in it]
    assert got == list(range(7))
    with pytest.raises(StopIteration):                 # stays exhausted
        next(it)
    it.close()


def test_prefetcher_reraises_the_source_error():
    def bad():
        yield {"tokens": torch.zeros(1)}
        raise ValueError("corrupt shard")
    it = DevicePrefetcher(bad(), "cpu")
    assert next(it)["tokens"].shape == (1,)
    with pytest.raises(ValueError, match="corrupt shard"):
        next(it)


def test_cpu_iterators_are_not_wrapped():
    it = batches(2)
    assert prefetch_to_device(it, "cpu") is it
    assert prefetch_to_device(None, "cuda") is None


def small_cfg(**training):
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64, normalization="RMSNorm", position_embedding_type="rope",
                    swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                    attention_dropout=0.0)
    cfg = MegaliteConfig(model=m)
    for k, v in training.items():
        setattr(cfg.training, k, v)
    return cfg


def test_compile_flag_parses_and_is_off_by_default():
    base = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--vocab-size", "16", "--mock-data", "--train-iters", "1",
            "--lr", "1e-3"]
    assert parse_args(base).training.compile is False
    assert parse_args(base + ["--compile"]).training.compile is True


def test_compile_layers_in_place_keeps_names_and_values(monkeypatch):
    cfg = small_cfg()
    state = single_rank_state()
    ref = build_chunk(cfg, state, device="cpu")
    chunk = build_chunk(cfg, state, device="cpu")
    names = [n for n, _ in chunk.named_parameters()]
    assert compile_mod.compile_layers(chunk, backend="eager") == 2
    assert [n for n, _ in chunk.named_parameters()] == names
    assert all(layer._compiled_call_impl is not None
               for layer in compile_mod.transformer_layers(chunk))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(chunk(ids, labels=ids), ref(ids, labels=ids), rtol=1e-6,
                               atol=1e-6)
    # the parallelize phase compiles when --compile is given, and only then
    calls = []
    monkeypatch.setattr(compile_mod, "compile_layers", lambda c, **kw: calls.append(c))
    fresh = GPTModel(cfg, state, device="cpu")
    parallelize_chunk(fresh, cfg, state)
    assert calls == []
    parallelize_chunk(fresh, dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, compile=True)), state)
    assert calls == [fresh]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler on CPU")
def test_compile_with_inductor_trains_like_eager():
    """The real --compile (inductor, not the eager backend): a Llama-style run compiles its
    layers (RoPE included: no graph break with aliased inputs) and trains like eager."""
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    flags = ["--world-size", "1", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
             "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
             "--vocab-size", "512", "--normalization", "RMSNorm", "--position-embedding-type",
             "rope", "--swiglu", "--untie-embeddings-and-output-weights",
             "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--lr", "1e-3", "--train-iters", "3", "--eval-iters", "0", "--seed", "1234"]
    losses = []
    for extra in ([], ["--compile"]):
        trainer = Trainer(parse_args(flags + extra),
                          ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
        trainer.setup()
        it = trainer.data_iterator(trainer.train_ds, 0)
        losses.append([trainer.train_step(it)["lm_loss"] for _ in range(3)])
        if extra:
            layers = compile_mod.transformer_layers(trainer.model_chunks[0])
            assert layers and all(l._compiled_call_impl is not None for l in layers)
    # inductor fuses elementwise work (other rounding): equal to fp32 tolerance, not bitwise
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)


def test_each_cpu_capability_gets_its_own_inductor_cache(monkeypatch, tmp_path):
    """torch's inductor cache is not keyed on ATEN_CPU_CAPABILITY (a kernel compiled under
    one setting computes garbage under another): --compile keeps them apart, and leaves a
    directory the user chose alone."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)      # as torch itself leaves it
    assert compile_mod.inductor_cache_per_cpu_capability() is None
    for capability in ("avx2", "default"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)
        want = os.path.join(default, f"aten_cpu_capability_{capability}")
        assert compile_mod.inductor_cache_per_cpu_capability() == want
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == want
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compile_mod.inductor_cache_per_cpu_capability() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
