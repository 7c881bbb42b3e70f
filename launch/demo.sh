#!/usr/bin/env bash
# The main job, from nothing: environment -> tokenizer -> preprocess -> train a small
# Llama-style model on 4 CPU processes (TP=2 x DP=2) -> evaluate -> save -> loss curve -> sample.
# A few minutes on a 2-core machine. Outputs land in outputs/demo/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/launch/setup_env.sh" plot
cd "$ROOT"
OUT="${DEMO_OUT:-outputs/demo}"
NPROC="${DEMO_NPROC:-4}"
ITERS="${DEMO_ITERS:-300}"
WARMUP=$(( ITERS >= 200 ? 20 : ITERS / 10 ))   # warmup must stay below the decay (Megatron)
mkdir -p "$OUT"

if [ ! -f "$OUT/tokenizer.model" ]; then
  echo "== 1/4 training a 1024-token sentencepiece BPE tokenizer on the bundled corpus"
  python -m megalite.data.train_tokenizer --input data/tinyshakespeare.txt \
      --model-prefix "$OUT/tokenizer" --vocab-size 1024 --type bpe
fi
if [ ! -f "$OUT/shakespeare_text_document.idx" ]; then
  echo "== 2/4 tokenizing into Megatron's .bin/.idx format"
  python tools/preprocess_data.py --input data/tinyshakespeare.txt --output-prefix "$OUT/shakespeare" \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" --append-eod
fi

echo "== 3/4 training on $NPROC CPU processes"
rm -rf "$OUT/checkpoint" "$OUT/metrics.jsonl"
torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 \
    --normalization RMSNorm --position-embedding-type rope --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --hidden-dropout 0 --attention-dropout 0 \
    --seq-length 128 --micro-batch-size 8 --global-batch-size 16 \
    --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" \
    --weight-decay 0.1 --adam-beta2 0.99 --clip-grad 1.0 \
    --data-path "$OUT/shakespeare_text_document" --split 95,5,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --log-interval 25 --eval-interval 100 --eval-iters 5 \
    --save "$OUT/checkpoint" --metrics-file "$OUT/metrics.jsonl" --loss-plot "$OUT/loss.png"

echo "== 4/4 a sample from the trained model"
python -m megalite.generate --load "$OUT/checkpoint" --prompt "ROMEO:" --max-new-tokens 120
echo "loss curve: $OUT/loss.png   metrics: $OUT/metrics.jsonl   checkpoint: $OUT/checkpoint"
