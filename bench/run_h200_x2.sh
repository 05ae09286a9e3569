#!/usr/bin/env bash
# Two lists of run_h200.sh stages at once on a two-GPU machine (nvidia-h200-x2): device time is
# counted per machine held, so two GPUs halve the time of the GPU work.
# Usage: OUT=dir GPU0="tests:... memcheck:..." GPU1="bench_build bench_e2e@400" bash bench/run_h200_x2.sh
# Installs once; each list runs under CUDA_VISIBLE_DEVICES=i with its log and JSON in $OUT/gpu<i>,
# packed at the end into $OUT/results.tgz (tar xzf it; a call brings back about 8 files at most).
set -u
OUT=${OUT:-/tmp/treeops-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/treeops-install.txt 2>&1 || echo "install failed"
export SKIP_INSTALL=1 XDIST=${XDIST:-12}
i=0
for stages in "${GPU0:-}" "${GPU1:-}"; do
  if [ -n "$stages" ]; then
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$i OUT=$OUT/gpu$i bash bench/run_h200.sh $stages >"$OUT/gpu$i.txt" 2>&1 &
  fi
  i=$((i + 1))
done
wait
for i in 0 1; do [ -f "$OUT/gpu$i.txt" ] && { echo "--- GPU $i"; grep -A20 "=== summary" "$OUT/gpu$i.txt"; }; done
# a call brings back only a few files: everything else travels as one archive
tar czf "$OUT/results.tgz" -C "$OUT" $(cd "$OUT" && ls -d gpu0 gpu1 2>/dev/null) && rm -rf "$OUT/gpu0" "$OUT/gpu1"
ls -la "$OUT"
