#!/usr/bin/env bash
# One command under each value of one environment variable (a switch read at import, such as
# TREEOPS_PDL), the values alternated and the whole round run twice, in one GPU call; then each
# results file side by side (bench/ab_table.py). Labels are <var><value><round>: TREEOPS_PDL0a ...
# Usage: OUT=dir AB_VAR=TREEOPS_PDL [AB_VALUES="0 1"] \
#          [AB_FILES="tree_build_cast.json attention_latency.json:auto_cold"] \
#          bash bench/env_ab.sh 'python3 bench/bench_build_tree.py --out $OUT/$LABEL --quick'
# (AB_FILES: file[:field], the field treeops_us by default.)
set -u
OUT=${OUT:-/tmp/treeops-ab}
mkdir -p "$OUT"
cmd=$1
var=${AB_VAR:?AB_VAR names the environment variable}
labels=()
for round in a b; do
  for value in ${AB_VALUES:-0 1}; do
    label=$var$value$round
    labels+=("$label")
    (export "$var=$value"; LABEL=$label OUT=$OUT bash -c "$cmd") >"$OUT/ab_$label.log" 2>&1
    echo "=== $label: rc=$? log $OUT/ab_$label.log"
  done
done
for spec in ${AB_FILES:-tree_build_cast.json}; do
  file=${spec%%:*} field=treeops_us
  [ "$file" != "$spec" ] && field=${spec#*:}
  echo "=== $file ($field)"
  python3 "$(dirname "$0")/ab_table.py" "$OUT" "$file" "${labels[@]}" --field "$field"
done
