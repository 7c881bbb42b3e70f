"""DataConfig, TrainingConfig, LoggingConfig, CheckpointConfig: what a run reads, how long
it trains, what it writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.domain_checks import (blend_problem, data_blend_problem, load_dir_problem,
                                           rampup_problem, split_problem,
                                           step_batch_schedule_problem)
from megalite.config.fields import opt

RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


@dataclass
class DataConfig:
    """Tokenizer and datasets."""
    data_path: list = opt([], "Dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...",
                          nargs="*", check=data_blend_problem)
    split: str = opt("969, 30, 1", "Train/valid/test proportions.", check=split_problem)
    train_data_path: list = opt(
        [], "Training data of its own (Megatron's per-split data): prefixes, optionally "
        "weighted, as --data-path; with per-split paths --split is ignored.", nargs="*",
        check=blend_problem("--train-data-path"))
    valid_data_path: list = opt([], "Validation data of its own (as --train-data-path).",
                                nargs="*", check=blend_problem("--valid-data-path"))
    test_data_path: list = opt([], "Test data of its own (as --train-data-path).", nargs="*",
                               check=blend_problem("--test-data-path"))
    mock_data: bool = opt(False, "Train on deterministic random tokens.", action="store_true")
    tokenizer_type: Optional[str] = opt(
        None, "Tokenizer.", choices=["SentencePieceTokenizer", "ByteLevelTokenizer",
                                     "CharacterTokenizer", "NullTokenizer",
                                     "HuggingFaceTokenizer", "GPT2BPETokenizer",
                                     "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                                     "TikTokenizer", "Llama3Tokenizer"])
    tokenizer_model: Optional[str] = opt(None, "Tokenizer model file (or HF directory).",
        path="in")
    vocab_file: Optional[str] = opt(None, "GPT2BPETokenizer: vocab.json.", path="in-file")
    merge_file: Optional[str] = opt(None, "GPT2BPETokenizer: merges.txt.", path="in-file")
    tiktoken_pattern: Optional[str] = opt(None, "TikTokenizer: split pattern (default v2).",
                                          choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids reserved for special tokens.",
        ge=3)
    tiktoken_special_tokens: Optional[list] = opt(
        None, "TikTokenizer: special tokens (must include <unk> <s> </s>).", nargs="+",
        free="token strings of the tokenizer file")
    data_cache_path: Optional[str] = opt(None, "Where dataset index caches are written.",
        path="out-dir")
    eod_mask_loss: bool = opt(False, "Mask the loss on end-of-document tokens.",
                              action="store_true")
    reset_position_ids: bool = opt(False, "Restart position ids at 0 after each "
                                   "end-of-document token (packed documents).",
                                   action="store_true")
    reset_attention_mask: bool = opt(False, "Attend only inside each document of a packed "
                                     "sequence (documents end at the end-of-document token).",
                                     action="store_true")
    sample_windows: str = opt(
        "packed", "How training samples are cut: packed (Megatron: consecutive windows of the "
        "shuffled document stream, each token once per epoch) or random (nanoGPT: windows at "
        "uniformly random offsets; for small corpora trained for several epochs). Valid/test "
        "stay packed.", choices=["packed", "random"])

    def per_split_data_path(self) -> Optional[tuple]:
        """(train, valid, test) blend lists of Megatron's per-split flags, None without them."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return tuple(list(p or []) for p in paths) if any(paths) else None


