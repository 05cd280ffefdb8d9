//! `https://` endpoints end to end against a TLS etcd whose certificate a test CA signed
//! (made here with rcgen): with that CA the backend locks, renews, fences and releases; a
//! CA that is not a certificate is a configuration error before connecting; a different CA
//! fails the handshake with a retryable error, never a lease.

use std::time::Duration;

use distlock_core::{Fence, LockBackend, LockError, LockKey, Release, Renewal};
use harness::etcd::{EtcdServer, EtcdTls};
use harness::require;
use lock_etcd::EtcdBackend;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

const TTL: Duration = Duration::from_secs(2);

/// A fresh CA, and a server certificate it signed for `127.0.0.1` and `localhost`.
fn test_pki() -> EtcdTls {
    let (ca_pem, ca) = test_ca("distlock etcd test CA");
    let server_key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
        .expect("server params");
    params
        .distinguished_name
        .push(DnType::CommonName, "etcd test server");
    let cert = params
        .signed_by(&server_key, &ca)
        .expect("server certificate");
    EtcdTls {
        cert_pem: cert.pem(),
        key_pem: server_key.serialize_pem(),
        ca_pem,
    }
}

fn test_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).expect("CA certificate");
    (cert.pem(), Issuer::new(params, key))
}

async fn build(server: &EtcdServer, ca_pem: &str) -> Result<EtcdBackend, LockError> {
    EtcdBackend::builder()
        .endpoint(server.endpoint())
        .tls_ca_pem(ca_pem)
        .key_prefix("distlock-tls-test")
        .connect_timeout(Duration::from_secs(2))
        .request_timeout(Duration::from_secs(3))
        .build()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_the_test_ca_acquires_renews_fences_and_releases() {
    let pki = test_pki();
    let server = require(EtcdServer::start_tls(pki.clone()).await);
    assert!(server.is_tls());
    assert!(server.endpoint().starts_with("https://127.0.0.1:"));

    // Plain HTTP to the TLS port reaches nothing: a client that works did the handshake.
    let plain = EtcdBackend::builder()
        .endpoint(server.endpoint().replace("https://", "http://"))
        .request_timeout(Duration::from_secs(2))
        .build()
        .await;
    assert!(plain.is_err(), "plain HTTP worked on the TLS port");

    let backend = build(&server, &pki.ca_pem).await.unwrap();
    let k = LockKey::new("tls:payout:1").unwrap();
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    assert!(matches!(
        backend.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(backend.fence(&lease).await.unwrap(), Fence::Current);
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
    let next = backend.acquire(&k, TTL).await.unwrap().expect("free again");
    assert!(next.token() > lease.token());
    backend.purge(&k).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_never_yields_a_backend() {
    let server = require(EtcdServer::start_tls(test_pki()).await);
    match build(&server, "-----BEGIN PRIVATE KEY-----\nAAAA\n").await {
        Err(LockError::Config(message)) => {
            assert!(message.contains("PEM certificate"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    let (other_ca, _) = test_ca("some other CA");
    match build(&server, &other_ca).await {
        Err(e) => assert!(matches!(e, LockError::Unavailable { .. }), "{e:?}"),
        Ok(_) => panic!("a server signed by another CA was trusted"),
    }
}
