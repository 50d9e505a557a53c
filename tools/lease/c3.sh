# Call 3: a real model in bf16 (SmolLM2-135M-Instruct when its GGUF parts travel in .smol/, else
# the embedded model): calibrate, bench on code edits with and without graphs, batch with predictions.
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c3.log") 2>&1
R=/tmp/r; C=$SAMCTL_CACHE/costs; mkdir -p $R
S=/tmp/gpu/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $S ] && ls /tmp/smol/p? >/dev/null 2>&1; then cat /tmp/smol/p? > $S; fi
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $S" | sha256sum -c 2>/dev/null || S=samctl/models/default/target
echo "model: $S"
python3 tools/make_code_edit_set.py --out $R/code_edit.jsonl --n 40
python3 tools/lease/with_predictions.py $R/code_edit.jsonl $R/code_edit_pred.jsonl
keep() { mkdir -p $R/$1; cp -r $C/. $R/$1/ 2>/dev/null; rm -rf $C; tar czf "$OUT/c3.tgz" -C $R .; }  # each curve apart (B4)
timeout 100 python3 -m samctl calibrate --model $S --device cuda --json > $R/calibrate_graphs.json; keep curve_calibrate_graphs
timeout 60 python3 -m samctl calibrate --model $S --device cuda --no-compile --json > $R/calibrate_eager.json; keep curve_calibrate_eager
B="python3 -m samctl bench --model $S --device cuda --chat --quiet --questions $R/code_edit.jsonl --max-new-tokens 256 --limit 20"
timeout 240 $B --methods ar,adaptive,pld,hf-greedy,hf-pld --out $R/bench_graphs; keep curve_graphs; sed -n 1,30p $R/bench_graphs/summary.md
for m in adaptive ar; do TIMEFORMAT="batch $m: %R s wall"
  time timeout 100 python3 -m samctl generate --model $S --device cuda --chat --quiet --method $m --max-new-tokens 256 --input $R/code_edit_pred.jsonl --output $R/batch_$m.jsonl; done
timeout 150 $B --no-compile --methods ar,adaptive --out $R/bench_eager; keep curve_eager; sed -n 1,30p $R/bench_eager/summary.md
python3 -c "import json,sys;[print(f,sum(m['new_tokens'] for m in M),'tokens',round(sum(m['new_tokens'] for m in M)/sum(m['time_s'] for m in M),1),'tok/s','eager verifies',sum(m.get('eager_verifies',0) for m in M)) for f in sys.argv[1:] for M in [[json.loads(l)['metrics'] for l in open(f) if '\"metrics\"' in l]]]" $R/batch_*.jsonl
tar czf "$OUT/c3.tgz" -C $R .
