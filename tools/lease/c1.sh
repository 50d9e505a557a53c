# Call 1: the gpu tests, the engine's CPU tests on the image, then the probes (about 5 min).
set -o pipefail
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c1.log") 2>&1
timeout 330 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_gpu.py tests/test_engine.py
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_engine.py tests/test_graphs_cpu.py -k "not every_method"
timeout 240 python3 tools/lease/probe.py widths logits syncs eagle sdpa rope | tee "$OUT/probe.jsonl"
