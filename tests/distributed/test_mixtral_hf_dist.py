"""A tiny random Hugging Face Mixtral imported at EP=2 (4 gloo ranks: EP2 x expert-DP2,
each rank holding 2 of the 4 experts) gives the same logits as ``transformers``."""
import pytest
import torch
import torch.distributed as torch_dist

from megalite.checkpointing import hf
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import build_chunk
from megalite.parallel_state import ParallelState, RankGrid

transformers = pytest.importorskip("transformers")

from mixtral_fixture import IDS, hf_mixtral, rel  # noqa: E402  (tests/ is on sys.path)


def _ep2_logits(path):
    model_cfg, full = hf.import_hf(path)
    cfg = MegaliteConfig(model=ModelConfig(**model_cfg), world_size=4,
                         parallel=ParallelConfig(expert_model_parallel_size=2))
    state = ParallelState.build(RankGrid.from_config(cfg), torch_dist.get_rank())
    model = build_chunk(cfg, state).eval()
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
