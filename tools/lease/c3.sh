# Call 3 (carry .lease/p2): SmolLM2-135M-Instruct from the three GGUF parts, in bf16 and fp32:
# bench (128 new tokens) on 8 code edits + 12 Spec-Bench prompts, batch 1, graphs on; then the batched engine on 32
# code edits (with their predictions) at batch sizes 1, 8 and 32 (about 4 minutes).
set -o pipefail
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c3.log") 2>&1
R=/tmp/r; S=/tmp/gpu/smol.gguf; mkdir -p $R
NEW=128; N=40; B="1 8 32"; [ -n "$LEASE_DRY" ] && { NEW=12; N=5; B="1 4"; }
cat /tmp/lease/p? > $S
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $S" | sha256sum -c || exit 1
timeout 90 python3 tools/lease/smol.py $S /tmp/gpu || exit 1
python3 tools/make_code_edit_set.py --out $R/code_edit.jsonl --n $N
python3 tools/lease/with_predictions.py $R/code_edit.jsonl $R/all.jsonl; tail -n 32 $R/all.jsonl > $R/batch.jsonl
{ head -8 $R/code_edit.jsonl; cat /tmp/lease/specbench12.jsonl; } > $R/questions.jsonl
[ -n "$LEASE_DRY" ] && { head -2 $R/code_edit.jsonl; head -2 /tmp/lease/specbench12.jsonl; } > $R/questions.jsonl
keep() { tar czf "$OUT/c3.tgz" -C $R . ; }
bench() {  # dtype, seconds, methods
  timeout $2 python3 -m samctl bench --model /tmp/gpu/smol-$1 --device $DEV --dtype $1 --chat --quiet \
    --questions $R/questions.jsonl --max-new-tokens $NEW --methods $3 --out $R/bench_$1
  sed -n '/^## /,$p' $R/bench_$1/summary.md; keep
}
bench bfloat16 150 ar,adaptive,pld,hf-pld
bench float32 80 ar,adaptive,pld
timeout 100 python3 tools/lease/batch.py /tmp/gpu/smol-bfloat16 $R/batch.jsonl $DEV bfloat16 $((NEW / 2)) "$OUT/batch.json" $B
keep
