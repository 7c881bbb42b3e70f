"""GPTModel: embedding -> transformer block -> output layer -> per-token loss.

One class covers Llama-style (RMSNorm, RoPE, GQA, SwiGLU, untied, no biases) and GPT-2
style (LayerNorm, learned positions, GeLU, biases, tied) models, selected by
``cfg.model`` flags.  A pipeline chunk holds ``layer_numbers`` (global indices), the
embedding when ``pre_process`` and the final norm + output layer when ``post_process``.

Forward contract (``forward(input_ids, position_ids=None, labels=None, loss_mask=None,
document_ids=None)``; ``document_ids`` [b, s], the packed documents of
``--reset-attention-mask``, reach every core attention):
  * post_process and labels given -> fp32 per-token loss [b, s] (``loss_mask``, how the
    caller weights the tokens, lets the fused loss form its gradients in forward)
  * post_process, no labels       -> logits, this rank's vocabulary shard [b, s, v_pad/tp]
  * otherwise                      -> hidden states [s/tp (with SP) or s, b, h]
Non-first chunks take their input from ``set_input_tensor``.

Vocabulary padding: tables are padded with zero rows to ``cfg.padded_vocab_size``; the
vocab-parallel loss ignores columns >= vocab_size, so padding never changes the loss
and padded rows get zero gradient (logits of padded columns are 0 and stay 0).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.backends import get_layer_spec
from megalite.backends.te_names import canonical_renames
from megalite.config import MegaliteConfig
from megalite.comm.flight_recorder import module_site
from megalite.models.parallelize import parallelize_chunk, spec_choices
from megalite.param_spec import (TIED_COPY, TIED_OWNER, ParamSpec, ParamTable, group_coords,
                                 make_param)
from megalite.parallel_state import ModelCommGroups, ParallelState, RankGrid
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megalite.tensor_parallel.layers import VocabParallelEmbedding
from megalite.tensor_parallel.random import DrawsFromTracker, init_parameters
from megalite.transformer.block import TransformerBlock
from megalite.transformer.extra_losses import add_extra_loss
from megalite.transformer.loss_reduction import mtp_depth_weight
from megalite.transformer.mla import mla_rotary
from megalite.transformer.mtp import MultiTokenPrediction, mtp_loss_name, roll_left
from megalite.transformer.rotary import LayerRotaries, RotaryEmbedding, local_rotary
from megalite.transformer.spec import LayerSpec

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
EMBEDDING_SITE = module_site("embedding")         # call sites of the flight recorder
OUTPUT_SITE = module_site("output layer")


class LanguageModelEmbedding(DrawsFromTracker, nn.Module):
    """Word (+ learned position) embeddings, output [s, b, h] (or [s/tp, b, h] with SP)."""

    def __init__(self, model_cfg, tp_group, *, sequence_parallel: bool, device=None,
                 dtype=None):
        super().__init__()
        m = model_cfg
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.dropout = m.hidden_dropout
        self.scale = m.hidden_size ** 0.5 if m.scale_embeddings else None
        self.word_embeddings = VocabParallelEmbedding(
            m.vocab_size, m.hidden_size, tp_group=tp_group,
            pad_multiple=m.make_vocab_size_divisible_by, init_std=m.init_method_std,
            reduce_scatter=sequence_parallel, device=device, dtype=dtype)
        self.position_embeddings = None
        if m.position_embedding_type == "learned_absolute":
            table = m.max_position_embeddings or m.seq_length
            self.position_embeddings = nn.Module()
            # With SP each rank adds only its sequence chunk's positions: grads need a TP sum.
            spec = ParamSpec((table, m.hidden_size), init=("normal", m.init_method_std),
                             sequence_parallel=tp_group.name if sequence_parallel else None)
            make_param(self.position_embeddings, "weight", spec, {}, device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        ids = input_ids.t()                                   # [s, b]
        x = self.word_embeddings(ids)                         # [s(/tp), b, h]
        if self.scale:          # --scale-embeddings (Gemma): sqrt(h) in the model dtype
            x = x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)
        if self.position_embeddings is not None:
            if position_ids is None:
                pos = torch.arange(ids.shape[0], device=ids.device)[:, None]
            else:
                pos = position_ids.t()
            if self.sequence_parallel:
                pos = pos.chunk(self.tp_group.size, dim=0)[self.tp_group.rank]
            x = x + F.embedding(pos, self.position_embeddings.weight)
        if self.training and self.dropout > 0:
            fork = self.rng_tracker.fork() if self.sequence_parallel \
                else contextlib.nullcontext()
            with fork:
                x = F.dropout(x, self.dropout, training=True)
        return x


class GPTModel(DrawsFromTracker, nn.Module):
    """One pipeline chunk of the model: structure only.

    The constructor builds modules and (TP-sharded) parameters from ``spec`` (a backend's
    ``LayerSpec``; the plain local one when None) and knows no training policy: the
    parallelize step (``models/parallelize.py``) attaches the RNG tracker, recompute,
    compile, initial values and FSDP2.  ``build_chunk`` below does both, for every chunk
    of a run (the model family's ``build_model_chunks``), tools and tests.  Until
    parallelized, parameters hold raw values and dropout forks nothing.
    """

    def __init__(self, cfg, state, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Optional[Sequence[int]] = None, *,
                 spec: Optional[LayerSpec] = None, device=None,
                 params_dtype: torch.dtype = torch.float32,
                 embedding_of: Optional[nn.Module] = None):
        super().__init__()
        # A V-shaped pipeline (DualPipeV) puts the output layer on the first stage's rank:
        # a tied output layer then reads that chunk's word embedding itself (one parameter,
        # as at PP = 1) instead of holding a copy.  A tuple, so it is not a submodule.
        self._embedding_of = (embedding_of,) if embedding_of is not None else ()
        m = cfg.model
        self.model_cfg = m
        self.tp_group = state.tp
        self.parallel_coords = group_coords(state)    # {group: (rank, size)} for init
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(m.num_layers) if layer_numbers is None else layer_numbers)
        self.sequence_parallel = sp = cfg.parallel.sequence_parallel_active
        self.tied = not m.untie_embeddings_and_output_weights
        # the word embedding is also read on the last stage: tied output, or MTP's inputs
        self.shares_embedding = self.tied or bool(m.mtp_num_layers)
        self.vocab_size = m.vocab_size
        spec = spec or get_layer_spec("local")
        kw = dict(device=device, dtype=params_dtype)

        # --mtp-num-layers: the last stage embeds the shifted tokens itself; off the first
        # stage its embedding is a tied copy of the first stage's (Megatron's approach)
        self.embeds_for_mtp = post_process and bool(m.mtp_num_layers)
        if pre_process or self.embeds_for_mtp:
            self.embedding = LanguageModelEmbedding(m, state.tp, sequence_parallel=sp, **kw)
        self.rotary = mla_rotary(m) if m.multi_latent_attention else \
            RotaryEmbedding.from_config(m)
        self.rotary_local = local_rotary(m)         # Gemma 3: the windowed layers' base
        groups = ModelCommGroups.from_parallel_state(state)
        self.decoder = TransformerBlock(m, groups, spec, layer_numbers=self.layer_numbers,
                                        sequence_parallel=sp, post_layer_norm=post_process,
                                        **kw)
        self.mtp = MultiTokenPrediction(m, groups, spec, sequence_parallel=sp, **kw) \
            if self.embeds_for_mtp else None
        self.fused_loss = False
        if post_process:
            self.output_layer = spec.column_parallel_linear(
                m.hidden_size, m.vocab_size, tp_group=state.tp, bias=False, gather_output=False,
                sequence_parallel=sp, init_std=m.init_method_std,
                pad_multiple=m.make_vocab_size_divisible_by,
                skip_weight_param=self.tied and (hasattr(self, "embedding") or
                                                 bool(self._embedding_of)), **kw)
            # --cross-entropy-loss-fusion: the output layer computes the loss chunk by chunk
            # (``loss_head``); a spec whose output layer cannot is refused, never ignored
            self.fused_loss = bool(m.cross_entropy_loss_fusion)
            if self.fused_loss and not getattr(self.output_layer, "takes_loss_head", False):
                raise ValueError(
                    f"--cross-entropy-loss-fusion: the output layer "
                    f"{type(self.output_layer).__name__} of this layer spec cannot compute the "
                    "loss in chunks; drop the flag")
        # The tied word embedding: the first stage's is the owner; the last stage's output
        # layer holds a copy under the same canonical name (same init and checkpoint entry),
        # whose grad is summed over the 'embedding' group and which the grad norm skips.
        # TE's fused norm weights (linear_qkv.layer_norm_weight, ...) keep their local names
        # With MTP the last stage's own embedding is that copy (the output layer borrows it
        # when tied); an untied output layer is then not part of the tie.
        canonical, tied = canonical_renames(n for n, _ in self.named_parameters()), {}
        if self.shares_embedding and pre_process:
            tied[WORD_EMBEDDING] = TIED_OWNER
            if m.mtp_num_layers:            # the last stage copies the whole embedding
                for name, _ in self.embedding.named_parameters(prefix="embedding"):
                    tied[name] = TIED_OWNER
        elif self.embeds_for_mtp:
            for name, _ in self.embedding.named_parameters(prefix="embedding"):
                tied[name] = TIED_COPY
        elif self.tied and post_process and not self._embedding_of:
            canonical[OUTPUT_WEIGHT], tied[OUTPUT_WEIGHT] = WORD_EMBEDDING, TIED_COPY
        self.param_table = ParamTable.from_module(self, canonical, tied)
        self.input_tensor: Optional[torch.Tensor] = None

    # -- parameters ------------------------------------------------------------------------
    def canonical_named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """(global name, param): names are independent of TP/PP (checkpoints, init seeds)."""
        for name, p, _ in self.param_table.named(self):
            yield name, p

    def initialize(self, seed: int) -> None:
        init_parameters(self.param_table.named(self), seed, self.parallel_coords)

    def shared_embedding_weight(self) -> Optional[nn.Parameter]:
        """The tied word-embedding matrix this chunk holds (None if untied or absent).

        With PP > 1 the first and last stage each hold one (``ParamSpec.tied`` "owner" on
        the first, "copy" on the last); their grads must be summed over
        ``state['embedding']`` before the optimizer step.  At PP = 1 it is a single
        Parameter used by both the embedding and the output layer.
        """
        if not self.shares_embedding:
            return None
        if self.pre_process or self.embeds_for_mtp:
            return self.embedding.word_embeddings.weight
        if self.post_process and not self._embedding_of:
            return self.output_layer.weight
        return None

    def set_input_tensor(self, tensor) -> None:
        """Input of a non-first pipeline chunk: hidden states [s(/tp), b, h]."""
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0]
        self.input_tensor = tensor

    def register_stage_input_hook(self, hook):
        """First chunk: ``hook(tensor)`` sees the embedding output, the activation that
        plays the role of a received stage input (zero bubble splits B/W there). Returns a
        removable handle."""
        if not self.pre_process:
            raise RuntimeError("only the first pipeline chunk computes its stage input")
        return self.embedding.register_forward_hook(lambda _m, _args, out: hook(out))

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.pre_process:
            with EMBEDDING_SITE:
                hidden = self.embedding(input_ids, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("non-first pipeline chunk: call set_input_tensor() first")
            hidden = self.input_tensor
        rotary = None
        if self.rotary is not None:
            seq = hidden.shape[0] * (self.tp_group.size if self.sequence_parallel else 1)
            rotary = self.rotary(seq, position_ids, device=hidden.device)
            if self.rotary_local is not None:
                rotary = LayerRotaries(rotary, self.rotary_local(seq, position_ids,
                                                                 device=hidden.device))
        hidden = self.decoder(hidden, rotary, document_ids)
        if not self.post_process:
            return hidden
        weight = self.embedding.word_embeddings.weight \
            if (self.tied and hasattr(self, "embedding")) else None
        if self.tied and self._embedding_of:
            weight = self._embedding_of[0].embedding.word_embeddings.weight
        if labels is not None and self.mtp is not None and self.training:
            self._mtp_losses(hidden, input_ids, position_ids, labels, loss_mask, rotary, weight,
                             document_ids)
        with OUTPUT_SITE:
            if labels is None:
                return self._capped(self.output_layer(hidden, weight=weight)).transpose(0, 1)
            return self._token_loss(hidden, weight, labels, loss_mask)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """``--final-logit-softcapping`` (Gemma 2): cap * tanh(logits / cap), elementwise, so
        a vocabulary shard caps alone and padded columns stay 0."""
        cap = self.model_cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _token_loss(self, hidden, weight, labels, loss_mask) -> torch.Tensor:
        """Per-token loss [b, s] of ``hidden`` [s(/tp), b, h] against ``labels`` [b, s]."""
        if self.fused_loss:     # logits never held whole
            head = functools.partial(
                fused_linear_cross_entropy, labels=labels.t(), group=self.tp_group,
                vocab_size=self.vocab_size, sequence_parallel=self.sequence_parallel,
                token_weights=None if loss_mask is None else loss_mask.t(),
                chunk_tokens=self.model_cfg.cross_entropy_chunk_tokens,
                softcap=self.model_cfg.final_logit_softcapping)
            return self.output_layer(hidden, weight=weight, loss_head=head).t()
        logits = self._capped(self.output_layer(hidden, weight=weight))   # [s, b, v/tp]
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.vocab_size,
                                            inplace=True)                 # [s, b]
        return loss.t()

    def _mtp_losses(self, hidden, input_ids, position_ids, labels, loss_mask, rotary,
                    weight, document_ids=None) -> None:
        """Each MTP depth's mean loss over its micro-batch tokens, into the extra-loss
        channel (``transformer/mtp.py``): depth k's target of position i is labels[i + k]."""
        m = self.model_cfg
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None \
            else loss_mask.float()
        share = mtp_depth_weight(m.mtp_loss_scaling_factor, m.mtp_num_layers)
        for depth, h in enumerate(self.mtp(hidden, input_ids, position_ids, self.embedding,
                                           rotary, document_ids), start=1):
            labels, mask = roll_left(labels), roll_left(mask)
            per_token = self._token_loss(h, weight, labels, mask)
            loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
            add_extra_loss(mtp_loss_name(depth), loss, weight=share)


def build_chunk(cfg, state, pre_process: bool = True, post_process: bool = True,
                layer_numbers: Optional[Sequence[int]] = None, *, rng_tracker=None,
                device=None, dtype: Optional[torch.dtype] = None,
                params_dtype: torch.dtype = torch.float32,
                embedding_of: Optional[nn.Module] = None) -> GPTModel:
    """The one GPT builder: a chunk's structure from the run's spec choices, then the
    parallelize step (``models/parallelize.py``) into ``dtype`` on ``device`` (unchanged
    when None).  With --use-torch-fsdp2 the structure is built on the meta device and only
    this rank's shards are ever allocated.  ``build_model`` and the model family's
    ``build_model_chunks`` (``models/stages.py``) place chunks through it."""
    fsdp = cfg.parallel.use_torch_fsdp2
    if fsdp and device is None:
        device = torch.empty(0).device          # where the chunk would have been built
    chunk = GPTModel(cfg, state, pre_process, post_process, layer_numbers,
                     spec=spec_choices(cfg, state), device="meta" if fsdp else device,
                     params_dtype=params_dtype, embedding_of=embedding_of)
    return parallelize_chunk(chunk, cfg, state, rng_tracker=rng_tracker, device=device,
                             dtype=dtype)


def build_model(cfg, state, **kwargs) -> GPTModel:
    """The whole model on one pipeline stage (all layers, embedding and head), parallelized."""
    return build_chunk(cfg, state, True, True, list(range(cfg.model.num_layers)), **kwargs)


def single_rank_state():
    """A ParallelState of one rank with no process groups (reference models, tools)."""
    return ParallelState.build(RankGrid(1), 0, create_groups=False)


def parameter_specs(model_cfg) -> Dict[str, ParamSpec]:
    """Canonical name -> ParamSpec of every parameter of the full model (no allocation)."""
    cfg, state = MegaliteConfig(model=model_cfg), single_rank_state()
    model = GPTModel(cfg, state, spec=spec_choices(cfg, state), device="meta")
    return dict(model.param_table.specs)
