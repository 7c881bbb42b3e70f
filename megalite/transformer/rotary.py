"""Rotary position embeddings, Hugging Face's ``rotate_half`` convention, and their
frequency scalings (Llama 3.x's ``llama3``, YaRN).

Frequencies pair dimension i with i + d/2 (not adjacent pairs), which is also
Megatron's default (non-interleaved) layout, so Llama weights convert without
permuting q/k rows.  cos/sin are computed in fp32 exactly as transformers does.

The frequency functions are plain functions of numbers, reusable by any attention that
rotates (Multi-Latent Attention rotates only its ``--qk-pos-emb-head-dim`` part):

* ``default_inv_freq(dim, base)``: 1 / base^(2i/dim), i < dim/2;
* ``llama3_inv_freq(inv_freq, ...)``: Llama 3.1's rescaling of those;
* ``yarn_inv_freq(dim, base, factor, ...)``: YaRN's blend of interpolated and original
  frequencies, and ``yarn_concentration_factor`` (the "attention factor" / mscale that
  multiplies cos and sin); ``yarn_get_mscale`` is the log rule both use (DeepSeek-V3's
  softmax scale is ``softmax_scale * yarn_get_mscale(factor, mscale_all_dim) ** 2``);
* ``rotary_frequencies(model_cfg, dim, kind)``: (inv_freq, attention factor) of a config's
  scaling flags, for ``kind`` rope or yarn (default: its ``--position-embedding-type``);
  ``RotaryEmbedding.from_config(model_cfg, dim, kind)`` builds the cos/sin module from it.

Partial rotary (``--rotary-percent`` p < 1; HF's ``partial_rotary_factor``, GLM-4.5, Phi-4-mini,
Qwen3-Next): the tables cover ``rotary_dim(kv_channels, p)`` = int(d * p) channels, and
``apply_rotary`` rotates the leading that-many channels of each head (half-split pairs
i, i + rot/2 inside them) and passes the rest through, as HF's ``apply_rotary_pos_emb`` of
those families and Megatron-Core's ``_apply_rotary_pos_emb_bshd`` do.  The rotated width is
read off cos/sin, so every attention path (local, context-parallel, TE core attention) gets
it from the one table.

Each follows ``transformers.modeling_rope_utils`` operation for operation (and equals
Megatron-Core's ``RotaryEmbedding._apply_scaling`` / ``YarnRotaryEmbedding``), so imported
Hugging Face models see bit-identical tables.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from megalite.config.domain_checks import rotary_dim

# Defaults Megatron-Core uses when a YaRN flag is not given.
YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """fp32 [dim/2]: 1 / base^(2i / dim)."""
    return 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int
                    ) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than original/low_freq_factor are divided by
    ``factor``, shorter than original/high_freq_factor kept, a linear blend between."""
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float,
                         max_position_embeddings: int) -> float:
    """The dimension whose frequency turns ``num_rotations`` times over the context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / \
        (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                          original_max_position_embeddings: int, round_to_int: bool = True
                          ) -> Tuple[float, float]:
    """(low, high) dimension indices of YaRN's ramp, clamped to [0, dim - 1]."""
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, factor: float,
                  original_max_position_embeddings: int = YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
                  beta_fast: float = YARN_BETA_FAST, beta_slow: float = YARN_BETA_SLOW,
                  round_to_int: bool = True) -> torch.Tensor:
    """fp32 [dim/2]: YaRN's frequencies -- original ones (extrapolation) for the dimensions
    that turn more than ``beta_fast`` times over the original context, divided by
    ``factor`` (interpolation) for those under ``beta_slow``, a linear ramp between."""
    pos_freqs = float(base) ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base,
                                      original_max_position_embeddings, round_to_int)
    if low == high:
        high += 0.001                       # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature rule: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(factor: float, mscale: Optional[float] = 1.0,
                              mscale_all_dim: Optional[float] = 0.0) -> float:
    """The factor multiplying YaRN's cos and sin (Megatron-Core's rule):
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); with either None,
    get_mscale(factor)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(factor)
    return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))


def rotary_frequencies(model_cfg, dim: Optional[int] = None, kind: Optional[str] = None
                       ) -> Tuple[torch.Tensor, float]:
    """(inv_freq fp32 [dim/2], factor on cos and sin) for ``model_cfg``'s rotary flags.
    ``kind``: ``rope`` (with ``--use-rope-scaling``: Llama 3.x) or ``yarn`` (the
    ``--rotary-scaling-factor`` / ``--yarn-*`` / ``--mscale*`` flags); default: the
    ``--position-embedding-type``.  ``dim``: the rotated head dimension (default
    ``--rotary-percent`` of ``--kv-channels``; an attention rotating a part of its heads of
    its own, as MLA, passes that part's size)."""
    m = model_cfg
    dim = dim or rotary_dim(m.resolved_kv_channels(), m.rotary_percent)
    kind = kind or m.position_embedding_type
    if kind not in ("rope", "yarn"):
        raise ValueError(f"rotary frequencies of '{kind}': rope or yarn")
    if kind == "yarn":
        inv_freq = yarn_inv_freq(
            dim, m.rotary_base, m.rotary_scaling_factor,
            m.yarn_original_max_position_embeddings or YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
            YARN_BETA_FAST if m.yarn_beta_fast is None else m.yarn_beta_fast,
            YARN_BETA_SLOW if m.yarn_beta_slow is None else m.yarn_beta_slow,
            m.yarn_correction_range_round_to_int)
        return inv_freq, yarn_concentration_factor(m.rotary_scaling_factor, m.mscale,
                                                   m.mscale_all_dim)
    inv_freq = default_inv_freq(dim, m.rotary_base)
    if m.use_rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, m.rope_scaling_factor,
                                   m.rope_scaling_low_freq_factor,
                                   m.rope_scaling_high_freq_factor,
                                   m.rope_scaling_original_max_position_embeddings)
    if m.rotary_seq_len_interpolation_factor:   # linear scaling (transformers' operation)
        inv_freq = inv_freq / m.rotary_seq_len_interpolation_factor
    return inv_freq, 1.0


