"""argv of Megatron-LM's example training scripts, as bash hands it to ``pretrain_gpt.py``
(unquoted array expansion: ``"--split '99,1,0'"`` becomes ``--split`` and ``'99,1,0'`` with
its quotes).  Captured from NVIDIA/Megatron-LM ``examples/`` (flags only, no code):

* examples/gpt3/train_gpt3_175b_distributed.sh       (args: CKPT TB VOCAB MERGE DATA)
* examples/llama/train_llama3_8b_h100_fp8.sh         (default MOCK data and tokenizer)
* examples/mixtral/train_mixtral_8x7b_distributed.sh (args: CKPT TOKENIZER_MODEL DATA)
* examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (defaults: USE_MEGATRON_FSDP=1,
  SHARDING_STRATEGY=optim_grads_params, DTYPE=fp8, MOCK data; args: CKPT ... TB)

The GPT-3 script is today's (Megatron-LM 532ad926b4 on): ``--step-batch-size-schedule
"0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"`` (unquoted array expansion: six
words) together with ``--global-batch-size 1536``, which Megatron-LM's own argument check
rejects and megalite accepts (it is the schedule's last batch).  The version before
(a52112dae9, the one issue 16 measured) passed ``--rampup-batch-size 16 16 5859375``; the
ramp's CPU twin is tests/e2e/test_megatron_flags_e2e.py.

``{...}`` are the script's positional paths.  ``WORLD`` is the world size of each layout:
the 175B script's TP8 x PP16 needs 128 ranks, Mixtral's PP4 with EP8 needs 32.
"""

GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto
--micro-batch-size 1 --global-batch-size 1536
--step-batch-size-schedule 0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path {DATA} --vocab-file {VOCAB} --merge-file {MERGE} --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {CKPT} --load {CKPT}
--eval-iters 10 --tensorboard-dir {TB}
"""

LLAMA3_8B_FP8 = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {CACHE}
--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save {CKPT} --load {CKPT} --tensorboard-dir {TB}
"""

MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model {TOKENIZER_MODEL} --data-path {DATA}
--split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--save {CKPT} --load {CKPT} --tensorboard-dir {CKPT}/tensorboard --no-load-optim --no-load-rng
"""

# Megatron-LM d98e8a64dd, its arrays in the order the script expands them: MODEL_ARGS,
# TRAINING_ARGS (with the Megatron-FSDP and DDP additions), DTYPE_ARGS,
# MODEL_PARALLEL_ARGS, DATA_ARGS_LIST (mock), EVAL_AND_LOGGING_ARGS
LLAMA3_8B_FSDP_FP8 = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
--no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
--ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {CACHE}
--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--logging-level 20 --distributed-timeout-minutes 60 --save {CKPT} --load {CKPT}
--tensorboard-dir {TB}
"""

# gpt-oss: examples/gptoss/02_train.sh of Megatron-LM d98e8a64dd (last changed in
# 779c5b748d), default MOCK data and tokenizer, its arrays in the order the script expands
# them: MODEL_ARGS, MOE_ARGS, DATA_ARGS_LIST (mock), TRAINING_ARGS, MODEL_PARALLEL_ARGS,
# LOGGING_ARGS.  PP is the world size; the script's 8 GPUs would split its 12 layers
# unevenly, which Megatron's own check refuses, so GPUS_PER_NODE=4 (its distributed config
# file's setting): PP4.
GPTOSS_20B = """
--no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
--untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
--num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 64
--group-query-attention --num-query-groups 8 --seq-length 8192
--max-position-embeddings 8192 --use-mcore-models --rotary-percent 1.0 --rope-type rope
--position-embedding-type rope --rotary-base 10000 --no-bias-gelu-fusion
--export-force-local-attention --no-bias-dropout-fusion --quick-geglu
--glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2
--activation-func-clamp-value 7.0 --window-size 127,0 --enable-gpt-oss
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 2048
--moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {CACHE}
--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1
--lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn
--attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32
--disable-bf16-reduced-precision-matmul --recompute-activations
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
--use-distributed-optimizer --fp8-format hybrid --fp8-param-gather
--fp8-amax-compute-algo max --fp8-amax-history-len 1024
--log-interval 1 --save-interval 10000 --eval-interval 50000000 --eval-iters 0
--save {CKPT} --tensorboard-dir {CKPT}/tensorboard --moe-per-layer-logging --no-load-optim
--no-load-rng --log-throughput
"""

