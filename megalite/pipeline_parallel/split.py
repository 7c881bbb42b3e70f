"""The pipeline stage-split rule: which transformer layers each (pipeline rank, virtual
stage) holds, and which stages hold the embedding and the output layer.

It is the one rule the runtime (``models.stages.build_model_chunks``), the planner's parameter
and memory counts and the checkpoint converter all use, so a checkpoint written for a
layout has exactly the stage files that layout builds.  Pure Python (no torch), so
config-only code such as the planner imports it freely.

* No virtual stages: rank r holds one contiguous block.  ``first`` / ``last``
  (``--decoder-first/last-pipeline-num-layers``) pin the first/last block sizes and the
  other layers split evenly over the middle ranks.
* V virtual stages: the layers form P*V equal blocks and chunk c of rank r holds block
  c*P + r (Megatron's interleaving), so a micro-batch visits every rank V times.
* V shape (``vshape``, DualPipeV): two chunks per rank, chunk 0 of rank r holds block r and
  chunk 1 block 2P-1-r, so a micro-batch goes down the ranks and comes back up, and the
  embedding and the output layer are both on rank 0 (``simulator.stage_index``, which the
  schedules share).
* ``account_for_embedding`` / ``account_for_loss`` (Megatron's
  ``--account-for-embedding/loss-in-pipeline-split``) count the embedding / the loss as one
  more layer: the L' = L (+1) (+1) slots form P*V equal blocks as above, the embedding
  takes the first slot of block 0 and the loss the last slot of block P*V-1, so those two
  chunks hold one transformer layer fewer.
* ``layout`` (Megatron's ``--pipeline-model-parallel-layout``, config/pipeline_layout.py)
  gives every block's transformer-layer count outright; blocks keep the order above.

The embedding always lives on (rank 0, chunk 0) and the final norm + output layer on the
last block's chunk: (rank P-1, chunk V-1), or (rank 0, chunk 1) in the V shape; with
tied embeddings and P > 1 the latter also holds the copy of the word embedding (in the V
shape it reads chunk 0's instead: one rank, one matrix).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megalite.config.pipeline_layout import parse_layout
from megalite.config.pipeline_program import stage_index, stage_place


@dataclass(frozen=True)
class PipelineSplit:
    """Layer numbers per (pipeline rank, virtual stage): ``chunks[pp_rank][vpp_rank]``."""
    num_layers: int
    chunks: Tuple[Tuple[Tuple[int, ...], ...], ...]
    vshape: bool = False

    @property
    def pp(self) -> int:
        return len(self.chunks)

    @property
    def vpp(self) -> int:
        return len(self.chunks[0])

    @property
    def embedding_stage(self) -> Tuple[int, int]:
        """(pp_rank, vpp_rank) of the chunk that holds the input embedding."""
        return 0, 0

    @property
    def output_stage(self) -> Tuple[int, int]:
        """(pp_rank, vpp_rank) of the chunk with the final norm, output layer and loss."""
        return stage_place(self.pp * self.vpp - 1, self.pp, self.vshape)

    def holds_embedding(self, pp_rank: int, vpp_rank: int = 0) -> bool:
        return (pp_rank, vpp_rank) == self.embedding_stage

    def holds_output(self, pp_rank: int, vpp_rank: int = 0) -> bool:
        return (pp_rank, vpp_rank) == self.output_stage

    def layers(self, pp_rank: int, vpp_rank: int = 0) -> List[int]:
        """Global layer numbers of chunk ``vpp_rank`` of pipeline rank ``pp_rank``."""
        if not 0 <= pp_rank < self.pp or not 0 <= vpp_rank < self.vpp:
            raise ValueError(f"stage ({pp_rank}, {vpp_rank}) outside PP={self.pp} x "
                             f"VPP={self.vpp}")
        return list(self.chunks[pp_rank][vpp_rank])

    def rank_layers(self, pp_rank: int) -> List[int]:
        """Every layer pipeline rank ``pp_rank`` holds, chunk by chunk."""
        return [n for c in range(self.vpp) for n in self.layers(pp_rank, c)]

    def counts(self) -> List[int]:
        """Layers per pipeline rank (all its virtual stages together)."""
        return [sum(len(c) for c in rank) for rank in self.chunks]

    def stage_of_layer(self, layer: int) -> Tuple[int, int]:
        """(pp_rank, vpp_rank) holding global layer ``layer``."""
        for r, rank in enumerate(self.chunks):
            for c, chunk in enumerate(rank):
                if layer in chunk:
                    return r, c
        raise ValueError(f"layer {layer} outside the {self.num_layers} layers")


@functools.lru_cache(maxsize=4096)
def split_layers(num_layers: int, pp: int = 1, vpp: int = 1, first: Optional[int] = None,
                 last: Optional[int] = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False, vshape: bool = False,
                 layout: Optional[str] = None, mtp_layers: int = 0) -> PipelineSplit:
    """The split of ``num_layers`` layers over ``pp`` ranks x ``vpp`` virtual stages.

    Raises ``ValueError`` for a layout the rule cannot split (the user-facing checks with
    flag names are in ``megalite.cli.validation``)."""
    if pp < 1 or vpp < 1:
        raise ValueError(f"pipeline sizes must be positive (PP={pp}, VPP={vpp})")
    uneven = first is not None or last is not None
    if vshape and vpp != 2:
        raise ValueError(f"the V shape runs 2 chunks per rank, not VPP={vpp}")
    emb, loss = int(bool(account_for_embedding)), int(bool(account_for_loss))
    if layout:
        if uneven or emb or loss:
            raise ValueError("a pipeline layout string with first/last counts or the "
                             "embedding/loss accounting: refused by the rules 'pp-layout "
                             "excludes ...' (megalite/cli/features.py)")
        counts = parse_layout(layout, pp, num_layers, mtp_layers).layer_counts()
        if len(counts) != pp * vpp:
            raise ValueError(f"the layout has {len(counts)} stages, not PP x VPP "
                             f"({pp} x {vpp})")
        starts = [sum(counts[:b]) for b in range(len(counts))]
        bounds = [(st, st + n) for st, n in zip(starts, counts)]
    elif uneven and (vpp > 1 or emb or loss):
        raise ValueError("first/last pipeline layer counts with virtual stages or with the "
                         "embedding/loss counted as layers: refused by the rules 'pp-uneven "
                         "excludes pp-interleaved' and 'pp-uneven excludes pp-account' "
                         "(megalite/cli/features.py)")
    elif emb or loss:                        # embedding and/or loss count as layers
        slots = num_layers + emb + loss
        if slots % (pp * vpp):
            raise ValueError(f"{slots} pipeline layers ({num_layers} + embedding/loss) are "
                             f"not divisible by PP x VPP ({pp} x {vpp})")
        per = slots // (pp * vpp)
        bounds = [(max(0, b * per - emb), min(num_layers, (b + 1) * per - emb))
                  for b in range(pp * vpp)]
    elif vpp > 1:
        if num_layers % (pp * vpp):
            raise ValueError(f"{num_layers} layers are not divisible by PP x VPP "
                             f"({pp} x {vpp})")
        per = num_layers // (pp * vpp)
        bounds = [(b * per, (b + 1) * per) for b in range(pp * vpp)]
    else:
        counts = _contiguous_counts(num_layers, pp, first, last)
        starts = [sum(counts[:r]) for r in range(pp)]
        bounds = [(s, s + n) for s, n in zip(starts, counts)]
    chunks = tuple(tuple(tuple(range(*bounds[stage_index(r, c, pp, vshape)]))
                         for c in range(vpp)) for r in range(pp))
    return PipelineSplit(num_layers, chunks, vshape)


def _contiguous_counts(num_layers: int, pp: int, first: Optional[int],
                       last: Optional[int]) -> List[int]:
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers are not divisible by PP ({pp}); give the "
                             "first/last stage sizes for an uneven split")
        return [num_layers // pp] * pp
    fixed = {r: n for r, n in ((0, first), (pp - 1, last)) if n is not None}
    rest = num_layers - sum(fixed.values())
    middle = pp - len(fixed)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ValueError(f"{num_layers} layers do not split as first={first} last={last} "
                         f"over {pp} stages")
    return [fixed.get(r, rest // middle if middle else 0) for r in range(pp)]


def pipeline_split(cfg) -> PipelineSplit:
    """The split a ``MegaliteConfig`` (``.model`` + ``.parallel``) builds."""
    m, p = cfg.model, cfg.parallel
    return split_layers(m.num_layers, p.pp, p.virtual_stages(m.num_layers),
                        p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers,
                        bool(p.account_for_embedding_in_pipeline_split),
                        bool(p.account_for_loss_in_pipeline_split), p.pipeline_vshape,
                        p.pipeline_model_parallel_layout, m.mtp_num_layers or 0)
