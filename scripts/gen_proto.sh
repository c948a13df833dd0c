#!/usr/bin/env bash
# Regenerate kvxfer/v1/*_pb2*.py(i) from proto/kvxfer/v1/*.proto.
# The generator versions are pinned in constraints.txt (grpcio-tools, mypy-protobuf);
# CI regenerates into a temporary tree and fails if the committed files differ.
# Usage: scripts/gen_proto.sh [OUTPUT_ROOT]   (default: the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
python=${PYTHON:-python3}
# protoc finds its plugins (protoc-gen-mypy) next to the interpreter.
export PATH="$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH"
mkdir -p "$out/kvxfer/v1"
"$python" -m grpc_tools.protoc \
  -I "$root/proto" \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --mypy_out="$out" \
  --mypy_grpc_out="$out" \
  "$root"/proto/kvxfer/v1/*.proto
