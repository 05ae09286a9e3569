#!/usr/bin/env bash
# Everything that belongs to one H200 device call: GPU tests, compute-sanitizer, benchmarks.
# Usage (on the GPU machine, in the repo root): OUT=dir bash bench/run_h200.sh STAGE...
# Stages: tests:<names>  memcheck:<names>  calibrate  bench_build  bench_cast  bench_accept
#         bench_compact_kv  bench_kv_append  bench_graft  bench_attention  bench_host  bench_e2e
#         host_profile (where an eager call's host time goes, per op; HOST_PROFILE_ARGS)
#         kernel_times (device µs per kernel of small attention / accept / build calls; TIMES_ARGS)
#         pytest_bench  train_bg  wait_bg  kernel_limits (ncu's counters per kernel, LIMITS_ARGS)
#         peers_bg  wait_peers (FlashInfer's JIT builds, bench/warm_peers.py, in the background;
#         PEERS_ARGS="--only attention" builds one bench's)
#         profile_step (a step's time per plan or, PROFILE_ARGS="--chains 6", one chain three ways)
#         gluon_probe (bench/gluon_attention_probe.py: a Gluon prefix-attention kernel per config,
#         each checked and timed against treeops' kernel in its own process; PROBE_ARGS)
#         cache_save
#         (<names>: comma list of op stems (tree_attention, build_tree, ...), decoder, or all). A stage may carry
#         its own time limit: calibrate@240. pytest_bench: ``python -m pytest bench
#         --benchmark-only`` (one benchmark per op at least; PYTEST_BENCH_K selects with -k), its
#         results in $OUT/pytest_bench.json. train_bg trains (or loads) bench_e2e's pair in the
#         background (bench_e2e --train-only) so GPU tests can run beside it; wait_bg waits for it
#         (put it before any timed stage).
# Tests run on XDIST workers (default 8) when pytest-xdist is importable (carry its wheel in
# .whl/): the first use of every kernel configuration compiles, and compiling is CPU-bound.
# Each stage runs under its own time limit (STAGE_LIMIT, seconds) so that one slow stage cannot
# take the others' results with it; a log per call and the JSON files land in $OUT.
# Compile caches: Triton's kernels and Inductor's (the pair's training) are kept under
# /tmp/treeops-cc; a carried .carry/compile_cache.tgz.part-* (what cache_save wrote into $OUT last
# time: copy the parts into .carry/ and carry it) seeds them, so a fresh machine skips the compiles
# an earlier one did.
set -u
OUT=${OUT:-/tmp/treeops-out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
LIMIT=${STAGE_LIMIT:-300}
export PYTHONUNBUFFERED=1
# the commit the JSON files name: the device's copy of .git can lag the working tree, so write it
# here before a call (git rev-parse HEAD > .treeops_commit; git-ignored) and it travels with it
[ -f .treeops_commit ] && export TREEOPS_COMMIT=${TREEOPS_COMMIT:-$(cat .treeops_commit)}
# SKIP_INSTALL: a caller already installed (two GPUs, two runs at once; or an earlier call on
# this machine). A fresh machine has nothing installed whatever the caller thought: install then.
if [ -n "${SKIP_INSTALL:-}" ] && ! python3 -c "import treeops.kernels" 2>/dev/null; then
  echo "SKIP_INSTALL ignored: treeops is not installed on this machine" | tee -a "$LOG"
  unset SKIP_INSTALL
fi
if [ -n "${SKIP_INSTALL:-}" ]; then
  # the peers an earlier call on this machine installed: without this path they are not found
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
[ -z "${SKIP_INSTALL:-}" ] && { python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || echo "install failed" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$LOG"
# not CC: the GPU machine exports CC (the C compiler Triton runs), and assigning it would replace it
CACHE_ROOT=/tmp/treeops-cc
if [ ! -d $CACHE_ROOT ] && ls .carry/compile_cache.tgz* >/dev/null 2>&1; then
  # one file, or the parts cache_save split it into (cat in name order rebuilds it)
  mkdir -p $CACHE_ROOT && cat .carry/compile_cache.tgz* | tar xz -C $CACHE_ROOT && echo "compile cache: $(du -sh $CACHE_ROOT | cut -f1) seeded" | tee -a "$LOG"
fi
# cache_save: both caches packed if they fit CACHE_MAX bytes, else Triton's alone, else none;
# in 15 MB parts (a file coming back from a device call is at most 16 MiB; everything carried
# into a call, the wheels included, at most 64 MiB)
cache_save() {
  local max=${CACHE_MAX:-36000000} f=/tmp/compile_cache.tgz
  tar czf $f -C $CACHE_ROOT triton inductor; echo "both caches: $(stat -c %s $f) bytes"
  [ "$(stat -c %s $f)" -le "$max" ] || { tar czf $f -C $CACHE_ROOT triton; echo "triton's: $(stat -c %s $f) bytes"; }
  [ "$(stat -c %s $f)" -le "$max" ] || { echo "too large to carry: none saved"; rm -f $f; return 1; }
  split -b 15000000 -d $f "$OUT/compile_cache.tgz.part-" && rm -f $f && ls -l "$OUT"/compile_cache.tgz.part-*
}
export -f cache_save  # the stages run in bash -c
export CACHE_ROOT OUT
mkdir -p $CACHE_ROOT/triton $CACHE_ROOT/inductor
export TRITON_CACHE_DIR=$CACHE_ROOT/triton TORCHINDUCTOR_CACHE_DIR=$CACHE_ROOT/inductor
# tests:<names> runs tests/test_<name>_gpu.py, or the gpu-marked tests of tests/test_<name>.py
files() { local f=""; [ "$1" = all ] && { echo tests; return; }; for n in ${1//,/ }; do
  if [ -f "tests/test_${n}_gpu.py" ]; then f="$f tests/test_${n}_gpu.py"; else f="$f tests/test_${n}.py"; fi
done; echo $f; }
summary=""
XD=""
python3 -c "import xdist" 2>/dev/null && XD="-n ${XDIST:-8}"
for spec in "$@"; do
  t0=$(date +%s)
  stage=${spec%@*}
  limit=$LIMIT
  [ "$spec" != "$stage" ] && limit=${spec##*@}
  case $stage in
    tests:*) cmd="python3 -m pytest -q -m gpu -p no:cacheprovider $XD --durations=8 $(files ${stage#tests:})";;
    memcheck:*) cmd="compute-sanitizer --tool memcheck --target-processes all --error-exitcode 17 python3 -m pytest -q -m gpu -k '${MEMCHECK_K:-memcheck or accept_gpu or graft_gpu}' -p no:cacheprovider $(files ${stage#memcheck:})";;
    calibrate) cmd="python3 bench/calibrate_cost_table.py --out $OUT ${CAL_ARGS:-}";;
    bench_build) cmd="python3 bench/bench_build_tree.py --out $OUT --table ${TABLE:-$OUT/cost_table_h200.json} --ops ${BUILD_OPS:-layer,rerank_build,step} ${BUILD_ARGS:-}";;
    bench_cast) cmd="python3 bench/bench_cast.py --out $OUT";;
    bench_accept) cmd="python3 bench/bench_accept.py --out $OUT ${ACCEPT_ARGS:-}";;
    bench_compact_kv) cmd="python3 bench/bench_compact_kv.py --out $OUT";;
    bench_kv_append) cmd="python3 bench/bench_kv_append.py --out $OUT";;
    bench_graft) cmd="python3 bench/bench_graft.py --out $OUT ${GRAFT_ARGS:-}";;
    bench_attention) cmd="python3 bench/bench_tree_attention.py --out $OUT ${ATT_ARGS:-}";;
    bench_host) cmd="python3 bench/bench_host.py --out $OUT/host.json ${HOST_ARGS:-}";;
    host_profile) cmd="python3 bench/host_profile.py --out $OUT/host_profile.json ${HOST_PROFILE_ARGS:-}";;
    bench_e2e) cmd="python3 bench/bench_e2e.py --out $OUT ${E2E_ARGS:-}";;
    kernel_limits) cmd="python3 bench/kernel_limits.py --out $OUT ${LIMITS_ARGS:-}";;
    kernel_times) cmd="python3 bench/kernel_times.py ${TIMES_ARGS:-} | tee $OUT/kernel_times.txt";;
    profile_step) cmd="python3 bench/profile_step.py --table ${TABLE:-bench/results/h200/e2e_cost_table.json} --out $OUT ${PROFILE_ARGS:-}";;
    pytest_bench) cmd="python3 -m pytest bench --benchmark-only -p no:cacheprovider -q --benchmark-json=$OUT/pytest_bench.json ${PYTEST_BENCH_K:+-k '$PYTEST_BENCH_K'}";;
    train_bg)  # the e2e pair trained in the background (into its /tmp cache) while tests run;
      # never beside a timed stage: wait_bg first
      mkdir -p "$OUT/train"
      nohup python3 bench/bench_e2e.py --out "$OUT/train" --train-only >"$OUT/train/log.txt" 2>&1 &
      echo $! >/tmp/treeops-train.pid
      summary="$summary\n$(printf '%-34s started' "$stage")"; continue;;
    wait_bg) cmd="while kill -0 \$(cat /tmp/treeops-train.pid) 2>/dev/null; do sleep 2; done; tail -n 3 $OUT/train/log.txt";;
    peers_bg)  # FlashInfer's nvcc builds (warm_peers.py) in the background, while tests run;
      # wait_peers before bench_accept / bench_attention, which then load them instead of compiling
      nohup python3 bench/warm_peers.py --out "$OUT" ${PEERS_ARGS:-} >"$OUT/warm_peers.log" 2>&1 &
      echo $! >/tmp/treeops-peers.pid
      summary="$summary\n$(printf '%-34s started' "$stage")"; continue;;
    wait_peers) cmd="while kill -0 \$(cat /tmp/treeops-peers.pid) 2>/dev/null; do sleep 2; done; cat $OUT/warm_peers.log";;
    gluon_probe) cmd="python3 bench/gluon_attention_probe.py --out $OUT/gluon_probe ${PROBE_ARGS:-}";;
    cache_save) cmd="cache_save";;
    *) echo "unknown stage $stage"; continue;;
  esac
  echo "=== $stage: $cmd" | tee -a "$LOG"
  # test workers: few CPU threads each (the CPU references), one timing log per stage
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TREEOPS_TEST_TIMES="$OUT/times_${stage//[:,]/_}.txt" \
    TREEOPS_GPU_TESTS=1 timeout "$limit" bash -c "$cmd" >>"$LOG" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  tail -n 25 "$LOG" | grep -E "passed|failed|error|ERROR SUMMARY|Traceback|Error" | tail -n 4
  summary="$summary\n$(printf '%-34s rc=%-4s %4ss' "$stage" "$rc" "$dt")"
done
echo -e "\n=== summary$summary" | tee -a "$LOG"
