#!/usr/bin/env bash
# Regenerates protos/*_pb2.py, *_pb2_grpc.py and *.pyi from protos/*.proto.
# The output is committed; `make check-protos` fails if regenerating changes it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . \
  --python_out=. --grpc_python_out=. --mypy_out=quiet:. \
  protos/*.proto
