#!/usr/bin/env bash
# The GPU first contact, budgeted for a lent machine (15 device-minutes in all, start-up
# included; at most 10 minutes a command; at most 8 files come back from $OUT).
#
#   bash bench/gpu_first_contact.sh first    # ~420 s: environment, every variant compiled
#                                            # and loaded, smoke vs float64, fp16 L=4096
#                                            # vs PyTorch flash, the GPU test files,
#                                            # memcheck and racecheck with CuPy's pool off
#   bash bench/gpu_first_contact.sh second   # ~300 s, after a clean first: the PyTorch
#                                            # bridge on CUDA tensors (fp16/bf16 gradients),
#                                            # the CuPy backend subset, tiny GPT on CuPy, the
#                                            # wider benchmark, decode, L=131072, synccheck
#   TESTS='tests/x.py::test_a ...' bash bench/gpu_first_contact.sh rerun
#                                            # after a fix: environment, variants, smoke,
#                                            # those tests (default: the GPU test files)
#   STAGES=env,tiny_gpt,decode bash bench/gpu_first_contact.sh second   # any stages
#   (also cupy_all: every ops/nn test on CuPy; fwd_mt_ab: forward MT=1 vs MT=2 tiles;
#   ab_fwd, ab_bwd, ab_decode(_kernels): the v1 and v2 kernel variants one after the other
#   (ab_bwd: backward v2 and v4, or AB_VARIANTS; ab_fwd_f32: float32 forward v2 (CUDA
#   cores) and v3 (TF32x3); ab_fwd96: fp16 D = 96 forward on v1's tiles and on
#   aa_fwd_tc2's, ARRAYATTN_FWD_TC2_D96=0/1; ab_bwd256: fp16 D = 256 backward on CUDA
#   cores and on tensor cores, ARRAYATTN_BWD_D256_TC=0/1/32);
#   bench_cudnn: the kernels against PyTorch's cuDNN backend;
#   flex_bench: block masks vs PyTorch flex_attention; ab_flex: the same with the block-mask
#   backward under ARRAYATTN_BWD_VARIANT=v2 and v4 (one fwd+bwd row each, AB_FLEX_VARIANTS),
#   beside PyTorch's compiled flex_attention in one run; ab_flex_pred: built-in mask_mods
#   evaluated in the kernels vs their bits (ARRAYATTN_FLEX_PREDICATE=0/1); f32_accuracy:
#   float32 forward v2/v3
#   against float64; SANITIZE_ENV: switches for the
#   sanitizers only;
#   host: where a small call's host time goes; RACE_DTYPES: racecheck's dtypes;
#   WIDE_LENGTHS: bench_wide's lengths; AB_VARIANTS: the variants ab_* compare)
#
# Every stage runs under `timeout` with min(its cap, the time left of BUDGET seconds), so a
# hang costs one stage and the last stages are skipped, never the whole run. Everything is
# appended to $OUT/log.txt as it happens (PYTHONUNBUFFERED); $OUT/status.txt has one line
# per stage (name, exit code, seconds). Files in $OUT (at most 8): log.txt, status.txt,
# variants.md (the driver's figures for every variant), bench.md, memcheck_plant.txt,
# memcheck.txt, racecheck.txt or synccheck.txt, kernel_cache.tgz (CuPy's compiled kernels: carry it back as
# .gpucache/kernel_cache.tgz to skip compiling in a later call).
#
# The lent machines have CuPy, PyTorch, pytest(-xdist, -timeout) and hypothesis but not
# array-api-compat: carry it as a wheel (docs/gpu.md, "What to bring to the machine").
# Without a GPU every stage fails fast with a clear line and the files are still written
# (tests/test_gpu_first_contact.py runs it so).
set -u
cd "$(dirname "$0")/.."
plan=${1:-first}
case $plan in first | second | rerun) ;; *)
  echo "usage: $0 first|second|rerun" >&2
  exit 2
  ;;