@dataclass
class TrainingConfig:
    """Batch sizes, iterations, evaluation, recomputation, seeds."""
    micro_batch_size: int = opt(1, "Samples per micro-batch per data-parallel rank.", gt=0)
    global_batch_size: Optional[int] = opt(
        None, "Samples per iteration over all data-parallel ranks; default micro*DP.", gt=0)
    train_iters: Optional[int] = opt(None, "Training iterations.", gt=0)
    train_samples: Optional[int] = opt(None, "Training samples (alternative to --train-iters).",
        gt=0)
    rampup_batch_size: Optional[list] = opt(
        None, "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over "
        "SAMPLES consumed samples up to --global-batch-size.", nargs=3,
        length=3, check=rampup_problem)
    step_batch_size_schedule: Optional[list] = opt(
        None, "THRESHOLD:BATCH ... (Megatron-LM): from THRESHOLD "
        "consumed tokens on, the global batch is BATCH; K/M/B/T suffixes (0:16 2.4B:320).",
        nargs="+", check=step_batch_schedule_problem)
    eval_interval: int = opt(1000, "Evaluate every this many iterations.", gt=0)
    eval_iters: int = opt(100, "Iterations per evaluation.", ge=0)
    skip_train: bool = opt(False, "Only evaluate (a loaded checkpoint).", action="store_true",
        requires="checkpoint.load")
    seed: int = opt(1234, "Random seed.", ge=0)
    recompute_granularity: Optional[str] = opt(
        None, "Activation recomputation.", choices=["full", "selective"],
        shorthand=("--recompute-activations", "selective"))
    recompute_method: Optional[str] = opt(None, "Full recompute: which layers.",
                                          choices=["uniform", "block"],
        requires="recompute_granularity=full")
    recompute_num_layers: int = opt(1, "Full recompute: layers per chunk (uniform) or count (block).",
        gt=0)
    recompute_modules: list = opt(["core_attn"], "Selective recompute: modules.", nargs="*",
        choices=list(RECOMPUTE_MODULES))
    compile: bool = opt(False, "torch.compile each transformer layer (fused kernels on CUDA).",
                        action="store_true")
    exit_interval: Optional[int] = opt(None, "Exit after this iteration.", gt=0)
    device: str = opt("auto", "Device: auto (cuda if present), cpu or cuda.",
                      choices=["auto", "cpu", "cuda"])
    dry_run: bool = opt(False, "Validate, print the rank layout (and the pipeline split) and exit.", action="store_true")
    check_collectives: bool = opt(
        False, "With --dry-run: trace one iteration of every rank (meta tensors, no process "
        "group) and check that every group's members issue the same collectives and that "
        "every pipeline send has its receive.", action="store_true", requires="dry_run")


@dataclass
class LoggingConfig:
    log_interval: int = opt(100, "Log every this many iterations.", gt=0)
    logging_level: Optional[int] = opt(
        None, "Level of Python's logging (Megatron's: 10 debug, 20 info, 30 warning): "
        "megalite's data-pipeline messages at or above it go to stderr.", ge=0, le=50)
    metrics_file: Optional[str] = opt(None, "Write one JSON object per iteration here.",
        path="out")
    tensorboard_dir: Optional[str] = opt(None, "TensorBoard log directory.", path="out-dir")
    wandb_project: Optional[str] = opt(None, "Weights & Biases project (offline unless configured).",
        free="a Weights & Biases project name")
    wandb_exp_name: Optional[str] = opt(None, "Weights & Biases run name.",
        free="a Weights & Biases run name")
    pipeline_timeline: Optional[str] = opt(None, "Write a Chrome-trace of the pipeline schedule.",
        path="out")
    loss_plot: Optional[str] = opt(None, "Write a loss-curve PNG at the end of training.",
        path="out", requires="logging.metrics_file")
    no_progress_bar: bool = opt(False, "Disable the progress bar.", action="store_true")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "Directory to save checkpoints to.", path="out-dir")
    load: Optional[str] = opt(None, "Directory to load a checkpoint from.", check=load_dir_problem)
    save_interval: Optional[int] = opt(None, "Save every this many iterations.", gt=0)
    ckpt_step: Optional[int] = opt(
        None, "Load the checkpoint of this iteration from --load instead of the newest "
        "complete one.", gt=0, requires="load")
    override_opt_param_scheduler: bool = opt(
        False, "Resuming: step the schedule these flags give (--lr, --train-iters, "
        "--lr-decay-*, warmup), not the checkpoint's (Megatron).",
        flag="--override-opt_param-scheduler", action="store_true")
    use_checkpoint_opt_param_scheduler: bool = opt(
        False, "Resuming: keep the checkpoint's learning-rate and weight-decay schedule "
        "whatever the schedule flags say (Megatron).",
        flag="--use-checkpoint-opt_param-scheduler", action="store_true")
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
        None, "Delete older checkpoints after a save, keeping this many (default: all).", gt=0)
    async_save: bool = opt(False, "Write checkpoints in a background thread: the loop stalls "
                           "only while state is copied to host memory.", action="store_true")
    exit_signal_handler: bool = opt(False, "On SIGTERM or SIGUSR1, save a checkpoint at the "
                                    "end of the iteration and exit cleanly.", action="store_true")
    exit_duration_in_mins: Optional[float] = opt(
        None, "Save and exit once training has run this many minutes.", gt=0)
    # -- in-memory peer snapshots (issue 27; docs/fault_tolerance.md) --------------------
    snapshot_interval: Optional[int] = opt(
        None, "Every this many iterations, copy each rank's state into its node's shared "
        "memory (MEGALITE_SNAPSHOT_DIR) and a replica onto another node, in the background; "
        "a restart resumes from the newest one the survivors hold.  0: off.  Default: 1 "
        "with --elastic, else off.", ge=0)
    check_for_nan_in_loss_and_grad: bool = opt(
        False, "Stop with the iteration and rank when the loss or the gradient norm is NaN/Inf.",
        action="store_true", negation="--no-check-for-nan-in-loss-and-grad")
