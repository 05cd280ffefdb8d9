#!/usr/bin/env bash
# Runs every check and test of the workspace: formatting, lints, and the whole test
# suite, which starts real redis-server, etcd and PostgreSQL processes on free loopback
# ports. Installs what is missing first (as root, with apt-get; see
# install-test-deps.sh). Fails, never skips, when a server binary is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-test-deps.sh

missing=()
for bin in redis-server redis-sentinel redis-cli etcd etcdctl protoc pgbouncer; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
cargo nextest --version >/dev/null 2>&1 || missing+=("cargo-nextest")
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ]; then missing+=("initdb (PostgreSQL server)"); fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "test: still missing after installing: ${missing[*]}" >&2
    exit 1
fi

# examples/own-backend is a crate of its own workspace (a backend built on the published
# crates only, as in another repository), so `--all` and `--workspace` do not reach it. It
# builds in this workspace's target directory and reuses the dependencies built here with
# the same features: about two thirds of its units, though not tokio or the distlock crates,
# which the workspace builds with more features. It adds about a minute.
own_backend=(--manifest-path examples/own-backend/Cargo.toml)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

echo "== cargo fmt --check"
cargo fmt --all -- --check
cargo fmt "${own_backend[@]}" -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The workspace build turns on the features its members ask for; these are the other
# combinations a user builds (lockctl with etcd, the facade with one store or none).
cargo clippy -p lockctl --all-targets --features etcd --locked -- -D warnings
cargo clippy -p distlock --all-targets --no-default-features --locked -- -D warnings
cargo clippy -p distlock --all-targets --no-default-features --features tower --locked -- -D warnings
cargo clippy -p distlock --all-targets --no-default-features --features apalis --locked -- -D warnings
cargo clippy "${own_backend[@]}" --all-targets --locked -- -D warnings
# Packaging builds each published crate from its .crate file, the crates it depends on
# again with its own features, in a target directory of its own. It runs after the tests:
# beside them it saved under a minute and pushed the loaded machine's scheduling noise
# past what timing cases tolerate.
package_target="$CARGO_TARGET_DIR/package-check"
package_crates() {
    # What a user depends on or installs: distlock-core, distlock-conformance,
    # distlock-capacity, the three store backends, the facade distlock and lockctl.
    # `--workspace` packages them together, in dependency order, serves the ones not on
    # crates.io from a temporary local registry, and builds each from its .crate.
    # harness, suite-faults, benchmarks and job-queue are `publish = false`; the published
    # crates name the first two only as dev-dependencies without a version, which packaging
    # drops.
    # `--allow-dirty`: a local run checks the work tree as it is; CI's clone is clean.
    # Cargo builds a crate of that registry once per version and takes the build as fresh
    # ever after (a registry's sources never change): a second run in the same target
    # directory would verify against the first run's build of, say, distlock-core 0.1.0,
    # without what changed since. Those builds are the units of the workspace's own crates
    # whose dep-info lists no source file (a path build lists its files); they go first.
    # Cargo also extracts a registry crate's sources once per registry and version and never
    # again, under a directory named after the registry's path: a checkout at the path of an
    # earlier one (a CI clone made again) would verify against that run's sources. A local
    # registry's directory has no host in its name (`-<hash>`); ours go, crates.io's stay.
    for src in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/{distlock,distlock-core,distlock-conformance,distlock-capacity,lock-redis,lock-etcd,lock-postgres,lockctl}-[0-9]*; do
        rm -rf "$src"
    done
    for unit in "$package_target"/debug/.fingerprint/{distlock-core,distlock-conformance,distlock-capacity,lock-redis,lock-etcd,lock-postgres,distlock,lockctl}-*; do
        for dep_info in "$unit"/dep-lib-*; do
            if [ -f "$dep_info" ] && [ "$(stat -c %s "$dep_info")" -lt 64 ]; then
                rm -rf "$unit" "$package_target"/debug/deps/*-"${unit##*-}".*
            fi
        done
    done
    # Each crate builds as a root of its own, where the workspace's profiles do not reach:
    # with no debug information, as nothing of these builds ever runs.
    CARGO_PROFILE_DEV_DEBUG=false CARGO_TARGET_DIR="$package_target" cargo package --workspace --exclude harness \
        --exclude suite-faults --exclude benchmarks --exclude job-queue --locked --allow-dirty
}
echo "== cargo nextest: the workspace's tests, several at once (see .config/nextest.toml)"
# The conformance tests append, per backend, the cases they stamped and ran, and per
# broken variant the cases that caught it; printed at the end.
# lockctl's tests run once, with its etcd feature on (its tests of the other stores are the
# same in either build); the one test of the build without it runs under the feature
# combinations below.
export DISTLOCK_SUMMARY_DIR="$PWD/target/conformance-summary"
rm -rf "$DISTLOCK_SUMMARY_DIR"
cargo nextest run --workspace --features lockctl/etcd --locked --no-tests=fail
echo "== cargo test --doc: the examples in the docs"
cargo test --workspace --features lockctl/etcd --doc --locked
echo "== examples/own-backend: the suite on a backend outside the workspace"
cargo nextest run "${own_backend[@]}" --locked --no-tests=fail
cargo test "${own_backend[@]}" --doc --locked
echo "== feature combinations"
cargo nextest run -p lockctl --test cli --locked --no-tests=fail -E 'test(a_store_whose_feature_is_off_names_the_feature)'
cargo test -p distlock --no-default-features --locked
cargo test -p distlock --no-default-features --features etcd --locked
cargo test -p distlock --no-default-features --features postgres --locked
cargo test -p distlock --no-default-features --features tower --locked
echo "== the benches build (CI never asserts a speed)"
# In the test build's profile, on its dependencies: an optimized build of the whole
# workspace would take longer than every test together.
cargo build --workspace --features lockctl/etcd --benches --locked --quiet
echo "== cargo doc"
# Every crate with every feature: broken intra-doc links and missing docs fail the run.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --locked --quiet
echo "== cargo package: the published crates, in dependency order"
package_crates
echo "== conformance summary"
cat "$DISTLOCK_SUMMARY_DIR/backends.txt" "$DISTLOCK_SUMMARY_DIR/broken-variants.txt"
