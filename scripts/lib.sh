#!/usr/bin/env bash
# Shared set-up for boxoffice's scripts: installs what is missing and starts local services.
# Every step is idempotent: it checks first and does nothing when the thing is already there.
set -euo pipefail

BOXOFFICE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NISSHI_VERSION="0.8.1"
TEST_BROKER_ADDR="${BOXOFFICE_TEST_BROKER_ADDR:-127.0.0.1:19092}"
STATE_DIR="$BOXOFFICE_ROOT/.boxoffice"

# Bold on a terminal only: a log file gets plain text.
log() { if [ -t 2 ]; then printf '\033[1m==> %s\033[0m\n' "$*" >&2; else printf '==> %s\n' "$*" >&2; fi; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Debian packages the Kafka client (librdkafka, built from source by rdkafka's cmake-build,
# with OpenSSL for TLS and SASL/SCRAM to the brokers).
ensure_build_deps() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
  dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || missing+=(libcurl4-openssl-dev)
  dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
  command -v pg_isready >/dev/null 2>&1 || missing+=(postgresql-client)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  command -v cargo >/dev/null 2>&1 || { echo "cargo (Rust stable) is required" >&2; exit 1; }
}

# Redis on 127.0.0.1:6379 for the waiting room (queue, rate buckets, revocation): installed
# from Debian if missing, started without persistence if nothing answers there.
ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1; then
    log "installing redis-server"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  if port_open 127.0.0.1:6379; then return; fi
  log "starting redis-server on 127.0.0.1:6379"
  redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
  for _ in $(seq 1 50); do port_open 127.0.0.1:6379 && return; sleep 0.1; done
  echo "redis-server did not open 127.0.0.1:6379" >&2; exit 1
}

# The test runner.
ensure_nextest() {
  if ! cargo nextest --version >/dev/null 2>&1; then
    log "installing cargo-nextest (first time only)"
    cargo install cargo-nextest --locked
  fi
}

# PostgreSQL on 127.0.0.1:5432 (trust auth), started if it is installed but stopped.
# The PostgreSQL port the run will use: from DATABASE_URL (the tests) or
# BOXOFFICE_DATABASE_URL (the product and the drills), else 5432.
pg_port() {
  local url="${DATABASE_URL:-${BOXOFFICE_DATABASE_URL:-}}" p
  p=$(printf '%s' "$url" | sed -nE 's#^[a-z]+://[^/?]*:([0-9]+)([/?].*)?$#\1#p')
  echo "${p:-5432}"
}

ensure_postgres() {
  local port; port=$(pg_port)
  if pg_isready -h 127.0.0.1 -p "$port" -q 2>/dev/null; then return; fi
  log "starting PostgreSQL (port $port)"
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    local cluster
    cluster=$(pg_lsclusters --no-header 2>/dev/null | awk -v p="$port" '$3 == p { print $1 " " $2; exit }')
    if [ -z "$cluster" ]; then
      echo "no PostgreSQL cluster listens on port $port (pg_lsclusters): create one or fix the database URL" >&2; exit 1
    fi
    # shellcheck disable=SC2086
    as_root pg_ctlcluster --skip-systemctl-redirect $cluster start || as_root pg_ctlcluster $cluster start
  else
    echo "PostgreSQL is not installed: install PostgreSQL 15 (trust auth on 127.0.0.1:5432)" >&2; exit 1
  fi
  for _ in $(seq 1 50); do pg_isready -h 127.0.0.1 -p "$port" -q && return; sleep 0.2; done
  echo "PostgreSQL did not become ready on port $port" >&2; exit 1
}

# The Kafka-protocol broker used by the integration tests (nisshi, pinned; built once into
# ~/.cargo/bin — about 20 minutes on 2 cores the first time, skipped afterwards).
ensure_nisshi() {
  if command -v nisshi >/dev/null 2>&1 && nisshi --version 2>/dev/null | grep -q "$NISSHI_VERSION"; then return; fi
  if [ -x "$HOME/.cargo/bin/nisshi" ] && "$HOME/.cargo/bin/nisshi" --version 2>/dev/null | grep -q "$NISSHI_VERSION"; then return; fi
  log "installing the nisshi $NISSHI_VERSION broker (first time only; ~20 min on 2 cores)"
  cargo install nisshi --version "$NISSHI_VERSION" --locked --ignore-rust-version
}

