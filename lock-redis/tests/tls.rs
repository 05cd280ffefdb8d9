//! `rediss://` end to end against a TLS `redis-server` whose certificate a test CA signed
//! (made here with rcgen): the CA given with `tls_ca_pem` is trusted, a missing or
//! different CA is refused with a typed error (never a panic), and `#insecure` skips the
//! check only when asked.

mod common;

use std::time::Duration;

use common::acquire_all;
use distlock_core::{Fence, LockBackend, LockError, LockKey, Release, Renewal};
use harness::redis::{RedisServer, RedisTls, RespValue, resp_command};
use lock_redis::RedisBackend;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

const TTL: Duration = Duration::from_secs(10);

/// A fresh CA and a server certificate it signed for `127.0.0.1` and `localhost`.
fn test_pki() -> RedisTls {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "distlock test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let ca = Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate().expect("server key");
    let mut server_params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .expect("server params");
    server_params
        .distinguished_name
        .push(DnType::CommonName, "redis test server");
    let server_cert = server_params
        .signed_by(&server_key, &ca)
        .expect("server certificate");
    RedisTls {
        cert_pem: server_cert.pem(),
        key_pem: server_key.serialize_pem(),
        ca_pem: ca_cert.pem(),
    }
}

async fn tls_server() -> (RedisServer, RedisTls) {
    let pki = test_pki();
    let server = harness::require(RedisServer::builder().tls(pki.clone()).start().await);
    (server, pki)
}

async fn build(url: &str, ca_pem: Option<&str>) -> Result<RedisBackend, LockError> {
    let mut builder = RedisBackend::builder()
        .url(url)
        .connect_timeout(Duration::from_secs(2))
        .request_timeout(Duration::from_secs(2));
    if let Some(pem) = ca_pem {
        builder = builder.tls_ca_pem(pem);
    }
    builder.build().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_the_test_ca_acquires_renews_fences_and_releases() {
    let (server, pki) = tls_server().await;
    let url = server.tls_url().expect("started with TLS");
    assert!(url.starts_with("rediss://127.0.0.1:"), "{url}");
    let tls_port = server.tls_port().unwrap();
    assert_ne!(tls_port, server.port());

    // The TLS port does not speak plain RESP: a client that reaches it did the handshake.
    let plain = resp_command(
        server.tls_port().map(harness::loopback).unwrap(),
        None,
        &["PING"],
        Duration::from_millis(500),
    )
    .await;
    assert!(
        !matches!(&plain, Ok(RespValue::Simple(s)) if s == "PONG"),
        "{plain:?}"
    );

    let redis = build(&url, Some(&pki.ca_pem))
        .await
        .expect("the test CA is trusted");
    let key = LockKey::new("tls").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    assert!(redis.acquire(&key, TTL).await.unwrap().is_none(), "held");
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(redis.release(&lease).await.unwrap(), Release::NotHeld);

    // The writes went to this server (through its TLS port).
    let lock_key = redis.redis_key(&key);
    assert_eq!(
        harness::require(server.command(&["EXISTS", lock_key.as_str()]).await),
        RespValue::Integer(0)
    );

    let keys: Vec<LockKey> = (0..50)
        .map(|i| LockKey::new(format!("tls-{i}")).unwrap())
        .collect();
    let leases = acquire_all(&redis, &keys, TTL).await;
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    let released = redis.release_many(&leases).await.unwrap();
    assert!(released.iter().all(|r| *r == Release::Released));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_refused_with_an_error_not_a_panic() {
    let (server, _) = tls_server().await;
    let url = server.tls_url().unwrap();
    // The bundled public roots do not include the test CA.
    let err = build(&url, None).await.expect_err("untrusted CA");
    assert!(
        matches!(&err, LockError::Config(m) if m.contains("certificate")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // Nor does another CA.
    let other = test_pki();
    let err = build(&url, Some(&other.ca_pem))
        .await
        .expect_err("a different CA");
    assert!(
        matches!(&err, LockError::Config(m) if m.contains("certificate")),
        "{err:?}"
    );
    // Plain RESP to the TLS port gets nowhere either.
    let plain = format!("redis://127.0.0.1:{}/", server.tls_port().unwrap());
    assert!(build(&plain, None).await.is_err());
    // And TLS to the plain port never completes a handshake.
    let tls_to_plain = format!("rediss://127.0.0.1:{}/", server.port());
    let err = build(&tls_to_plain, None).await.expect_err("no TLS there");
    assert!(
        matches!(err, LockError::Unavailable { .. } | LockError::Config(_)),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_fragment_skips_certificate_checks_only_when_asked() {
    let (server, _) = tls_server().await;
    let url = format!("{}#insecure", server.tls_url().unwrap());
    let redis = build(&url, None)
        .await
        .expect("#insecure accepts any certificate");
    let key = LockKey::new("insecure").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test]
async fn a_root_ca_with_a_plain_url_or_without_a_certificate_is_a_config_error() {
    let pki = test_pki();
    let err = build("redis://127.0.0.1:1/", Some(&pki.ca_pem))
        .await
        .expect_err("TLS root for a plain URL");
    assert!(matches!(err, LockError::Config(_)), "{err:?}");
    let err = build("rediss://127.0.0.1:1/", Some(&pki.key_pem))
        .await
        .expect_err("a key is not a certificate");
    assert!(matches!(err, LockError::Config(_)), "{err:?}");
}
