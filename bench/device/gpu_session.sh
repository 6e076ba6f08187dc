#!/usr/bin/env bash
# One GPU call's work, in stages: bash bench/device/gpu_session.sh STAGE... (setup tests tests-triton bench micro profile loop).
# Run on the lent box from the repo root after the model pieces are in /tmp/swiftk_parts (README.md in this
# folder). Everything worth keeping goes under $OUT (at most 8 files come back: logs are appended to a few).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. SWIFTK_WHEEL_DIR=$PWD/.whl/data SWIFTK_PERSIST=0
MODEL=${MODEL:-smollm2-135m}
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/session.log"; }

for stage in "$@"; do
  case "$stage" in
    setup)
      log setup
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
      [ -f "/tmp/swiftk_parts/$MODEL.manifest.json" ] && python3 bench/device/prepare.py join "/tmp/swiftk_parts/$MODEL.manifest.json" 2>&1 | tail -2
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name())"
        lscpu | grep 'Model name'; } 2>&1 | tee -a "$OUT/session.log"
      t0=$(date +%s)
      SWIFTK_BUILD_CUDA=1 SWIFTK_CUDA_ARCHS=90 timeout 400 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
      echo "build_ext rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/session.log"
      python3 -c "import swiftk, json; from swiftk.runtime.ops import describe; print(json.dumps(describe('cuda')))" 2>&1 | tee -a "$OUT/session.log"
      ;;
    tests)
      log tests
      timeout 540 python3 -m pytest -q -rs -m gpu tests/ -p no:cacheprovider 2>&1 | tail -60 | tee -a "$OUT/session.log"
      ;;
    tests-triton)
      log tests-triton
      timeout 300 python3 -m pytest -q -rs tests/test_kernels_triton.py tests/test_swift_triton.py tests/test_dispatch.py \
        -p no:cacheprovider 2>&1 | tail -30 | tee -a "$OUT/session.log"
      ;;
    bench)
      log bench
      rm -rf /tmp/bench; mkdir -p /tmp/bench
      timeout 560 python3 -m bench.e2e --model "$MODEL" --device cuda --dtype bfloat16 --workload "${WORKLOADS:-humaneval,mtbench}" \
        --n "${BENCH_N:-4}" --n-mtbench 1 --max-new-tokens "${BENCH_TOKENS:-256}" \
        --methods "${BENCH_METHODS:-hf-greedy,swiftk-ar,swiftk-ar-eager,swift-cold,swiftk-ngram,hf-pld}" \
        --out /tmp/bench 2>&1 | tail -40 | tee -a "$OUT/session.log"
      tar czf "$OUT/bench${BENCH_TAG:-}.tgz" -C /tmp/bench . && ls -la /tmp/bench | tee -a "$OUT/session.log"
      ;;
    micro)   # per-op and per-pass microbenchmarks, every backend (parametrized inside), both model shapes
      log micro
      timeout 300 python3 -m pytest -q bench/test_micro.py --benchmark-only --benchmark-columns=min,median,rounds \
        --benchmark-json="$OUT/micro.json" -p no:cacheprovider -k "${MICRO_K:-decode_step or draft_step or verify_pass or attention or fused_add}" \
        2>&1 | tail -70 | tee -a "$OUT/session.log"
      ;;
    random)  # pass costs with random weights of both shapes (no model file needed)
      log random
      for m in smollm2-135m qwen2.5-coder-0.5b; do
        timeout 150 python3 bench/device/profile_step.py --model $m --random --out "$OUT/profile_$m.txt" 2>&1 | head -22 | tee -a "$OUT/session.log"
      done
      ;;
    profile)
      log profile
      timeout 200 python3 bench/device/profile_step.py --model "$MODEL" --out "$OUT/profile.txt" 2>&1 | tail -30 | tee -a "$OUT/session.log"
      ;;
    loop)
      log loop
      timeout 200 python3 bench/device/profile_loop.py --model "$MODEL" --out "$OUT/loop.txt" 2>&1 | head -60 | tee -a "$OUT/session.log"
      ;;
    *) echo "unknown stage $stage" | tee -a "$OUT/session.log" ;;
  esac
done