esac
out=${OUT:-gpu-run}
mkdir -p "$out"
log=$out/log.txt
status=$out/status.txt
: >"$status"
budget=${BUDGET:-$([ "$plan" = second ] && echo 300 || echo 420)}
t_start=$(date +%s)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/arrayattn-cupy-cache}
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX must not take the GPU's memory
mkdir -p "$CUPY_CACHE_DIR"

note() { echo "$*" | tee -a "$log"; }

wheels=${WHEELS:-.whl} # wheels carried to the machine (array-api-compat)
if compgen -G "$wheels/*.whl" >/dev/null; then
  timeout -k 5 60 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/arrayattn-site "$wheels"/*.whl >>"$log" 2>&1 || note "wheel install failed"
  export PYTHONPATH="/tmp/arrayattn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -f .gpucache/kernel_cache.tgz ]; then
  tar xzf .gpucache/kernel_cache.tgz -C "$CUPY_CACHE_DIR" 2>>"$log" &&
    note "kernel cache restored: $(ls "$CUPY_CACHE_DIR" | wc -l) files"
fi
note "plan=$plan budget=${budget}s out=$out $(date -u +%FT%TZ)"

# stage NAME CAP COMMAND...: run under timeout min(CAP, time left); one status line.
stage() {
  local name=$1 cap=$2
  shift 2
  if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then return 0; fi
  local left=$((budget - ($(date +%s) - t_start)))
  if [ "$left" -lt 10 ]; then
    printf '%-14s skipped: %ss of the budget left\n' "$name" "$left" | tee -a "$status" "$log"
    return 0
  fi
  local t=$((cap < left ? cap : left)) s0 rc
  s0=$(date +%s)
  note "=== $name (timeout ${t}s): $*"
  # bash -c: the stage may be one of the exported functions below
  timeout -k 5 "$t" bash -c '"$@"' bash "$@" >>"$log" 2>&1
  rc=$?
  local msg=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && msg=" (timed out)"
  printf '%-14s rc=%-3s %4ss%s\n' "$name" "$rc" "$(($(date +%s) - s0))" "$msg" |
    tee -a "$status" "$log"
}

# sanitize NAME CAP TOOL ARGS...: compute-sanitizer with its own log; the status line
# carries the error count from that log (the exit code alone says little).
sanitize() {
  local name=$1 cap=$2 tool=$3
  shift 3
  if [[ ",$STAGES," != *",$name,"* ]]; then return 0; fi
  local san
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$san" ]; then
    printf '%-14s skipped: compute-sanitizer not found\n' "$name" | tee -a "$status" "$log"
    return 0
  fi
  # SANITIZE_ENV: switches for the sanitized run only (e.g. ARRAYATTN_FLEX_BWD_KERNELS=1)
  # shellcheck disable=SC2086 # a list of NAME=VALUE words
  stage "$name" "$cap" env ${SANITIZE_ENV:-} "$san" --tool "$tool" --print-limit 30 --log-file "$out/$name.txt" \
    --error-exitcode 3 "$py" bench/gpu_sanitize.py --no-pool "$@"
  [ -f "$out/$name.txt" ] &&
    note "$name: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$out/$name.txt" | tail -2 | tr '\n' ' ')" &&
    grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$out/$name.txt" | tail -2 | sed "s/^/$name: /" >>"$status"
}

env_py='
import json, time
import cupy as cp
p = cp.cuda.runtime.getDeviceProperties(0)
info = {k: p[k] for k in ("name", "multiProcessorCount", "sharedMemPerBlockOptin",
        "sharedMemPerMultiprocessor", "l2CacheSize", "totalGlobalMem", "major", "minor",
        "clockRate", "memoryClockRate", "memoryBusWidth") if k in p}
info["name"] = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
info["cupy"] = cp.__version__
info["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
info["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
info["nvrtc"] = cp.cuda.nvrtc.getVersion()
info["cupy_bfloat16"] = hasattr(cp, "bfloat16")
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.cuda.is_available()
    info["cudnn"] = torch.backends.cudnn.version()
except Exception as exc:
    info["torch"] = repr(exc)
try:
    import numpy, array_api_compat
    info["numpy"] = numpy.__version__
    info["array_api_compat"] = array_api_compat.__version__
except Exception as exc:
    info["array_api_compat"] = repr(exc)
print(json.dumps(info))
# HBM bandwidth: a 2 GiB device-to-device copy, bytes read + written, median of 10.
n = 2 * 2**30
a = cp.ones(n // 4, dtype=cp.float32)
b = cp.empty_like(a)
ts = []
for i in range(12):
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(); b[...] = a; e.record(); e.synchronize()
    if i >= 2:
        ts.append(cp.cuda.get_elapsed_time(s, e))
ts.sort()
print(f"copy bandwidth: {2 * n / (ts[len(ts) // 2] * 1e-3) / 1e9:.0f} GB/s (read + write, 2 GiB)")
'

env_stage() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  "$py" -c "$env_py" || return 1
  (command -v compute-sanitizer && compute-sanitizer --version | tail -1) || echo "no compute-sanitizer on PATH"
  (command -v nvcc && nvcc --version | tail -2) || echo "no nvcc on PATH"
}

gpu_tests() { # pytest over the GPU test files, no -x, per-test timeout
  "$py" -m pytest -q -p no:cacheprovider -n "${JOBS:-8}" --maxfail=25 --timeout=120 -rfE "$@"
}

export py env_py
export -f env_stage gpu_tests

# The plans are lists of stages (STAGES=a,b,... picks any of them, in this order).
case $plan in
first) default=env,variants,smoke,bench,tests,memcheck_plant,memcheck,racecheck ;;
second) default=env,variants,bridges,bridge_bench,bench_wide,bench_fp32,decode,long,tiny_gpt,cupy_tests,synccheck ;;
rerun) default=env,variants,smoke,tests ;;
esac
STAGES=${STAGES:-$default}
TESTS=${TESTS:-tests/kernels/test_fused_gpu.py tests/kernels/test_backward_gpu.py \
tests/test_dask_tasks_gpu.py tests/nn/test_paged_kernel.py}

stage env 60 env_stage
stage variants 120 "$py" bench/gpu_variants.py --jobs 14 --out "$out/variants.md"
stage smoke 90 "$py" bench/gpu_sanitize.py --check
stage bench 100 "$py" bench/gpu_bench.py --dtypes float16 --head-dims 64,128 \
  --lengths 4096 --backward --no-composed --no-append --reps 30 --out "$out/bench.md"
# A/B of the kernel variants (issue 36): today's (v1) and the new (v2), the same grid each,
# one switch at a time; the tables' header lines name the switch
ab() { # ab SWITCH ARGS...: gpu_bench.py with SWITCH=each of AB_VARIANTS (default v1 v2)
  local switch=$1 v
  shift
  for v in ${AB_VARIANTS:-v1 v2}; do
    env "$switch=$v" "$py" bench/gpu_bench.py --no-composed --no-append "$@"
  done
}
export -f ab
# the backward: v2 (the default) against v4 (AB_VARIANTS="v2 v3 v4" adds v3)
ab_bwd() { AB_VARIANTS="${AB_VARIANTS:-v2 v4}" ab "$@"; }
export -f ab_bwd
stage ab_fwd 80 ab ARRAYATTN_FWD_VARIANT --dtypes float16 --head-dims 64,128 \
  --lengths 2048,8192 --reps 15 --out "$out/bench.md"
# fp16 D = 96: v1's aa_fwd_tc (32-key tiles, ARRAYATTN_FWD_TC2_D96=0, today's default)
# against aa_fwd_tc2 (64-key tiles, =1), both under the default variant v3, and PyTorch
ab_fwd96() { AB_VARIANTS="0 1" ab "$@"; }
export -f ab_fwd96
stage ab_fwd96 70 ab_fwd96 ARRAYATTN_FWD_TC2_D96 --dtypes float16 --head-dims 96 \
  --lengths 2048,8192 --reps 15 --out "$out/bench.md"
# float32: v2 (aa_fwd_simt, CUDA cores) against v3 (aa_fwd_tf32, three TF32 products)
ab_fwd_f32() { AB_VARIANTS="v2 v3" ab "$@"; }
export -f ab_fwd_f32
stage ab_fwd_f32 90 ab_fwd_f32 ARRAYATTN_FWD_VARIANT --dtypes float32 --head-dims 64,128 \
  --lengths 2048,8192 --reps 9 --out "$out/bench.md"
stage f32_accuracy 60 "$py" bench/gpu_f32_accuracy.py --out "$out/bench.md"
# backward v4 (aa_bwd_dkdv_mma4) at head dims 64 and 128; v3 (AB_VARIANTS) has 64 only
stage ab_bwd 120 ab_bwd ARRAYATTN_BWD_VARIANT --dtypes float16 --head-dims 64,128 --lengths 4096 \
  --backward --reps 15 --out "$out/bench.md"
# fp16 D = 256 forward + backward: the CUDA-core backward (ARRAYATTN_BWD_D256_TC=0, today's
# default) against v4's aa_bwd_dkdv_mma4 on tensor cores with 64-row (=1) and 32-row (=32)
# query steps, and PyTorch; AB_VARIANTS="0 1" for old vs new only
ab_bwd256() { AB_VARIANTS="${AB_VARIANTS:-0 1 32}" ab "$@"; }
export -f ab_bwd256
stage ab_bwd256 110 ab_bwd256 ARRAYATTN_BWD_D256_TC --dtypes float16 --head-dims 256 \
  --lengths 2048 --backward --reps 10 --out "$out/bench.md"
# flex_bench: block masks in the kernels (backward kernels opt-in on) against PyTorch's
# compiled flex_attention on the same mask_mod (issue 32)
stage flex_bench 120 "$py" bench/gpu_flex_bench.py --out "$out/bench.md"
# ab_flex: the block-mask backward's dK/dV kernel, v2's FLEX (aa_bwd_dkdv_mma2) against v4's
# (aa_bwd_dkdv_mma4<..., true>), fwd+bwd rows in the same table as PyTorch's (issue 32)
stage ab_flex 150 "$py" bench/gpu_flex_bench.py --bwd-variants "${AB_FLEX_VARIANTS:-v2,v4}" \
  --out "$out/bench.md"
# ab_flex_pred: built-in mask_mods evaluated in the kernels (a generated predicate, no bits
# in the table; ARRAYATTN_FLEX_PREDICATE=1) against the partial blocks' bits (the default, =0),
# the same packed documents, forward and forward + backward (no PyTorch rows)
ab_flex_pred() {
  local v
  for v in 0 1; do
    env ARRAYATTN_FLEX_PREDICATE=$v "$py" bench/gpu_flex_bench.py --no-torch "$@" || return 1
  done
}
export -f ab_flex_pred
stage ab_flex_pred 90 ab_flex_pred --out "$out/bench.md"
stage ab_decode 60 ab ARRAYATTN_DECODE_VARIANT --decode 4096,16384,65536,131072 --reps 30 \
  --out "$out/bench.md"
stage ab_decode_kernels 40 "$py" bench/gpu_decode_kernels.py --out "$out/bench.md"
# shellcheck disable=SC2086 # TESTS is a list of test files or ids
stage tests 150 gpu_tests $TESTS
# bridges: arrayattn.torch on CUDA tensors (DLPack to CuPy, bfloat16 as int16 storage),
# gradients against PyTorch's SDPA autograd in float16/bfloat16/float32 (issue 31)
stage bridges 90 gpu_tests tests/bridges/torch/test_function_gpu.py
# bridge_bench: bfloat16 and float16 through arrayattn.torch vs PyTorch flash, same tensors
stage bridge_bench 90 "$py" bench/gpu_torch_bridge.py --out "$out/bench.md"
stage cupy_tests 120 env ARRAYATTN_BACKENDS=cupy "$py" -m pytest -q -p no:cacheprovider \
  -n "${JOBS:-8}" --maxfail=25 --timeout=120 -rfE tests/ops/test_attention.py \
  tests/ops/test_vjp.py tests/ops/test_sinks_alibi.py tests/ops/test_lengths.py \
  tests/ops/test_varlen.py tests/nn/test_paged_kernel.py tests/nn/test_kv_cache_batched.py
stage cupy_all 150 env ARRAYATTN_BACKENDS=cupy "$py" -m pytest -q -p no:cacheprovider \
  -n "${JOBS:-8}" --maxfail=25 --timeout=120 -rfE tests/ops tests/nn
stage fwd_mt_ab 60 bash -c 'for mt in 1 2; do ARRAYATTN_FWD_TC_MT=$mt "$0" bench/gpu_bench.py \
  --dtypes float16 --head-dims 64,128 --lengths 4096 --no-composed --no-append --reps 30 \
  --out "$1"; done' "$py" "$out/bench.md"
stage tiny_gpt 60 "$py" examples/tiny_gpt.py --xp cupy --steps 150 --new-tokens 20
stage bench_wide 120 "$py" bench/gpu_bench.py --dtypes float16 --head-dims 64,128 \
  --lengths "${WIDE_LENGTHS:-1024,2048,8192,16384}" --backward --no-composed --no-append --reps 15 \
  --out "$out/bench.md"
# bench_cudnn: the same kernels against PyTorch's cuDNN attention (the other backend
# PyTorch offers for 16-bit on Hopper), forward and backward
stage bench_cudnn 60 "$py" bench/gpu_bench.py --dtypes float16 --head-dims 64,128 \
  --lengths 2048,8192 --backward --torch-backend cudnn --no-composed --no-append --reps 9 \
  --out "$out/bench.md"
stage bench_fp32 60 "$py" bench/gpu_bench.py --dtypes float32,float64 --head-dims 128 \
  --lengths 2048 --backward --no-composed --no-append --reps 9 --out "$out/bench.md"
# decode: the split-KV decode kernels, then the prefill kernel they replace (A/B)
stage decode 60 bash -c 'for d in 1 0; do ARRAYATTN_FUSED_DECODE=$d "$0" bench/gpu_bench.py \
  --decode 4096,16384,65536,131072 --reps 30 --out "$1"; done' "$py" "$out/bench.md"
stage long 60 "$py" bench/gpu_bench.py --long --out "$out/bench.md"
# host: where the host time of a small fused call goes (cProfile of the decode call)
stage host 60 "$py" bench/gpu_host_overhead.py
sanitize memcheck_plant 30 memcheck --plant-oob --dtypes none # must report 1 error
# shellcheck disable=SC2086 # MEMCHECK_ARGS: extra gpu_sanitize.py words (e.g. --small --dtypes float16)
sanitize memcheck 90 memcheck ${MEMCHECK_ARGS:-}
sanitize racecheck 90 racecheck --small --dtypes "${RACE_DTYPES:-float16,float32,bfloat16,float64}"
sanitize synccheck 40 synccheck --small --dtypes float16,float32

# jax_gpu (last: the sanitizers come first when time is short): arrayattn.jax (custom_vjp, our backward) on JAX's default device there, the GPU
# (float32 matmuls at full precision: JAX uses TF32 on the GPU by default, and the tests
# compare float32 results to 1e-5)
stage jax_gpu 90 env JAX_DEFAULT_MATMUL_PRECISION=highest bash -c 'gpu_tests tests/bridges/jax'

if [ -n "$(ls -A "$CUPY_CACHE_DIR" 2>/dev/null)" ]; then
  tar czf "$out/kernel_cache.tgz" -C "$CUPY_CACHE_DIR" . 2>>"$log"
  size=$(stat -c %s "$out/kernel_cache.tgz")
  if [ "$size" -gt $((15 * 2**20)) ]; then
    rm -f "$out/kernel_cache.tgz"
    note "kernel cache ${size} B: over what comes back, not kept"
  fi
fi
note "total $(($(date +%s) - t_start))s of ${budget}s"
echo "---- status"
cat "$status"
