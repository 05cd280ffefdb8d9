#!/usr/bin/env bash
# Installs what `scripts/test.sh` needs and finds missing: the test runner cargo-nextest,
# the servers the tests start (redis-server, redis-sentinel, etcd, PostgreSQL, PgBouncer)
# and the protobuf compiler with its well-known includes, which etcd-client's build script needs. Installs
# only what is absent, the packages with apt-get, as
# root. Without root or apt-get it fails naming the one command to run.
set -euo pipefail

# cargo-nextest runs the tests (scripts/test.sh). Machines with a Rust toolchain here come
# with it; anywhere else it is built once, from crates.io.
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "== installing cargo-nextest"
    cargo install cargo-nextest --locked
fi

# Debian package that provides each thing the tests need.
declare -A provides=(
    [redis-server]=redis-server
    [redis-sentinel]=redis-sentinel
    [redis-cli]=redis-tools
    [etcd]=etcd-server
    [etcdctl]=etcd-client
    [protoc]=protobuf-compiler
    [pgbouncer]=pgbouncer
)
packages=()
for bin in "${!provides[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || packages+=("${provides[$bin]}")
done
# etcd-client's protos import google/protobuf/descriptor.proto.
if [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then packages+=(libprotobuf-dev); fi
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ]; then packages+=(postgresql); fi

if [ ${#packages[@]} -eq 0 ]; then exit 0; fi
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "test: missing: ${packages[*]}" >&2
    echo "test: run as root: apt-get install -y ${packages[*]}" >&2
    exit 1
fi

echo "== installing ${packages[*]}"
log=$(mktemp /tmp/distlock-apt.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
# Packaged services must not start: the tests start their own servers on free ports.
policy=/usr/sbin/policy-rc.d
created_policy=false
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=true
fi
cleanup() { if $created_policy; then rm -f "$policy"; fi; }
trap cleanup EXIT
if ! apt-get install -y --no-install-recommends "${packages[@]}" >"$log" 2>&1; then
    apt-get update >>"$log" 2>&1 || true
    if ! apt-get install -y --no-install-recommends "${packages[@]}" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "test: could not install ${packages[*]}" >&2
        exit 1
    fi
fi
rm -f "$log"
# Stop any packaged service that started anyway.
for service in redis-server redis-sentinel etcd postgresql pgbouncer; do
    if command -v systemctl >/dev/null 2>&1; then systemctl stop "$service" >/dev/null 2>&1 || true; fi
    if command -v service >/dev/null 2>&1; then service "$service" stop >/dev/null 2>&1 || true; fi
done
