#!/usr/bin/env bash
# The GPU checks of the compiled rollout engine, as one script for one CUDA machine (about 10 minutes on an H200):
# the CUDA-only tests (the diffusion forwards' graphs, with the FP8 cache too, the autoregressive decode step's and
# LLaDA2's FP8 experts' grouped matmul),
# then `dllm-ais bench precision` (bf16 and fp8, eager and compiled, batch 8 and 64, a whole GRPO step, the unified
# precision flow's step beside them with the GiB the models hold; the tests of tests/test_precision_flow.py on CPU
# cover its numerics, here its speed and memory). Run from the
# repository root with the package importable (PYTHONPATH=$PWD, or installed); wheels under .whl/ are installed into
# /tmp/site first (a machine without a registry). Logs go to $OUT (default outputs/gpu-checks).
# The recipe's own decoding and Dream-7B's shape, the rollouts only (about 4 minutes each):
#   TESTS_TIMEOUT=1 PARTS=rollouts BENCH_ARGS="--steps 128 --engines eager,compiled" bash tools/gpu_checks.sh
#   TESTS_TIMEOUT=1 PARTS=rollouts BENCH_ARGS="--shape dream-7b" bash tools/gpu_checks.sh
# LLaDA2.0-mini's shape (random weights, ~32 GB in bf16; FP8 experts through torch._scaled_grouped_mm, Hopper and
# later), the rollouts only, its blocks of 32 and a step per position (not run yet):
#   TESTS_TIMEOUT=1 PARTS=rollouts BENCH_ARGS="--shape llada2-mini --steps 256" bash tools/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-outputs/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
if compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, torchao, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/device.log"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -s -p no:cacheprovider tests/test_static_forwards.py tests/test_llada2_training.py -k cuda 2>&1 \
  | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-420}" python3 -m dllm_ais.cli bench precision --precisions "${PRECISIONS:-bf16,fp8}" \
  --batch "${BATCHES:-8,64}" --parts "${PARTS:-rollouts,step}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# The threshold decoder (Fast-dLLM's 0.9, its counts on the device, about one host read per block), eager and compiled
# (random weights rarely pass the threshold: about one commit a step, the decoder's slowest case).
timeout "${THRESHOLD_TIMEOUT:-150}" python3 -m dllm_ais.cli bench precision --precisions fp8 --batch 64 \
  --parts rollouts --engines eager,compiled --threshold 0.9 --gen-length 64 2>&1 | tee "$OUT/bench-threshold.log"
