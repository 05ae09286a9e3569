#!/usr/bin/env bash
# A/B of a change on one GPU machine, every variant in the same call: each variant is a copy of
# this tree with the files under its directory (paths as in the repository: kernels/...,
# treeops/...) copied over it, imported from there (PYTHONPATH) in its own process, the command
# run from its root with $LABEL and $OUT set. Variants run in the order given; repeat one to
# see the run-to-run spread.
# Usage: OUT=dir bash bench/ab_trees.sh 'python3 bench/bench_build_tree.py --out $OUT/$LABEL \
#            --ops layer,step --batches 1,64' old=dir_a new=dir_b old2=dir_a
# A directory that is empty (or "-") is this tree unchanged.
set -u
OUT=${OUT:-/tmp/treeops-ab}
mkdir -p "$OUT"
cmd=$1
shift
for spec in "$@"; do
  label=${spec%%=*} dir=${spec#*=} root=/tmp/treeops-ab-$label
  rm -rf "$root" && mkdir -p "$root"
  tar cf - --exclude=.git --exclude=.whl --exclude=.venv . | tar xf - -C "$root"
  [ "$dir" != "-" ] && [ -d "$dir" ] && cp -r "$dir"/. "$root"/
  # the installed layout (treeops.kernels, treeops.reference) from the repository's
  ln -sfn ../kernels "$root/treeops/kernels"; ln -sfn ../reference "$root/treeops/reference"
  echo "=== $label ($dir): $cmd"
  (cd "$root" && LABEL=$label OUT=$OUT PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} bash -c "$cmd") \
    >"$OUT/ab_$label.log" 2>&1
  echo "rc=$? log $OUT/ab_$label.log"
  tail -n 5 "$OUT/ab_$label.log"
done
