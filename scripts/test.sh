#!/usr/bin/env bash
# Runs every check and test of the workspace: formatting, lints, and the whole test
# suite, which starts real redis-server, etcd and PostgreSQL processes on free loopback
# ports. Installs what is missing first (as root, with apt-get; see
# install-test-deps.sh). Fails, never skips, when a server binary is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-test-deps.sh

missing=()
for bin in redis-server redis-cli etcd etcdctl protoc pgbouncer; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ]; then missing+=("initdb (PostgreSQL server)"); fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "test: still missing after installing: ${missing[*]}" >&2
    exit 1
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The workspace build turns on the features its members ask for; these are the other
# combinations a user builds (lockctl with etcd, the facade with one store or none).
cargo clippy -p lockctl --all-targets --features etcd --locked -- -D warnings
cargo clippy -p distlock --all-targets --no-default-features --locked -- -D warnings
cargo clippy -p distlock --all-targets --no-default-features --features tower --locked -- -D warnings
echo "== cargo test"
# The conformance tests append, per backend, the cases they stamped and ran, and per
# broken variant the cases that caught it; printed at the end.
export DISTLOCK_SUMMARY_DIR="$PWD/target/conformance-summary"
rm -rf "$DISTLOCK_SUMMARY_DIR"
cargo test --workspace --locked --no-fail-fast
echo "== cargo test: feature combinations"
cargo test -p lockctl --features etcd --locked
cargo test -p distlock --no-default-features --locked
cargo test -p distlock --no-default-features --features etcd --locked
cargo test -p distlock --no-default-features --features postgres --locked
cargo test -p distlock --no-default-features --features tower --locked
echo "== cargo bench --no-run (the benches compile; CI never asserts a speed)"
cargo bench --workspace --no-run --locked --quiet
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p distlock --no-deps --features tower --locked --quiet
echo "== cargo package: the published crates, in dependency order"
# What a user depends on or installs: distlock-core, conformance, capacity, the three store
# backends, the facade distlock and lockctl. `--workspace` packages them together, in
# dependency order, and serves the ones not on crates.io from a temporary local registry.
# harness, benchmarks and job-queue are `publish = false`; the published crates name
# harness only as a dev-dependency without a version, which packaging drops.
# `--allow-dirty`: a local run checks the work tree as it is; CI's clone is clean.
package=(cargo package --workspace --exclude harness --exclude benchmarks --exclude job-queue
    --locked --allow-dirty)
"${package[@]}" --no-verify
# Then each is built from its .crate, except lockctl: its `capacity = "0.1.0"` would
# resolve to crates.io, where `capacity` 0.1.1 and 0.1.2 are another project's crate.
# `cargo install --path lockctl` in .ci/run is lockctl's build check meanwhile.
"${package[@]}" --exclude lockctl
echo "== conformance summary"
cat "$DISTLOCK_SUMMARY_DIR/backends.txt" "$DISTLOCK_SUMMARY_DIR/broken-variants.txt"
