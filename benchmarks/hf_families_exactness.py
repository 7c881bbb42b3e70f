#!/usr/bin/env python
"""Every Hugging Face family's import against transformers, side by side, in one process:
the tiny random model of each family (``tests/hf_families.py``, and the DeepSeek-V3-style
configs of ``tests/unit/test_deepseek_v3_configs.py``: an own ``rms_norm_eps``, Moonlight,
Kimi K2) imported through the adapter, its logits on 2 x 40 tokens compared with
transformers' (max |delta logit| and max relative), then exported and reloaded by
transformers (relative).  TP2 / PP2 losses of the newer families are printed by
``tests/distributed/test_hf_families_dist.py -s``.

    python benchmarks/hf_families_exactness.py
"""
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "unit")]

from hf_families import FAMILIES, VOCAB, save_hf_model  # noqa: E402
from megalite.checkpointing import hf  # noqa: E402
from megalite.checkpointing.model_io import load_full_state_dict  # noqa: E402
from megalite.config import MegaliteConfig, ModelConfig  # noqa: E402
from megalite.models.gpt import build_model, single_rank_state  # noqa: E402
import test_deepseek_v3_configs as ds  # noqa: E402

import transformers  # noqa: E402


def _row(name, ref, path, vocab):
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    model_cfg, full = hf.import_hf(path)
    model = build_model(MegaliteConfig(model=ModelConfig(**model_cfg)), single_rank_state())
    load_full_state_dict(model.eval(), full, single_rank_state())
    with torch.no_grad():
        expected = ref(ids).logits
        delta = (model(ids)[..., :vocab] - expected).abs().max().item()
    out = path + "_out"
    hf.export_hf(out, model_cfg, full, architecture=ref.config.architectures[0])
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        back_rel = ((back(ids).logits - expected).abs().max() / expected.abs().max()).item()
    print(f"{name:18s} {ref.config.architectures[0]:24s} {delta:14.2e} "
          f"{delta / expected.abs().max().item():10.2e} {back_rel:12.2e}")


def main():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"{'family':18s} {'architecture':24s} {'max|dlogit|':>14s} {'rel':>10s} "
          f"{'export rel':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            path = os.path.join(tmp, family)
            _row(family, save_hf_model(family, path), path, VOCAB)
        for name in ds.CONFIGS:
            path = os.path.join(tmp, name)
            _row(name, ds._save(name, path), path, ds.VOCAB)


if __name__ == "__main__":
    main()
