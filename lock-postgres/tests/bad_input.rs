//! Bad input and bad surroundings get a typed error, change nothing, and never show the
//! password: malformed URL, wrong password, server down, pool exhausted, schema not set
//! up, invalid TTLs.

mod common;

use std::time::Duration;

use common::{Kind, backend, builder, shared_server};
use distlock_core::{LockBackend, LockError, LockKey, Release};
use harness::{free_port, postgres};
use lock_postgres::PgBuilder;

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

const TTL: Duration = Duration::from_secs(5);

#[test]
fn a_malformed_url_is_a_config_error_without_the_password() {
    for url in [
        "postgres//distlock:hunter2@127.0.0.1/postgres",
        "postgres://distlock:hunter2@127.0.0.1:notaport/postgres",
        "redis://distlock:hunter2@127.0.0.1/postgres",
        "",
    ] {
        for result in [
            PgBuilder::new(url).build_lease_backend().map(drop),
            PgBuilder::new(url).build_advisory_backend().map(drop),
        ] {
            let err = result.unwrap_err();
            assert!(matches!(err, LockError::Config(_)), "{url:?}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_config_error_without_the_password() {
    let server = shared_server().await;
    let url = server.url().replace(postgres::PASSWORD, "hunter2-wrong");
    for kind in [Kind::Lease, Kind::Advisory] {
        let b = PgBuilder::new(&url);
        let backend: Box<dyn LockBackend> = match kind {
            Kind::Lease => Box::new(b.build_lease_backend().unwrap()),
            Kind::Advisory => Box::new(b.build_advisory_backend().unwrap()),
        };
        assert!(!format!("{backend:?}").contains("hunter2"));
        let err = backend.acquire(&key("wrong-pw"), TTL).await.unwrap_err();
        assert!(
            matches!(&err, LockError::Config(m) if m.contains("password authentication failed")),
            "{err}"
        );
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!err.is_retryable());
    }
}

/// A startup setting the server does not know (from the URL's `options[NAME]`) refuses
/// the login: a `Config` error naming the setting and where it came from, from the first
/// call and from `setup`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_startup_setting_the_server_refuses_is_a_config_error_naming_it() {
    let server = shared_server().await;
    let url = format!("{}?options[distlock_no_such_setting]=1", server.url());
    let backend = PgBuilder::new(&url).build_lease_backend().unwrap();
    let from_acquire = backend.acquire(&key("setting"), TTL).await.unwrap_err();
    let from_setup = backend.setup().await.unwrap_err();
    for err in [from_acquire, from_setup] {
        assert!(
            matches!(&err, LockError::Config(m)
                if m.contains("distlock_no_such_setting") && m.contains("options[NAME]")),
            "{err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_unavailable_and_retryable() {
    let port = free_port().unwrap();
    let url = format!("postgres://distlock:hunter2@127.0.0.1:{port}/postgres");
    let b = PgBuilder::new(url).connect_timeout(Duration::from_millis(500));
    let lease = b.build_lease_backend().unwrap();
    let advisory = b.build_advisory_backend().unwrap();
    for backend in [&lease as &dyn LockBackend, &advisory] {
        let err = backend.acquire(&key("down"), TTL).await.unwrap_err();
        assert!(matches!(err, LockError::Unavailable { .. }), "{err}");
        assert!(err.is_retryable());
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
    assert!(matches!(
        lease.connect().await,
        Err(LockError::Unavailable { .. })
    ));
}

/// A server that refuses connections is reported by `connect()` with the operating
/// system's reason, at once: the pool alone would take the refusal for a server starting
/// up, try again until its connect timeout, and report only that it timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_reports_a_refused_connection_at_once_with_its_reason() {
    let port = free_port().unwrap();
    let url = format!("postgres://distlock:hunter2@127.0.0.1:{port}/postgres");
    let b = PgBuilder::new(url).connect_timeout(Duration::from_secs(30));
    let started = std::time::Instant::now();
    let results = [
        b.build_lease_backend().unwrap().connect().await.map(drop),
        b.build_advisory_backend()
            .unwrap()
            .connect()
            .await
            .map(drop),
    ];
    // Far below the 30 s connect timeout the pool would wait out.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    for result in results {
        let err = result.unwrap_err();
        assert!(err.to_string().contains("Connection refused"), "{err}");
        let io = std::iter::successors(std::error::Error::source(&err), |e| e.source())
            .find_map(|e| e.downcast_ref::<std::io::Error>())
            .unwrap_or_else(|| panic!("an I/O error among the sources: {err:?}"));
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_advisory_pool_fails_at_once_and_recovers_on_release() {
    let server = shared_server().await;
    let backend = builder(&server)
        .pool_size(2)
        .build_advisory_backend()
        .unwrap();
    assert_eq!(backend.capabilities().max_held, Some(2));
    let a = backend.acquire(&key("full-a"), TTL).await.unwrap().unwrap();
    let b = backend.acquire(&key("full-b"), TTL).await.unwrap().unwrap();
    let started = tokio::time::Instant::now();
    let err = backend.acquire(&key("full-c"), TTL).await.unwrap_err();
    assert!(
        matches!(&err, LockError::Unavailable { message, .. } if message.contains("pool_size")),
        "{err}"
    );
    // It did not wait for the connect timeout (5 s) to say so.
    assert!(started.elapsed() < Duration::from_secs(4));
    // Nothing changed: the full backend still holds both locks.
    assert!(matches!(
        backend.renew(&a).await.unwrap(),
        distlock_core::Renewal::Renewed { .. }
    ));
    assert_eq!(backend.release(&b).await.unwrap(), Release::Released);
    let c = backend.acquire(&key("full-c"), TTL).await.unwrap();
    assert!(c.is_some(), "a released slot is usable again");
    // A dropped lease (no release) closes its session and frees its slot and its lock.
    drop(c);
    let other = common::backend(&server, Kind::Advisory).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(l) = other.acquire(&key("full-c"), TTL).await.unwrap() {
            other.release(&l).await.unwrap();
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dropped lease's lock leaked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    backend.release(&a).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_schema_that_was_not_set_up_name_setup() {
    let server = shared_server().await;
    let b = builder(&server).schema("never_set_up");
    let lease = b.build_lease_backend().unwrap();
    let advisory = b.build_advisory_backend().unwrap();
    for backend in [&lease as &dyn LockBackend, &advisory] {
        let err = backend.acquire(&key("no-schema"), TTL).await.unwrap_err();
        assert!(
            matches!(&err, LockError::Config(m) if m.contains("setup()")),
            "{}: {err}",
            backend.name()
        );
    }
    assert!(matches!(lease.connect().await, Err(LockError::Config(m)) if m.contains("setup()")));
    // After setup, the same backends work; setup is idempotent.
    lease.setup().await.unwrap();
    advisory.setup().await.unwrap();
    let l = advisory
        .acquire(&key("no-schema"), TTL)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(advisory.release(&l).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_ttls_are_refused_and_change_nothing() {
    let server = shared_server().await;
    for kind in [Kind::Lease, Kind::Advisory] {
        let backend = backend(&server, kind).await;
        let k = key(&format!("bad-ttl-{kind:?}"));
        for ttl in [
            Duration::ZERO,
            Duration::from_millis(5),
            Duration::from_micros(10_500),
            Duration::from_secs(25 * 3600),
        ] {
            let err = backend.acquire(&k, ttl).await.unwrap_err();
            assert!(
                matches!(err, LockError::InvalidTtl { .. }),
                "{ttl:?}: {err}"
            );
        }
        let lease = backend.acquire(&k, TTL).await.unwrap();
        assert!(lease.is_some(), "refused calls took nothing");
        let info = backend.inspect(&k).await.unwrap();
        assert_eq!(info.token, lease.as_ref().map(|l| l.token()));
        backend.release(&lease.unwrap()).await.unwrap();
    }
}
