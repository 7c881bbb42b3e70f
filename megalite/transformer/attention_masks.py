"""Which (query, key) pairs attention keeps beyond causality: the documents of a packed
sequence (``--reset-attention-mask``) and a sliding window (``--window-size``: query i sees
keys i-w .. i, on the layers ``ModelConfig.layer_window`` names).

A packed sample holds several documents separated by the tokenizer's end-of-document token
(EOD).  Megatron's ``get_ltor_masks_and_position_ids`` semantics: the EOD belongs to the
document it ends, the token after it starts a new one; with ``--reset-attention-mask`` a
query attends only to keys of its own document, with ``--reset-position-ids`` positions
restart at 0 in each document.  Documents are carried as ``document_ids`` [b, s]: the
index of each token's document in its sample, non-decreasing along the sequence, for the
WHOLE sequence (context parallelism does not slice them: each CP rank knows which
positions it and every other rank hold, ``context_parallel/load_balance.py``).

Chunked local attention (``--attention-chunk-size C``, Llama 4; on the layers
``ModelConfig.layer_chunk`` names): query i sees only keys of its own chunk of C sequence
positions.  A chunk is a document of fixed length, so ``chunk_documents`` folds the chunks
into the document ids (same document and same chunk), and every path that honours
documents honours chunks: the local kernels, ring attention (a block pair of two
different chunks is skipped), all-to-all attention, and TE's packed (THD) format without CP.

Every core attention reads the one rule here through its layer's ``LayerMask`` (``keep``):
the local kernels as a boolean or additive mask, ring attention per block pair (and to skip
a pair none of whose queries shares a document with its keys), all-to-all attention on the
gathered sequence.  So a new mask is its per-layer value (``ModelConfig.layer_*``), its rule
here and its entry in config/attention_variants.py -- not a change to each core attention.
"""
from __future__ import annotations

from typing import Optional

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: how many EODs precede each token in its sample (the EOD itself belongs
    to the document it ends)."""
    ends = (tokens == eod).to(torch.int64)
    return ends.cumsum(-1) - ends


def document_position_ids(docs: torch.Tensor) -> torch.Tensor:
    """[b, s] positions that restart at 0 where a document starts (``--reset-position-ids``)."""
    s = docs.shape[-1]
    idx = torch.arange(s, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def keep(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
         q_docs: Optional[torch.Tensor] = None, k_docs: Optional[torch.Tensor] = None,
         window: Optional[int] = None) -> Optional[torch.Tensor]:
    """Boolean [b|1, sq, sk]: True where query (sequence position ``q_pos`` [sq], document
    ``q_docs`` [b, sq]) may attend key (``k_pos`` [sk], ``k_docs`` [b, sk]), the key at most
    ``window`` positions back.  None when nothing beyond the plain causal / unmasked rule
    applies (the caller's fast path)."""
    if q_docs is None and window is None:
        return None
    back = q_pos[None, :, None] - k_pos[None, None, :]                   # [1, sq, sk]
    ok = torch.ones(back.shape, dtype=torch.bool, device=back.device)
    if causal:
        ok = back >= 0
    if window is not None:
        ok = ok & (back <= window)
    if q_docs is not None:
        ok = ok & (q_docs[:, :, None] == k_docs[:, None, :])
    return ok


class LayerMask:
    """The (query, key) rules of one layer beyond causality: the ones given as documents
    (``documents``: Llama 4's chunks, folded into the ids before core attention, so that
    every backend that honours documents honours them -- TE's THD format included) and the
    rest (``keep``: a sliding window), which every core attention asks with the true
    sequence positions of both sides.  ``SelfAttention`` and each core attention hold one
    (``LayerMask(cfg, layer)``)."""

    def __init__(self, model_cfg, layer: int):
        self.window = model_cfg.layer_window(layer)   # --window-size on this layer
        self.chunk = model_cfg.layer_chunk(layer)     # --attention-chunk-size on this layer

    def documents(self, docs: Optional[torch.Tensor], seq: int, batch: int,
                  device) -> Optional[torch.Tensor]:
        """The document ids [b, seq] core attention is handed (``seq``: the WHOLE sequence,
        all CP ranks): ``docs`` with this layer's chunks folded in."""
        if self.chunk is None:    # chunked attention: a chunk is a fixed-length document
            return docs
        return chunk_documents(docs, seq, self.chunk, batch, device)

    @property
    def masks_alone(self) -> bool:
        """Whether it masks pairs even without documents (else: None is the fast path)."""
        return self.window is not None

    def keep(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
             q_docs: Optional[torch.Tensor] = None,
             k_docs: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``keep`` with this layer's rule: boolean [b|1, sq, sk] or None (plain causal)."""
        return keep(q_pos, k_pos, causal, q_docs, k_docs, self.window)


def chunk_documents(docs: Optional[torch.Tensor], seq: int, chunk: int, batch: int,
                    device=None) -> torch.Tensor:
    """[b, seq] int64 document ids that also change at every ``chunk``-th sequence position:
    equal for two tokens exactly when they share the document (``docs`` [b, seq] or None:
    one) and the chunk.  Non-decreasing along the sequence, as document ids are."""
    chunks = torch.arange(seq, device=device if docs is None else docs.device) // chunk
    if docs is None:
        return chunks.expand(batch, seq)
    return docs * ((seq - 1) // chunk + 1) + chunks


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as scores to add: 0 kept, -inf dropped."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def mark_documents(batch: dict, eod: int, reset_position_ids: bool,
                   reset_attention_mask: bool) -> dict:
    """A collated micro-batch with its documents: ``position_ids`` restarted per document
    (``--reset-position-ids``) and ``document_ids`` for the attention mask
    (``--reset-attention-mask``).  The training loop applies it once per micro-batch, before
    ``get_batch`` slices the sequence for context parallelism."""
    docs = document_ids(batch["tokens"], eod)
    out = dict(batch)
    if reset_position_ids:
        out["position_ids"] = document_position_ids(docs)
    if reset_attention_mask:
        out["document_ids"] = docs
    return out


def document_offsets(docs: torch.Tensor):
    """(cu_seqlens int32 [n + 1], longest document): the n documents of the micro-batch
    laid back to back, sample by sample -- the packed (THD) format of varlen kernels."""
    b, s = docs.shape
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat([first, first.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())
