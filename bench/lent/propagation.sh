#!/bin/bash
# On the lent machine: bench/propagation.py at SIZES devices (default 10000 20000), the
# fleet in FLEET processes, PostgreSQL servers of WORKERS processes; output in $OUT.
#   device run: bash bench/lent/propagation.sh   (carry: [".scale"]; SIZES=20000 WORKERS=4 ...)
set -e
T0=$(date +%s)
bash bench/lent/setup.sh > $OUT/setup.log 2>&1 || { tail -30 $OUT/setup.log; exit 1; }
# From the installed tree: the MNN child gets only the package root on PYTHONPATH.
rm -rf /tmp/site/bench && cp -r bench /tmp/site/bench && cd /tmp/site
export PYTHONPATH=/tmp/site SKIFF_TEST_PG=postgresql+psycopg://postgres@127.0.0.1:5432/test
echo "set up in $(( $(date +%s) - T0 )) s; $(nproc) cores"
for n in ${SIZES:-10000 20000}; do
  python3 bench/propagation.py --devices $n --fleet-processes ${FLEET:-6} \
    --workers ${WORKERS:-4} > $OUT/propagation-$n.txt 2>&1 || true
  echo "== $n devices, after $(( $(date +%s) - T0 )) s"; grep -v '^{' $OUT/propagation-$n.txt | tail -4
done
