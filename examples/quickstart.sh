#!/bin/bash
# The README's main job, on the embedded sample corpus (Python's documentation, PSF license):
#   1. train a byte-level BPE tokenizer on it          (tools/train_tokenizer.py)
#   2. preprocess it into an mmap .bin/.idx dataset    (tools/preprocess_data.py, 2 workers)
#   3. build the train/valid/test sample indices       (tools/build_dataset_indices.py)
# and print what was built. Outputs go to $RUN_DIR (default runs/quickstart).
# Set SKIP_INSTALL=1 to use the current environment as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash tools/install.sh
py=${PYTHON:-python3}
run_dir=${RUN_DIR:-runs/quickstart}
corpus=examples/data/python-docs.jsonl.gz
mkdir -p "$run_dir/data"

echo "== 1. tokenizer: byte-level BPE, 8192 tokens, trained on $corpus"
$py tools/train_tokenizer.py --input "$corpus" --vocab-size 8192 --output-dir "$run_dir/tokenizer"

echo "== 2. preprocessing: jsonl -> $run_dir/data/python-docs_text_document.{bin,idx}"
$py tools/preprocess_data.py --input "$corpus" --json-keys text \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$run_dir/tokenizer/vocab.json" --merge-file "$run_dir/tokenizer/merges.txt" \
    --append-eod --workers 2 --output-prefix "$run_dir/data/python-docs"

echo "== 3. sample indices: seq 512, global batch 16, 200 iterations, eval every 50 for 5"
$py tools/build_dataset_indices.py --data-path "$run_dir/data/python-docs_text_document" \
    --split 969,30,1 --seq-length 512 --seed 1234 \
    --train-iters 200 --global-batch-size 16 --eval-interval 50 --eval-iters 5

echo "== built:"
ls -l "$run_dir"/tokenizer "$run_dir"/data
