"""What pretrain_gpt.py / pretrain_moe.py call: flags -> validated config -> loop.

Validation (megalite.validation) runs before any process group exists; a bad flag is one
line on stderr and exit status 2.
"""
from __future__ import annotations

from megalite.arguments import parse_args, run_cli
from megalite.parallel_state import RankGrid


def describe_run(cfg) -> str:
    m, t = cfg.model, cfg.training
    lines = [RankGrid.from_config(cfg).describe(),
             f"micro-batch {t.micro_batch_size} x {cfg.num_micro_batches} micro-batches x "
             f"DP {cfg.data_parallel_size} = global batch {t.global_batch_size}"]
    if m.vocab_size:
        lines.append(f"vocabulary {m.vocab_size} padded to {cfg.padded_vocab_size}")
    return "\n".join(lines)


def main(argv=None, prog: str = "pretrain_gpt.py", defaults: dict | None = None):
    def _run(argv):
        cfg = parse_args(argv, prog=prog, defaults=defaults)
        if cfg.training.dry_run:
            print(describe_run(cfg))
            return 0
        from megalite.training.loop import pretrain

        return pretrain(cfg)

    return run_cli(_run, argv)
