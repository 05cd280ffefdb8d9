//! Criterion benches of every distlock backend beside the baselines of its store, all in
//! one run against servers started from the test harness.
//!
//! One group per store (`memory`, `redis`, `postgres`, `etcd`); in it, per backend:
//! uncontended `acquire`, `cycle` (acquire + release), `renew`, `contended/16` (16 tasks on
//! one key), `throughput/{1,16,64}` (cycles over that many tasks, each on its own key) and
//! `acquire_many/{100,1000}` / `renew_many/{100,1000}`; per baseline, its `cycle` and
//! `throughput/{1,16,64}`. Run: `cargo bench -p benchmarks` (add a filter such as `redis/`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use benchmarks::BenchError;
use benchmarks::load::{self, Keys};
use benchmarks::subjects::{self, BenchKey, Servers, Store, Subject, SubjectId, TTL};
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, measurement::WallTime};
use distlock_core::{LockBackend, LockKey};
use tokio::runtime::Runtime;

const LEVELS: [usize; 3] = [1, 16, 64];
const CONTENDED_TASKS: usize = 16;
const BATCH_SIZES: [usize; 2] = [100, 1_000];

/// A benchmark that cannot run is a failure, never a skip.
fn ok<T>(result: Result<T, BenchError>) -> T {
    result.unwrap_or_else(|e| panic!("benchmark failed: {e}"))
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("building the tokio runtime: {e}"));
    let servers = ok(rt.block_on(Servers::start(&[
        Store::Redis,
        Store::Postgres,
        Store::Etcd,
    ])));
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    for store in [Store::Memory, Store::Redis, Store::Postgres, Store::Etcd] {
        let mut group = c.benchmark_group(store.name());
        for id in SubjectId::ALL.into_iter().filter(|s| s.store() == store) {
            let subject = ok(rt.block_on(subjects::open(id, &servers)));
            if let Some(backend) = subject.backend() {
                backend_benches(&mut group, &rt, id, &backend, &subject);
            } else {
                bench_cycle(&mut group, &rt, id, &subject);
            }
            bench_throughput(&mut group, &rt, id, &subject);
            rt.block_on(subject.close());
        }
        group.finish();
    }
    c.final_summary();
    drop(servers);
}

fn backend_benches(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    id: SubjectId,
    backend: &Arc<dyn LockBackend>,
    subject: &Arc<dyn Subject>,
) {
    let key = ok(BenchKey::new(format!("bench:{}:criterion", id.slug())));
    let lock_err = |source| BenchError::Lock {
        subject: id.slug(),
        source,
    };

    group.throughput(Throughput::Elements(1));
    // Only the acquire is timed; the release between iterations frees the key again.
    group.bench_function(format!("{}/acquire", id.slug()), |b| {
        b.to_async(rt).iter_custom(|iters| {
            let backend = backend.clone();
            let key = key.clone();
            async move {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let lease = ok(backend.acquire(key.lock_key(), TTL).await.map_err(lock_err));
                    timed += start.elapsed();
                    let lease = lease.unwrap_or_else(|| panic!("{}: key not free", id.slug()));
                    ok(backend.release(&lease).await.map_err(lock_err));
                }
                timed
            }
        });
    });
    bench_cycle(group, rt, id, subject);

    let lease = ok(rt
        .block_on(backend.acquire(key.lock_key(), TTL))
        .map_err(lock_err))
    .unwrap_or_else(|| panic!("{}: key not free", id.slug()));
    group.bench_function(format!("{}/renew", id.slug()), |b| {
        b.to_async(rt)
            .iter(|| async { ok(backend.renew(&lease).await.map_err(lock_err)) });
    });
    ok(rt.block_on(backend.release(&lease)).map_err(lock_err));

    group.bench_function(
        BenchmarkId::new(format!("{}/contended", id.slug()), CONTENDED_TASKS),
        |b| {
            b.to_async(rt).iter_custom(|iters| async move {
                ok(load::fixed_cycles(subject.clone(), CONTENDED_TASKS, Keys::Shared, iters).await)
            });
        },
    );

    let caps = backend.capabilities();
    for size in BATCH_SIZES {
        if caps.max_held.is_some_and(|max| max < size) {
            // Each held advisory lock pins a session: a batch larger than the pool
            // cannot be held at once, by design.
            continue;
        }
        group.throughput(Throughput::Elements(size as u64));
        let keys: Vec<LockKey> = (0..size)
            .map(|i| LockKey::new(format!("bench:{}:many{size}:{i}", id.slug())))
            .collect::<Result<_, _>>()
            .map_err(lock_err)
            .unwrap_or_else(|e| panic!("{e}"));
        group.bench_function(
            BenchmarkId::new(format!("{}/acquire_many", id.slug()), size),
            |b| {
                b.to_async(rt).iter_custom(|iters| {
                    let backend = backend.clone();
                    let keys = keys.clone();
                    async move {
                        let mut timed = Duration::ZERO;
                        for _ in 0..iters {
                            let start = Instant::now();
                            let leases =
                                ok(backend.acquire_many(&keys, TTL).await.map_err(lock_err));
                            timed += start.elapsed();
                            let leases: Vec<_> = leases.into_iter().flatten().collect();
                            assert_eq!(leases.len(), size, "acquire_many took fewer free keys");
                            ok(backend.release_many(&leases).await.map_err(lock_err));
                        }
                        timed
                    }
                });
            },
        );
        let leases: Vec<_> = ok(rt
            .block_on(backend.acquire_many(&keys, TTL))
            .map_err(lock_err))
        .into_iter()
        .flatten()
        .collect();
        group.bench_function(
            BenchmarkId::new(format!("{}/renew_many", id.slug()), size),
            |b| {
                b.to_async(rt)
                    .iter(|| async { ok(backend.renew_many(&leases).await.map_err(lock_err)) });
            },
        );
        ok(rt.block_on(backend.release_many(&leases)).map_err(lock_err));
    }
    group.throughput(Throughput::Elements(1));
}

fn bench_cycle(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    id: SubjectId,
    subject: &Arc<dyn Subject>,
) {
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("{}/cycle", id.slug()), |b| {
        b.to_async(rt).iter_custom(|iters| async move {
            ok(load::fixed_cycles(subject.clone(), 1, Keys::PerTask, iters).await)
        });
    });
}

fn bench_throughput(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    id: SubjectId,
    subject: &Arc<dyn Subject>,
) {
    group.throughput(Throughput::Elements(1));
    for tasks in LEVELS {
        group.bench_function(
            BenchmarkId::new(format!("{}/throughput", id.slug()), tasks),
            |b| {
                b.to_async(rt).iter_custom(|iters| async move {
                    ok(load::fixed_cycles(subject.clone(), tasks, Keys::PerTask, iters).await)
                });
            },
        );
    }
}
