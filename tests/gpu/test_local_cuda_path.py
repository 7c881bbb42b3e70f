"""The local backend's CUDA path (no TE needed): flash SDPA on megalite's q/k/v layout,
fused AdamW, NCCL, the pinned background prefetch and ``--compile`` on a GPU."""
import pytest
import torch

from gpu_helpers import train
from megalite.config import MegaliteConfig, ModelConfig
from megalite.data.device_prefetch import DevicePrefetcher, prefetch_to_device
from megalite.models.gpt import GPTModel, single_rank_state
from megalite.optimizer.optimizer import make_inner_optimizer
from megalite.parallel_state import pick_device_and_backend


def model_cfg():
    return ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                       group_query_attention=True, num_query_groups=2, seq_length=256,
                       vocab_size=512, normalization="RMSNorm", position_embedding_type="rope",
                       swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=True)


def test_local_attention_runs_on_the_flash_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs sm80+")
    m = GPTModel(MegaliteConfig(model=model_cfg()), single_rank_state(), device="cuda",
                 params_dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    ref = m(ids, labels=ids)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):   # raises if the layout needs a fallback
        flash = m(ids, labels=ids)
    torch.testing.assert_close(flash, ref, rtol=1e-2, atol=1e-2)   # default may pick cuDNN


def test_cuda_run_uses_nccl_and_fused_adamw():
    assert pick_device_and_backend("auto", "auto") == ("cuda", "nccl")
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    opt = make_inner_optimizer([{"params": [p]}], MegaliteConfig().optimizer)
    assert opt.defaults.get("fused") is True


def test_prefetch_pins_and_moves_in_order():
    items = [{"tokens": torch.full((2, 8), i)} for i in range(5)]
    it = prefetch_to_device(iter(items), "cuda")
    assert isinstance(it, DevicePrefetcher)
    out = list(it)
    assert [int(b["tokens"][0, 0]) for b in out] == list(range(5))
    assert all(b["tokens"].is_cuda for b in out)


def test_compile_trains_like_eager(tmp_path):
    base = ["--train-iters", "4", "--global-batch-size", "4", "--transformer-impl", "local"]
    eager = train(tmp_path, "eager", base)
    compiled = train(tmp_path, "compiled", base + ["--compile"], timeout=600)
    for a, b in zip(eager, compiled):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 2e-2, (a, b)
