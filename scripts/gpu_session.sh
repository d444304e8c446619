#!/usr/bin/env bash
# One lease on a GPU machine (see docs/benchmarks.md, "GPU: measured against the model"):
# bench_train's measured steps beside gpu_predict's predictions for the same steps, then the
# matmuls of tensor_overlap's rings on one rank (gpu_ring_chunks.py), then the CPU test suite
# under the machine's jax. Writes logs and JSON under $OUT (or /tmp/gpu_out).
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
B100M="train.precision=bf16 train.global_batch=64 train.micro_batch=64"
python3 scripts/gpu_predict.py configs/gpt100m.yaml $B100M --json "$OUT/pred_gpt100m.json"
python3 scripts/bench_train.py --configs gpt100m --steps 10 --no-baseline --no-depth --peak-tflops 989 \
  --override train.precision=bf16 --override train.global_batch=64 --override train.micro_batch=64 \
  --json "$OUT/bench_gpt100m.json" 2>&1 | tail -12
python3 scripts/gpu_predict.py configs/gpt1.3b.yaml --json "$OUT/pred_gpt13b.json"
python3 scripts/bench_train.py --configs gpt1.3b --steps 5 --no-baseline --no-depth --peak-tflops 989 \
  --json "$OUT/bench_gpt13b.json" 2>&1 | tail -8
python3 scripts/gpu_ring_chunks.py --json "$OUT/ring_chunks.json"
left=$(( ${SUITE_BUDGET_S:-540} - ($(date +%s) - start) ))
echo "benches took $(( $(date +%s) - start )) s; suite gets ${left} s"
if [ "$left" -gt 60 ]; then
  JAX_PLATFORMS=cpu timeout -s INT -k 25 "$left" python3 -m pytest -q -n 14 -p no:cacheprovider --ignore=tests/test_notebooks.py \
    --ignore=tests/test_gpu_compile.py -o addopts="" --durations=0 > "$OUT/suite.log" 2>&1
  echo "suite exit $?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/suite.log" | tail -15
fi