# Schemathesis (pinned, from PyPI) in a venv of its own under ~/.cache/boxoffice: the
# contract test (`st run` against a server of its own) needs it. Skipped when present.
SCHEMATHESIS_VERSION="4.32.5"
SCHEMATHESIS_VENV="${BOXOFFICE_SCHEMATHESIS_VENV:-$HOME/.cache/boxoffice/venv}"
ensure_schemathesis() {
  local st="$SCHEMATHESIS_VENV/bin/st"
  if [ -x "$st" ] && [ "$("$st" --version 2>/dev/null)" = "st, version $SCHEMATHESIS_VERSION" ]; then return; fi
  ensure_python_venv
  log "installing schemathesis $SCHEMATHESIS_VERSION into $SCHEMATHESIS_VENV (first time only)"
  local started=$SECONDS
  python3 -m venv "$SCHEMATHESIS_VENV"
  "$SCHEMATHESIS_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "schemathesis==$SCHEMATHESIS_VERSION"
  log "schemathesis installed in $((SECONDS - started)) s"
}

# Python with venv and ensurepip (Debian splits them out of python3).
ensure_python_venv() {
  if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    log "installing python3-venv"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
  fi
}

# The offline checks of infra/ (infra/check): python-hcl2 for infra/tests and checkov, both
# pinned, from PyPI, under ~/.cache/boxoffice/infra-venv and apart from Schemathesis's venv.
# They need two venvs there: checkov depends on bc-python-hcl2, a fork that installs the same
# `hcl2` package as python-hcl2. Each is skipped when its pinned version is present.
INFRA_HCL2_VERSION="8.1.4"
INFRA_CHECKOV_VERSION="3.3.30"
INFRA_VENV="${BOXOFFICE_INFRA_VENV:-$HOME/.cache/boxoffice/infra-venv}"
# Whether venv $1 has distribution $2 at version $3.
infra_tool_version() {
  local py="$INFRA_VENV/$1/bin/python"
  [ -x "$py" ] && [ "$("$py" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null)" = "$3" ]
}
ensure_infra_tools() {
  local started=$SECONDS todo=() t
  infra_tool_version hcl2 python-hcl2 "$INFRA_HCL2_VERSION" || todo+=("hcl2:python-hcl2==$INFRA_HCL2_VERSION")
  infra_tool_version checkov checkov "$INFRA_CHECKOV_VERSION" && [ -x "$INFRA_VENV/checkov/bin/checkov" ] \
    || todo+=("checkov:checkov==$INFRA_CHECKOV_VERSION")
  [ ${#todo[@]} -eq 0 ] && return
  ensure_python_venv
  for t in "${todo[@]}"; do
    log "installing ${t#*:} into $INFRA_VENV/${t%%:*} (first time only)"
    python3 -m venv "$INFRA_VENV/${t%%:*}"
    "$INFRA_VENV/${t%%:*}/bin/python" -m pip install -q --disable-pip-version-check "${t#*:}"
  done
  log "infra tools installed in $((SECONDS - started)) s"
}

# promtool, which checks deploy/observability's alert rules and runs their unit tests
# (crates/boxoffice/src/observability.rs). Skipped when one is on PATH; otherwise the binary is
# taken from Debian's `prometheus` package (apt-get download + extract, about 10 s the first
# time: 19 MB) into ~/.cache/boxoffice rather than installing the package, which would pull the
# web UI's JavaScript and start a Prometheus server where services start. Prints its path.
PROMTOOL_DIR="${BOXOFFICE_PROMTOOL_DIR:-$HOME/.cache/boxoffice/promtool}"
ensure_promtool() {
  if command -v promtool >/dev/null 2>&1; then command -v promtool; return; fi
  if [ -x "$PROMTOOL_DIR/usr/bin/promtool" ]; then echo "$PROMTOOL_DIR/usr/bin/promtool"; return; fi
  log "fetching promtool from Debian's prometheus package into $PROMTOOL_DIR (first time only)"
  local started=$SECONDS tmp
  tmp=$(mktemp -d)
  as_root apt-get update -qq >&2
  (cd "$tmp" && apt-get download -qq prometheus >&2 2>/dev/null)
  mkdir -p "$PROMTOOL_DIR"
  dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$PROMTOOL_DIR" ./usr/bin/promtool >&2
  rm -rf "$tmp"
  "$PROMTOOL_DIR/usr/bin/promtool" --version >/dev/null
  log "promtool fetched in $((SECONDS - started)) s"
  echo "$PROMTOOL_DIR/usr/bin/promtool"
}

# The dashboard's browser test (crates/drills/tests/it/dashboard.rs): Debian's chromium, and
# the playwright-core pinned in crates/drills/tests/browser/package-lock.json, `npm ci`-ed
# into a directory of its own under ~/.cache/boxoffice (skipped when the pinned version is
# there; `npx playwright install` is never used: the test drives the system's chromium).
# Needs node 20 or later; without it the browser test fails and says so.
PLAYWRIGHT_VERSION="1.65.1"
export BOXOFFICE_PLAYWRIGHT_DIR="${BOXOFFICE_PLAYWRIGHT_DIR:-$HOME/.cache/boxoffice/playwright-$PLAYWRIGHT_VERSION}"
ensure_browser_tools() {
  local started=$SECONDS src="$BOXOFFICE_ROOT/crates/drills/tests/browser" did=""
  if ! command -v chromium >/dev/null 2>&1; then
    log "installing chromium (first time only)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    did=1
  fi
  export BOXOFFICE_CHROMIUM="${BOXOFFICE_CHROMIUM:-$(command -v chromium)}"
  if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' 2>/dev/null \
     || ! command -v npm >/dev/null 2>&1; then
    log "node 20+ and npm are missing: the dashboard's browser test will fail (install Node.js 20)"
    return
  fi
  local have
  have=$(node -p "require('$BOXOFFICE_PLAYWRIGHT_DIR/node_modules/playwright-core/package.json').version" 2>/dev/null || true)
  if [ "$have" != "$PLAYWRIGHT_VERSION" ]; then
    log "installing playwright-core $PLAYWRIGHT_VERSION into $BOXOFFICE_PLAYWRIGHT_DIR (first time only)"
    mkdir -p "$BOXOFFICE_PLAYWRIGHT_DIR"
    cp "$src/package.json" "$src/package-lock.json" "$BOXOFFICE_PLAYWRIGHT_DIR/"
    npm ci --prefix "$BOXOFFICE_PLAYWRIGHT_DIR" --no-audit --no-fund --ignore-scripts --loglevel=error >/dev/null
    did=1
  fi
  if [ -n "$did" ]; then log "browser tools installed in $((SECONDS - started)) s"; fi
}

nisshi_bin() { command -v nisshi 2>/dev/null || echo "$HOME/.cargo/bin/nisshi"; }

port_open() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }

# Starts a broker on $TEST_BROKER_ADDR with in-memory storage unless one already listens.
# Prints the PID it started (empty when it reused a running broker).
start_test_broker() {
  if port_open "$TEST_BROKER_ADDR"; then
    log "reusing the broker already listening on $TEST_BROKER_ADDR"
    return
  fi
  mkdir -p "$STATE_DIR"
  log "starting nisshi on $TEST_BROKER_ADDR"
  ( cd "$STATE_DIR" && exec "$(nisshi_bin)" broker \
      --listener-url "tcp://$TEST_BROKER_ADDR" --advertised-listener-url "tcp://$TEST_BROKER_ADDR" \
      --storage-engine memory://nisshi/ ) >"$STATE_DIR/nisshi.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do
    if port_open "$TEST_BROKER_ADDR"; then echo "$pid"; return; fi
    kill -0 "$pid" 2>/dev/null || { cat "$STATE_DIR/nisshi.log" >&2; echo "nisshi exited" >&2; exit 1; }
    sleep 0.1
  done
  echo "nisshi did not open $TEST_BROKER_ADDR" >&2; exit 1
}
