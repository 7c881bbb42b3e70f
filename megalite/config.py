"""Configuration dataclasses: the single source of truth for every setting.

Each field carries its Megatron-LM flag name and help text in ``metadata`` so that
``megalite.arguments`` can generate the command line from these classes instead of
keeping a second list of options in sync by hand.  Fields whose names already match
Megatron's flag (underscores -> dashes) need no explicit ``flag``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the flag and the fix.

    Defined beside the dataclasses (not in ``arguments``) so that validation and the planner
    can raise it without importing the command-line layer that calls them."""


def opt(default: Any = None, help: str = "", *, flag: Optional[str] = None,
        choices: Optional[list] = None, action: Optional[str] = None,
        nargs: Optional[str] = None, aliases: tuple = (), type: Optional[Callable] = None):
    """A dataclass field that knows how to present itself on the command line
    (``type``: the flag's parser when the annotation alone does not say it)."""
    meta = {"help": help, "flag": flag, "choices": choices, "action": action,
            "nargs": nargs, "aliases": aliases, "type": type}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: list(default) if isinstance(default, list)
                     else dict(default), metadata=meta)
    return field(default=default, metadata=meta)


class MoeLayerFreqError(argparse.ArgumentTypeError, ValueError):
    """A bad --moe-layer-freq; argparse prints its message as is."""


