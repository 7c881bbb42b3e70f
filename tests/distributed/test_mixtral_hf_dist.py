"""A tiny random Hugging Face Mixtral imported at EP=2 (4 gloo ranks: EP2 x expert-DP2,
each rank holding 2 of the 4 experts) gives the same logits as ``transformers``."""
import pytest
import torch
import torch.distributed as torch_dist

from megalite.checkpointing import hf
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import GPTModel
from megalite.parallel_state import ParallelState, RankGrid

transformers = pytest.importorskip("transformers")


def hf_mixtral(path, seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():   # non-trivial norms and a peaky router, so a bad mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if n.endswith("gate.weight"):
                p.mul_(20)
    model.save_pretrained(path)
    return model


IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ep2_logits(path):
    model_cfg, full = hf.import_hf(path)
    cfg = MegaliteConfig(model=ModelConfig(**model_cfg), world_size=4,
                         parallel=ParallelConfig(expert_model_parallel_size=2))
    state = ParallelState.build(RankGrid.from_config(cfg), torch_dist.get_rank())
    model = GPTModel(cfg, state).eval()
    load_full_state_dict(model, full, state)
    local_experts = model.decoder.layers["0"].mlp.experts.linear_fc1.weight.shape[0]
    with torch.no_grad():
        return local_experts, model(IDS)[..., :100]


def test_imported_mixtral_at_ep2_gives_hf_logits(tmp_path, dist):
    ref = hf_mixtral(str(tmp_path / "hf"))
    with torch.no_grad():
        expected = ref(IDS).logits
    for local_experts, logits in dist.run(4, _ep2_logits, str(tmp_path / "hf")):
        assert local_experts == 2
        assert rel(logits, expected) <= 1e-5