SCRIPTS = {
    "gpt3_175b": (GPT3_175B, 128),
    "llama3_8b_fp8": (LLAMA3_8B_FP8, 8),
    "mixtral_8x7b": (MIXTRAL_8X7B, 32),
    "llama3_8b_fsdp_fp8": (LLAMA3_8B_FSDP_FP8, 8),
    "gptoss_20b": (GPTOSS_20B, 4),
}


def argv(text: str, **paths) -> list:
    """The script's argv with its positional paths filled in."""
    return [tok.format(**paths) if "{" in tok else tok for tok in text.split()]


# CPU-scale twins: the same flags with sizes, parallel sizes, iterations and paths shrunk.
TWIN_VALUES = {
    "--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "8",
    "--seq-length": "16", "--max-position-embeddings": "64", "--micro-batch-size": "2",
    "--global-batch-size": "4", "--train-iters": "3", "--train-samples": "12",
    "--lr-decay-iters": "3", "--lr-decay-samples": "12", "--lr-warmup-samples": "4",
    "--lr-warmup-iters": "1", "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1",
    "--vocab-size": "512", "--eval-interval": "2", "--eval-iters": "1", "--log-interval": "1",
    "--save-interval": "2",
    "--rampup-batch-size": ["2", "2", "4"],     # 2, 2, 4: the ramp ends inside the twin
    # batch 2, then 4 from 32 tokens (2 samples of 16) on: 2, 4, 4, the step inside the twin
    "--step-batch-size-schedule": ["0:2", "32:4"],
    "--split": "90,8,2",     # the twin's corpus is 16k tokens: 99990,8,2 leaves valid 1 token
    # gpt-oss: experts and a window the twin's 16 tokens feel, local layers (no TE on CPU)
    "--moe-ffn-hidden-size": "16", "--window-size": "7,0", "--transformer-impl": "local",
}
# Flags whose feature cannot run in a CPU twin yet, dropped with their values (the dry runs
# above keep them): FP8 (needs Transformer Engine on a GPU), and MoE layers (issue 14).
TWIN_DROPPED = {"--fp8-format": 1, "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1,
                "--fp8-param-gather": 0, "--num-experts": 1, "--moe-router-topk": 1,
                "--moe-router-load-balancing-type": 1, "--moe-aux-loss-coeff": 1,
                "--moe-grouped-gemm": 0, "--moe-token-dispatcher-type": 1,
                "--load": 1}


TWIN_MOE = {f for f in TWIN_DROPPED if f.startswith(("--moe-", "--num-experts"))}


def twin(args: list, keep_moe: bool = False) -> list:
    """``args`` shrunk to a CPU twin (``--load`` dropped: the twin starts fresh);
    ``keep_moe``: the MoE flags stay (gpt-oss's twin trains its experts)."""
    out, i = [], 0
    while i < len(args):
        flag = args[i]
        if flag in TWIN_DROPPED and not (keep_moe and flag in TWIN_MOE):
            i += 1 + TWIN_DROPPED[flag]
            continue
        out.append(flag)
        if flag in TWIN_VALUES:
            value = TWIN_VALUES[flag]
            values = value if isinstance(value, list) else [value]
            out += values
            i += 1
            # the script's own values: one, or (a list flag) every word up to the next flag
            while i < len(args) and not args[i].startswith("--"):
                i += 1
                if not isinstance(value, list):
                    break
            continue
        i += 1
    return out