def _list_pattern(node) -> list:
    """Evaluate a list expression of int literals, ``+`` and ``*`` (no ``eval``)."""
    if isinstance(node, ast.List):
        values = [_list_pattern(e) for e in node.elts]
        if not all(isinstance(v, int) for v in values):
            raise MoeLayerFreqError("list entries must be 0 or 1")
        return values
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_pattern(node.left), _list_pattern(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            return left * right
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
    raise MoeLayerFreqError("use a list of 0/1 with + and *, e.g. '[1,0]*2' or '([1]*3+[0])*2'")


def parse_moe_layer_freq(value) -> Union[int, List[int]]:
    """``--moe-layer-freq`` as Megatron reads it: an int N (layers 0, N, 2N, ... are MoE) or a
    pattern with one 0/1 per layer, written as a Python list expression ("[1,0]*2")."""
    if isinstance(value, bool):
        raise MoeLayerFreqError(f"--moe-layer-freq: expected an int or a 0/1 list, got {value}")
    if isinstance(value, int):
        if value < 1:
            raise MoeLayerFreqError(f"--moe-layer-freq must be >= 1, got {value}")
        return value
    if isinstance(value, (list, tuple)):
        pattern = list(value)
    else:
        text = str(value).strip()
        if "[" not in text:
            try:
                number = int(text)
            except ValueError:
                raise MoeLayerFreqError(f"--moe-layer-freq: '{text}' is neither an int nor "
                                        "a list pattern") from None
            return parse_moe_layer_freq(number)
        try:
            pattern = _list_pattern(ast.parse(text, mode="eval").body)
        except SyntaxError:
            raise MoeLayerFreqError(f"--moe-layer-freq: cannot parse '{text}'") from None
        if not isinstance(pattern, list):
            raise MoeLayerFreqError(f"--moe-layer-freq: '{text}' is not a list")
    if any(type(v) is not int or v not in (0, 1) for v in pattern):
        raise MoeLayerFreqError(f"--moe-layer-freq: pattern entries must be 0 or 1, got {pattern}")
    return pattern


@dataclass
class ModelConfig:
    """Network shape and architecture switches (Megatron's 'network size' group)."""
    num_layers: Optional[int] = opt(None, "Number of transformer layers.")
    hidden_size: Optional[int] = opt(None, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = opt(
        None, "MLP hidden size; default 4*hidden, or Llama's 8/3*hidden rounded when --swiglu.")
    num_attention_heads: Optional[int] = opt(None, "Number of attention heads.")
    group_query_attention: bool = opt(False, "Use grouped-query attention.", action="store_true")
    num_query_groups: Optional[int] = opt(
        None, "Number of key/value head groups with --group-query-attention.")
    kv_channels: Optional[int] = opt(None, "Per-head dimension; default hidden/heads.")
    seq_length: Optional[int] = opt(None, "Sequence length of each training sample.")
    max_position_embeddings: Optional[int] = opt(
        None, "Size of the learned position table; default --seq-length.")
    vocab_size: Optional[int] = opt(
        None, "Vocabulary size (NullTokenizer / mock data); otherwise taken from the tokenizer.")
    make_vocab_size_divisible_by: int = opt(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    normalization: str = opt("LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalization layers.")
    position_embedding_type: str = opt(
        "learned_absolute", "Position embedding.", choices=["learned_absolute", "rope", "none"])
    rotary_base: int = opt(10000, "Base period of rotary position embeddings.")
    rotary_percent: float = opt(1.0, "Fraction of each head's channels rotated (1.0 only here).")
    apply_layernorm_1p: bool = opt(
        False, "Zero-centred norm weights: stored as w - 1 (initialised to 0), applied as "
        "1 + w (LayerNorm and RMSNorm).",
        action="store_true")
    swiglu: bool = opt(False, "Use SwiGLU in the MLP (gated SiLU).", action="store_true")
    untie_embeddings_and_output_weights: bool = opt(
        False, "Give the output layer its own weight instead of the input embedding.",
        action="store_true")
    add_bias_linear: bool = opt(True, "Disable biases in linear layers.",
                                flag="--disable-bias-linear", action="store_false")
    init_method_std: float = opt(0.02, "Std of the normal initialization.")
    hidden_dropout: float = opt(0.1, "Dropout after attention and MLP outputs.")
    attention_dropout: float = opt(0.1, "Dropout on attention probabilities.")
    attention_backend: str = opt(
        "auto", "Core-attention kernel. Local layers: 'flash' / 'fused' (PyTorch SDPA), "
        "'unfused' / 'local' (explicit matmuls and softmax), 'auto' (unfused on CPU for short "
        "sequences, where it is faster; SDPA otherwise). Transformer Engine: its flash, fused "
        "or unfused kernel (NVTE_* switches, as Megatron), 'auto' = TE's choice.",
        choices=["auto", "flash", "fused", "unfused", "local"])
    # Mixture of experts.
    num_experts: Optional[int] = opt(None, "Number of routed experts (MoE); none = dense.")
    moe_router_topk: int = opt(2, "Experts each token is routed to.")
    moe_ffn_hidden_size: Optional[int] = opt(None, "Hidden size of each expert MLP.")
    moe_aux_loss_coeff: float = opt(0.0, "Load-balancing loss coefficient.")
    moe_layer_freq: Union[int, list] = opt(
        1, "MoE layers: every n-th layer from layer 0, or a 0/1 pattern with one entry per "
        "layer, e.g. '[1,0]*2' (Megatron's form).", type=parse_moe_layer_freq)
    moe_router_score_function: str = opt("softmax", "Router score: softmax or sigmoid.",
                                         choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = opt(
        False, "Softmax over all experts before top-k (else softmax over the top-k logits).",
        action="store_true")
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "Load balancing: aux_loss (per micro-batch), seq_aux_loss (per sequence) or "
        "none.", choices=["aux_loss", "seq_aux_loss", "none"])
    moe_z_loss_coeff: Optional[float] = opt(None, "Router z-loss coefficient (none = off).")
    moe_router_enable_expert_bias: bool = opt(
        False, "DeepSeek-V3 aux-loss-free balancing: a per-expert bias added to the scores "
        "for top-k selection only, nudged after each step.", action="store_true")
    moe_router_bias_update_rate: float = opt(1e-3, "Step of the expert-bias update.")
    moe_router_num_groups: Optional[int] = opt(
        None, "Group-limited routing (DeepSeek-V3): experts form this many equal groups "
        "(e.g. one per EP rank or node); each token picks --moe-router-group-topk groups first.")
    moe_router_group_topk: Optional[int] = opt(
        None, "Groups each token may use with --moe-router-num-groups (ranked by the sum of "
        "their top topk/group-topk scores).")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "Expert capacity = factor x tokens x topk / experts; extra tokens are dropped "
        "(none = no dropping).")
    moe_token_drop_policy: str = opt("probs", "Which tokens an over-full expert drops: lowest "
                                     "probability (probs) or latest (position).",
                                     choices=["probs", "position"])
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "Hidden size of the shared expert (a dense MLP every token goes through).")
    moe_token_dispatcher_type: str = opt("alltoall", "Token dispatch over the EP group.",
                                         choices=["alltoall", "allgather"])
    transformer_impl: str = opt(
        "auto", "Hot-layer implementation: 'local' (pure PyTorch), 'transformer_engine', or "
        "'auto' (TE when CUDA and TE are present).", choices=["auto", "local", "transformer_engine"])
    fp8_format: Optional[str] = opt(
        None, "FP8 GEMMs through Transformer Engine: e4m3 (forward and backward) or hybrid "
        "(e4m3 forward, e5m2 gradients); needs TE on a CUDA GPU with FP8.",
        choices=["e4m3", "hybrid"])
    fp8_amax_history_len: int = opt(1, "FP8 delayed scaling: amax history length.")
    fp8_amax_compute_algo: str = opt("most_recent", "FP8 delayed scaling: scale from the "
                                     "most recent amax or the max of the history.",
                                     choices=["most_recent", "max"])
    # Fused output layer + cross entropy (tensor_parallel/fused_cross_entropy.py).
    cross_entropy_loss_fusion: bool = opt(
        False, "Compute the output layer and the vocab-parallel loss chunk by chunk over "
        "tokens, never holding the whole fp32 logits.", action="store_true")
    cross_entropy_chunk_tokens: int = opt(
        0, "Tokens per chunk of --cross-entropy-loss-fusion (0: about 32 MiB of fp32 logits).")

    # ---- derived values -------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) holds experts: the one rule the model
        spec, the planner and the FLOP count all use."""
        if not self.num_experts:
            return False
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        if isinstance(freq, int):
            return layer % freq == 0
        if len(freq) != self.num_layers:
            raise ValueError(f"--moe-layer-freq pattern has {len(freq)} entries for "
                             f"{self.num_layers} layers")
        return bool(freq[layer])

    def resolved_moe_ffn_hidden_size(self) -> int:
        """Hidden size of one routed expert (``--moe-ffn-hidden-size``, else the MLP's)."""
        return self.moe_ffn_hidden_size or self.resolved_ffn_hidden_size()

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:  # Llama's rule: 2/3 of 4h, rounded up to a multiple of 64.
            return int(math.ceil(int(8 * self.hidden_size / 3) / 64) * 64)
        return 4 * self.hidden_size

    def resolved_kv_channels(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def resolved_query_groups(self) -> int:
        if self.group_query_attention and self.num_query_groups:
            return self.num_query_groups
        return self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Megatron's rule: round the vocabulary up to a multiple of divisor * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    """Sizes of every parallel dimension; DP is derived from the world size."""
    tensor_model_parallel_size: int = opt(1, "Tensor-parallel size (TP).", aliases=("--tp",))
    pipeline_model_parallel_size: int = opt(1, "Pipeline-parallel size (PP).", aliases=("--pp",))
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(
        None, "Layers per virtual pipeline stage (interleaved 1F1B).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = opt(
        None, "Virtual pipeline stages per rank (VPP); alternative to the flag above.")
    decoder_first_pipeline_num_layers: Optional[int] = opt(
        None, "Layers on the first pipeline stage (uneven split).")
    decoder_last_pipeline_num_layers: Optional[int] = opt(
        None, "Layers on the last pipeline stage (uneven split).")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "Count the input embedding as one pipeline layer: the first virtual stage of "
        "the first pipeline rank holds one transformer layer fewer.", action="store_true")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "Count the output layer and loss as one pipeline layer: the last virtual stage "
        "of the last pipeline rank holds one transformer layer fewer.", action="store_true")
    pipeline_schedule: str = opt(
        "auto", "Pipeline schedule: auto picks 1F1B, or interleaved with virtual stages.",
        choices=["auto", "1f1b", "interleaved", "zero-bubble"])
    context_parallel_size: int = opt(1, "Context-parallel size (CP).", aliases=("--cp",))
    cp_comm_type: str = opt("p2p", "Context-parallel communication: ring (p2p) or all-to-all.",
                            choices=["p2p", "a2a"])
    expert_model_parallel_size: int = opt(1, "Expert-parallel size (EP).", aliases=("--ep",))
    expert_tensor_parallel_size: Optional[int] = opt(
        None, "Tensor-parallel size inside experts; default = --tensor-model-parallel-size.")
    sequence_parallel: bool = opt(False, "Shard norms/dropout along the sequence over TP ranks.",
                                  action="store_true")
    use_distributed_optimizer: bool = opt(
        False, "Shard optimizer states (and gradients) over data-parallel ranks (ZeRO-1/2).",
        action="store_true")
    # -- data-parallel communication (issue 12; docs/data_parallel.md) --
    overlap_grad_reduce: bool = opt(
        False, "Reduce gradients in buckets, each launched asynchronously as soon as its last "
        "gradient of the step is accumulated (overlaps backward).", action="store_true")
    ddp_bucket_size: Optional[int] = opt(
        None, "Elements per gradient bucket with --overlap-grad-reduce "
        "(default: max(40M, 1M x DP), as Megatron-Core).")
    overlap_param_gather: bool = opt(
        False, "Distributed optimizer: wait for a bucket's parameter all-gather just before "
        "its first forward use in the next iteration (needs --overlap-grad-reduce).",
        action="store_true")
    use_torch_fsdp2: bool = opt(
        False, "ZeRO-3 through torch FSDP2 (fully_shard) over DP: one unit per transformer "
        "layer, the embedding and the output layer.", action="store_true")
    distributed_backend: str = opt("auto", "Collective backend; auto = nccl on CUDA, gloo on CPU.",
                                   choices=["auto", "nccl", "gloo"])
    distributed_timeout_minutes: float = opt(
        10, "Timeout of collectives: a hung peer becomes an error after this long.")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def sequence_parallel_active(self) -> bool:
        """Whether activations are actually split along the sequence: ``--sequence-parallel``
        has no effect without TP (Megatron's rule).  Derived, so the parsed flag stays as
        given; every reader that means "are we sharding the sequence" asks this."""
        return bool(self.sequence_parallel) and self.tp > 1

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def pipeline_slots(self, num_layers: int) -> int:
        """Layers the pipeline split counts: transformer layers plus the embedding and/or
        the loss when ``--account-for-embedding/loss-in-pipeline-split`` (Megatron)."""
        return num_layers + int(self.account_for_embedding_in_pipeline_split) + \
            int(self.account_for_loss_in_pipeline_split)

    def virtual_stages(self, num_layers: Optional[int]) -> int:
        """VPP size (1 when not interleaving)."""
        if self.num_virtual_stages_per_pipeline_rank:
            return self.num_virtual_stages_per_pipeline_rank
        if self.num_layers_per_virtual_pipeline_stage and num_layers:
            return self.pipeline_slots(num_layers) // (
                self.pp * self.num_layers_per_virtual_pipeline_stage)
        return 1


