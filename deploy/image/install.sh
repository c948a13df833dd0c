#!/bin/sh
# Install the kvxfer sidecar into a new venv: only what `kvxfer-server` imports.
#   deploy/image/install.sh VENV SOURCE_DIR [GPU]
# The Dockerfile's build stage runs this; tests/test_deploy.py runs the very same
# script in a fresh venv (no Docker daemon in CI), runs a sidecar from it and
# measures its size. GPU=true adds CuPy for the CUDA IPC path.
set -eu
venv=$1
src=$2
gpu=${3:-false}
case $gpu in
    true | false) ;;
    *) echo "install.sh: GPU must be true or false, got '$gpu'" >&2; exit 2 ;;
esac
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
# --no-deps: nixl-cu12 declares torch (and through it CUDA wheels) that the
# sidecar never imports; requirements.txt lists every dependency explicitly.
$pip install --no-deps -r "$src/deploy/image/requirements.txt"
if [ "$gpu" = true ]; then
    $pip install --no-deps -r "$src/deploy/image/requirements-gpu.txt"
fi
$pip install --no-deps "$src"
# nixl-cu12 also ships nixl_ep_cu12 (expert-parallel kernels built against torch,
# ~100 MB): the sidecar never imports it. Nor does it need pip or setuptools.
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$site/nixl_ep_cu12"
$pip uninstall -q -y setuptools pip
# Fails the build if a module the sidecar imports is missing (run outside $src, so
# that `kvxfer` is the installed package).
cd /
"$venv/bin/python" -c "import kvxfer.server.main, kvxfer.dataplane.adapter, nixl_cu12"
