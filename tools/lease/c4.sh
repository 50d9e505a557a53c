# Call 4 (only if 8 minutes remain): B1 in a real bench on the embedded model, EAGLE methods included.
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c4.log") 2>&1
timeout 280 python3 -m samctl bench --device cuda --chat --quiet --questions samctl/data/questions/specbench_sample.jsonl \
  --methods ar,adaptive,eagle,adaptive+eagle,hf-greedy --max-new-tokens 128 --limit 2 --out /tmp/r4
cat /tmp/r4/summary.md
python3 -c "import json;[print(r['method'],'eager verifies',sum(t.get('metrics',{}).get('eager_verifies',0) for t in r.get('turns',[]) if isinstance(t,dict))) for r in map(json.loads,open('/tmp/r4/records.jsonl'))]" 2>/dev/null || true