@dataclass
class OptimizerConfig:
    """AdamW, mixed precision, clipping and the learning-rate schedule."""
    optimizer: str = opt("adam", "Optimizer (AdamW).", choices=["adam", "sgd"])
    lr: Optional[float] = opt(None, "Peak learning rate.")
    min_lr: float = opt(0.0, "Learning rate floor after decay.")
    lr_decay_style: str = opt("linear", "Decay style (Megatron-Core's OptimizerParamScheduler).",
                              choices=["constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"])
    lr_decay_iters: Optional[int] = opt(None, "Iterations to decay over; default --train-iters.")
    lr_decay_samples: Optional[int] = opt(
        None, "Samples to decay over (--train-samples runs); default --train-samples.")
    lr_warmup_iters: int = opt(0, "Linear warmup iterations.")
    lr_warmup_samples: int = opt(0, "Linear warmup samples (--train-samples runs).")
    lr_warmup_fraction: Optional[float] = opt(None, "Warmup as a fraction of the decay steps.")
    lr_warmup_init: float = opt(0.0, "Learning rate at the start of warmup.")
    lr_wsd_decay_iters: Optional[int] = opt(
        None, "WSD: iterations of the final decay phase (default: 10%% of the decay).")
    lr_wsd_decay_samples: Optional[int] = opt(
        None, "WSD: samples of the final decay phase (--train-samples runs).")
    lr_wsd_decay_style: str = opt("linear", "WSD: shape of the final decay.",
                                  choices=["linear", "cosine", "exponential", "minus_sqrt"])
    decoupled_lr: Optional[float] = opt(
        None, "Separate peak lr for the input embedding and output layer.")
    decoupled_min_lr: Optional[float] = opt(
        None, "Minimum lr of the input embedding and output layer under --decoupled-lr.")
    weight_decay: float = opt(0.01, "Weight decay (not applied to norms and biases).")
    start_weight_decay: Optional[float] = opt(
        None, "Weight decay at the start of the run (default --weight-decay).")
    end_weight_decay: Optional[float] = opt(
        None, "Weight decay at the end of the run (default --weight-decay).")
    weight_decay_incr_style: str = opt("constant", "How weight decay moves from start to end.",
                                       choices=["constant", "linear", "cosine"])
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this; 0 disables.")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    bf16: bool = opt(False, "bf16 compute with fp32 master weights.", action="store_true")
    precision: Optional[str] = opt(
        None, "Training precision: fp32, bf16 (as --bf16) or auto (time bf16 and fp32 matmuls "
        "at start-up and train in the faster; training/precision.py).",
        choices=["auto", "fp32", "bf16"])
    fp16: bool = opt(False, "fp16 compute with fp32 master weights and a loss scaler.",
                     action="store_true")
    loss_scale: Optional[float] = opt(
        None, "Static loss scale (a power of 2; fp16, or bf16 as in Megatron); default under "
        "--fp16: dynamic loss scaling.")
    initial_loss_scale: float = opt(2.0 ** 32, "fp16: initial dynamic loss scale.")
    min_loss_scale: float = opt(1.0, "fp16: smallest dynamic loss scale.")
    loss_scale_window: float = opt(1000, "fp16: steps without overflow before the scale grows.")
    hysteresis: int = opt(2, "fp16: overflows in a row before the scale shrinks.")

    def __post_init__(self):
        if self.precision == "bf16":    # one switch downstream: dry run, planner, optimizer
            self.bf16 = True


