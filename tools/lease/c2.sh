# Call 2: random bf16 models shaped like SmolLM2-135M and Llama-3-8B: cost curves, ar, oracle (3-4 min).
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c2.log") 2>&1
timeout 530 python3 tools/lease/big.py "$OUT/curves.json"