def query_temperature(positions: torch.Tensor, floor_scale: int, scale: float) -> torch.Tensor:
    """Llama 4's NoPE-layer query scale at ``positions``: 1 + scale * log(1 + floor((p + 1) /
    floor_scale)), fp32, operation for operation as transformers' ``Llama4TextAttention``."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0


class PositionTables(tuple):
    """(cos, sin), as every rotating attention unpacks them, carrying ``query_scale`` [b|1, s]
    (fp32): ``--attn-temperature-tuning``'s factor on the queries of the NoPE layers, from the
    same positions the tables are of.  A NoPE layer gets ``without_rotation()``: no tables,
    the scale kept."""

    def __new__(cls, cos, sin, query_scale: Optional[torch.Tensor] = None):
        tables = super().__new__(cls, (cos, sin))
        tables.query_scale = query_scale
        return tables

    def without_rotation(self) -> Optional["PositionTables"]:
        return None if self.query_scale is None else PositionTables(None, None, self.query_scale)


def nope_tables(rotary) -> Optional[PositionTables]:
    """What a layer without RoPE (``--no-rope-freq``) receives of ``rotary``: None, or the
    query temperature alone."""
    return rotary.without_rotation() if isinstance(rotary, PositionTables) else None


class RotaryEmbedding(nn.Module):
    """cos/sin tables of positions; ``inv_freq`` and ``attention_scaling`` (the factor on
    cos and sin, YaRN's) default to plain RoPE of ``head_dim`` and ``base``."""

    def __init__(self, head_dim: int, base: float = 10000, *,
                 inv_freq: Optional[torch.Tensor] = None, attention_scaling: float = 1.0):
        super().__init__()
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it.
        self.inv_freq = default_inv_freq(head_dim, base) if inv_freq is None else inv_freq
        self.attention_scaling = float(attention_scaling)
        self.query_temperature: Optional[Tuple[int, float]] = None  # (floor scale, scale)
        self._cache = None

    @classmethod
    def from_config(cls, model_cfg, dim: Optional[int] = None, kind: Optional[str] = None
                    ) -> Optional["RotaryEmbedding"]:
        """The embedding ``model_cfg`` asks for (None without rotary position embeddings
        unless ``kind`` names one); ``dim``, ``kind`` as ``rotary_frequencies``."""
        if kind is None and not model_cfg.uses_rotary():
            return None
        dim = dim or rotary_dim(model_cfg.resolved_kv_channels(), model_cfg.rotary_percent)
        inv_freq, scaling = rotary_frequencies(model_cfg, dim, kind)
        emb = cls(dim, inv_freq=inv_freq, attention_scaling=scaling)
        if getattr(model_cfg, "attn_temperature_tuning", False) and kind is None:
            emb.query_temperature = (int(model_cfg.attn_temperature_floor_scale),
                                     float(model_cfg.attn_temperature_scale))
        return emb

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor] = None,
                device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape [b or 1, 1, s, d], ready for [b, heads, s, d] tensors; with
        ``--attn-temperature-tuning`` a ``PositionTables`` carrying the NoPE query scale."""
        device = device or self.inv_freq.device
        if position_ids is None:
            key = (seq_len, str(device))
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1]
            pos = torch.arange(seq_len, device=device)[None]
        else:
            pos = position_ids.to(device)
        freqs = pos[..., None].float() * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:       # YaRN: fp32, before any cast (as HF)
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        out = (cos[:, None], sin[:, None])
        if self.query_temperature is not None:
            out = PositionTables(*out, query_temperature(pos, *self.query_temperature))
        if position_ids is None:
            self._cache = (key, out)
        return out


def _rotate(x, c, s, sign: float):
    """[x1 c - sign x2 s, x2 c + sign x1 s, x_pass], written straight into a contiguous output;
    x1, x2 the halves of the first 2 * c.shape[-1] channels (all of them unless partial
    rotary), x_pass the rest, unchanged."""
    half = c.shape[-1]
    x1, x2, xp = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    if torch.compiler.is_compiling():
        # --compile: writing through out= views of one buffer breaks dynamo's graph (and the
        # resumed graph then has aliased inputs); the same products and sums, functionally.
        if sign > 0:
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xp), dim=-1)
        return torch.cat((x1 * c + x2 * s, x2 * c - x1 * s, xp), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:2 * half]
    if xp.shape[-1]:
        out[..., 2 * half:].copy_(xp)
    torch.mul(x1, c, out=o1)
    torch.mul(x2, c, out=o2)
    if sign > 0:
        o1.sub_(x2 * s)
        o2.add_(x1 * s)
    else:
        o1.add_(x2 * s)
        o2.sub_(x1 * s)
    return out


class _ApplyRotary(torch.autograd.Function):
    """out = [x1 c - x2 s, x2 c + x1 s, x_pass] (c, s: first half of cos/sin; x_pass: the
    channels past cos's width, partial rotary).

    Equal bit for bit to HF's ``x * cos + rotate_half(x) * sin`` (same products, same
    additions).  As one autograd node, backward is the inverse rotation of the grad, with
    no zero-filled slice grads and no concatenation.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = cos.shape[-1] // 2
        c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s, 1.0)

    @staticmethod
    def backward(ctx, grad):
        c, s = ctx.saved_tensors
        return _rotate(grad, c, s, -1.0), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., s, d] by cos/sin [..., s, rot] broadcastable to it (rot <= d: the
    leading rot channels rotate, the rest pass through); output is contiguous."""
    return _ApplyRotary.apply(x, cos, sin)


class LayerRotaries:
    """The cos/sin of a model whose windowed layers rotate with their own base (Gemma 3's
    ``--rotary-base-local``): ``full`` for the full-attention layers, ``local`` for the
    windowed ones; each layer takes its own (``transformer/layer.py``).  Not a tuple, so
    it never unpacks as one (cos, sin) pair by mistake."""

    def __init__(self, full, local):
        self.full, self.local = full, local


def local_rotary(model_cfg) -> Optional[RotaryEmbedding]:
    """``--rotary-base-local``'s plain RoPE (no scaling), None when not given."""
    if model_cfg.rotary_base_local is None or not model_cfg.uses_rotary():
        return None
    return RotaryEmbedding(model_cfg.resolved_kv_channels(), model_cfg.rotary_base_local)