@dataclass
class DataConfig:
    """Tokenizer and datasets."""
    data_path: list = opt([], "Dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...",
                          nargs="*")
    split: str = opt("969, 30, 1", "Train/valid/test proportions.")
    mock_data: bool = opt(False, "Train on deterministic random tokens.", action="store_true")
    tokenizer_type: Optional[str] = opt(
        None, "Tokenizer.", choices=["SentencePieceTokenizer", "ByteLevelTokenizer",
                                     "CharacterTokenizer", "NullTokenizer",
                                     "HuggingFaceTokenizer", "GPT2BPETokenizer",
                                     "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                                     "TikTokenizer", "Llama3Tokenizer"])
    tokenizer_model: Optional[str] = opt(None, "Tokenizer model file (or HF directory).")
    vocab_file: Optional[str] = opt(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT2BPETokenizer: merges.txt.")
    tiktoken_pattern: Optional[str] = opt(None, "TikTokenizer: split pattern (default v2).",
                                          choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids reserved for special tokens.")
    tiktoken_special_tokens: Optional[list] = opt(
        None, "TikTokenizer: special tokens (must include <unk> <s> </s>).", nargs="+")
    data_cache_path: Optional[str] = opt(None, "Where dataset index caches are written.")
    eod_mask_loss: bool = opt(False, "Mask the loss on end-of-document tokens.",
                              action="store_true")
    sample_windows: str = opt(
        "packed", "How training samples are cut: packed (Megatron: consecutive windows of the "
        "shuffled document stream, each token once per epoch) or random (nanoGPT: windows at "
        "uniformly random offsets; for small corpora trained for several epochs). Valid/test "
        "stay packed.", choices=["packed", "random"])


@dataclass
class TrainingConfig:
    """Batch sizes, iterations, evaluation, recomputation, seeds."""
    micro_batch_size: int = opt(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = opt(
        None, "Samples per iteration over all data-parallel ranks; default micro*DP.")
    train_iters: Optional[int] = opt(None, "Training iterations.")
    train_samples: Optional[int] = opt(None, "Training samples (alternative to --train-iters).")
    rampup_batch_size: Optional[list] = opt(
        None, "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over "
        "SAMPLES consumed samples up to --global-batch-size.", nargs=3)
    step_batch_size_schedule: Optional[list] = opt(
        None, "'SAMPLES:BATCH ...' global batch steps; parses, refused at run time until landed.",
        nargs="+")
    eval_interval: int = opt(1000, "Evaluate every this many iterations.")
    eval_iters: int = opt(100, "Iterations per evaluation.")
    skip_train: bool = opt(False, "Only evaluate (a loaded checkpoint).", action="store_true")
    seed: int = opt(1234, "Random seed.")
    recompute_granularity: Optional[str] = opt(
        None, "Activation recomputation.", choices=["full", "selective"])
    recompute_method: Optional[str] = opt(None, "Full recompute: which layers.",
                                          choices=["uniform", "block"])
    recompute_num_layers: int = opt(1, "Full recompute: layers per chunk (uniform) or count (block).")
    recompute_modules: list = opt(["core_attn"], "Selective recompute: modules.", nargs="*")
    compile: bool = opt(False, "torch.compile each transformer layer (fused kernels on CUDA).",
                        action="store_true")
    exit_interval: Optional[int] = opt(None, "Exit after this iteration.")
    device: str = opt("auto", "Device: auto (cuda if present), cpu or cuda.",
                      choices=["auto", "cpu", "cuda"])
    dry_run: bool = opt(False, "Validate, print the rank layout (and the pipeline split) and exit.", action="store_true")


@dataclass
class LoggingConfig:
    log_interval: int = opt(100, "Log every this many iterations.")
    metrics_file: Optional[str] = opt(None, "Write one JSON object per iteration here.")
    tensorboard_dir: Optional[str] = opt(None, "TensorBoard log directory.")
    wandb_project: Optional[str] = opt(None, "Weights & Biases project (offline unless configured).")
    wandb_exp_name: Optional[str] = opt(None, "Weights & Biases run name.")
    pipeline_timeline: Optional[str] = opt(None, "Write a Chrome-trace of the pipeline schedule.")
    loss_plot: Optional[str] = opt(None, "Write a loss-curve PNG at the end of training.")
    no_progress_bar: bool = opt(False, "Disable the progress bar.", action="store_true")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "Directory to save checkpoints to.")
    load: Optional[str] = opt(None, "Directory to load a checkpoint from.")
    save_interval: Optional[int] = opt(None, "Save every this many iterations.")
    no_load_optim: bool = opt(False, "Do not load optimizer state.", action="store_true")
    no_load_rng: bool = opt(False, "Do not load RNG state.", action="store_true")
    finetune: bool = opt(False, "Load weights only and reset the iteration count.",
                         action="store_true")
    use_checkpoint_args: bool = opt(
        False, "Take the model flags (and, if none is given, the tokenizer) from the checkpoint "
        "in --load; without it, model flags that disagree with that checkpoint are an error.",
        action="store_true")
    # -- checkpoint safety and preemption (issue 15; docs/checkpoints.md) ----------------
    keep_last_n_checkpoints: Optional[int] = opt(
        None, "Delete older checkpoints after a save, keeping this many (default: all).")
    async_save: bool = opt(False, "Write checkpoints in a background thread: the loop stalls "
                           "only while state is copied to host memory.", action="store_true")
    exit_signal_handler: bool = opt(False, "On SIGTERM or SIGUSR1, save a checkpoint at the "
                                    "end of the iteration and exit cleanly.", action="store_true")
    exit_duration_in_mins: Optional[float] = opt(
        None, "Save and exit once training has run this many minutes.")
    check_for_nan_in_loss_and_grad: bool = opt(
        False, "Stop with the iteration and rank when the loss or the gradient norm is NaN/Inf.",
        action="store_true")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class MegaliteConfig:
    """Everything a run needs; one attribute per section."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    world_size: int = 1
    # Megatron flags given that have no setting here: [(flag, value, note)] (compat_flags)
    accepted_flags: list = field(default_factory=list)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def num_micro_batches(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.data_parallel_size)

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.parallel.tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MegaliteConfig":
        kwargs = {name: klass(**d.get(name, {})) for name, klass in SECTIONS.items()}
        return cls(world_size=d.get("world_size", 1), **kwargs)


def field_flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def all_fields():
    """(section, field) for every configurable field, in CLI order."""
    for section, klass in SECTIONS.items():
        for f in dataclasses.fields(klass):
            yield section, f
