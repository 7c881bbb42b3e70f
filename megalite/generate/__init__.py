"""Sample text from a megalite checkpoint in one process (any saved TP/PP layout).

    python -m megalite.generate --load CKPT_DIR --prompt "ROMEO:" --max-new-tokens 200

The checkpoint's metadata carries the model config and tokenizer, so no other flag is
needed (no optimizer flag ever: this is inference); weights saved at any layout are
resharded to one process on load.  A checkpoint that records no tokenizer (a converted
one whose Hugging Face directory had none) takes Megatron's tokenizer flags
(``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``).
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch

from megalite.config.checkpoint_folders import not_converted_problem
from megalite.checkpointing.model_io import LATEST, load_model_shards, read_metadata
from megalite.cli.arguments import OneLineErrorParser
from megalite.cli.boundary import run_cli
from megalite.config import DataConfig, MegaliteConfig, ModelConfig
from megalite.data import build_tokenizer_from_config
from megalite.errors import CheckpointError
from megalite.models.gpt import build_model
from megalite.parallel_state import ParallelState, RankGrid


def load_for_inference(root: str, tokenizer_flags: dict | None = None):
    """(model, tokenizer, cfg) on one CPU process, weights from ``root``;
    ``tokenizer_flags`` (DataConfig names) replace the checkpoint's tokenizer."""
    meta = read_metadata(root)
    cfg = MegaliteConfig()
    cfg.model = ModelConfig(**meta["model"])
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    tok_meta = meta.get("extra", {}).get("tokenizer", {})
    data = {**meta.get("args", {}).get("data", {}), **tok_meta}   # tiktoken flags too
    vocab = tok_meta.get("vocab_size")
    if tokenizer_flags and tokenizer_flags.get("tokenizer_type"):
        data, vocab = dict(tokenizer_flags), cfg.model.vocab_size
    tokenizer = build_tokenizer_from_config(SimpleNamespace(**data), vocab)
    state = ParallelState.build(RankGrid(1), 0, create_groups=False)
    model = build_model(cfg, state)
    load_model_shards(root, [model], cfg, state)
    model.eval()
    return model, tokenizer, cfg


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, seq_length: int, temperature: float = 0.8,
             top_k: int = 40, vocab_size: int | None = None, seed: int = 0) -> list:
    """Autoregressive sampling (full recompute of the window each step: simple, small models)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-seq_length:]], dtype=torch.long)
        logits = model(window)[0, -1].float()
        if vocab_size:
            logits = logits[:vocab_size]  # drop the padded vocabulary columns
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
    return ids


def main(argv=None):
    """Behind megalite's boundary: a bad flag or checkpoint is one line, exit status 2."""
    return run_cli(_main, argv, prog="megalite")


def _main(argv=None):
    ap = OneLineErrorParser(prog="python -m megalite.generate",
                            help_hint="python -m megalite.generate --help",
                            description=__doc__.splitlines()[0])
    ap.add_argument("--load", required=True, help="checkpoint directory (--save of training)")
    ap.add_argument("--prompt", default="\n",
                    help="text the sample continues (default: a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=200,
                    help="tokens to sample after the prompt (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="softmax temperature; 0 takes the most likely token (greedy) "
                    "(default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=40,
                    help="sample among the k most likely tokens; 0: all (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the sampling generator (default: %(default)s)")

    tok = ap.add_argument_group("tokenizer (default: the checkpoint's)")
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(DataConfig)}
    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(DataConfig)}
    for name in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        tok.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                         choices=choices[name], help=helps[name])
    a = ap.parse_args(argv)

    hf = not_converted_problem("--load", a.load)
    if hf:
        raise CheckpointError(hf)
    if not os.path.isfile(os.path.join(a.load, LATEST)):
        raise CheckpointError(f"--load: no checkpoint in '{a.load}'; give the --save folder "
                              "of a training run")
    flags = {n: getattr(a, n) for n in ("tokenizer_type", "tokenizer_model", "vocab_file",
                                        "merge_file")}
    model, tokenizer, cfg = load_for_inference(a.load, flags)
    if tokenizer is None:
        raise CheckpointError(f"--load {a.load}: the checkpoint records no tokenizer (trained "
                              "with --mock-data, or converted from a Hugging Face directory "
                              "without one); give --tokenizer-type (and --tokenizer-model FILE)")
    prompt = tokenizer.tokenize(a.prompt)
    out = generate(model, prompt, a.max_new_tokens, cfg.model.seq_length, a.temperature,
                   a.top_k, vocab_size=tokenizer.vocab_size, seed=a.seed)
    print(tokenizer.detokenize(out))
    return 0

