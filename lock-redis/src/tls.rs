//! TLS for `rediss://` URLs: choosing rustls's crypto provider and checking a private CA.
//!
//! The client library builds its rustls configuration from the process-wide default
//! crypto provider and panics when there is none (or when several are compiled in and
//! none was chosen). This crate depends on rustls with the `ring` provider and installs it
//! as the default before the first TLS connection, unless the application chose one.

use distlock_core::LockError;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Makes sure rustls has a process-wide crypto provider. A provider the application
/// installed first is kept; installing is a no-op once one is set.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one between the check and here: either way a
        // provider is set afterwards, which is all that matters.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Checks that `pem` holds at least one certificate and nothing unparseable, so a bad CA
/// file is a configuration error rather than a handshake failure on every connection.
pub(crate) fn check_root_pem(pem: &[u8]) -> Result<(), LockError> {
    let mut count = 0usize;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| LockError::Config(format!("the TLS root CA PEM does not parse: {e}")))?;
        count += 1;
    }
    if count == 0 {
        return Err(LockError::Config(
            "the TLS root CA PEM holds no CERTIFICATE block".into(),
        ));
    }
    Ok(())
}

/// The rustls error behind a connection failure, if the TLS handshake is what failed
/// (the client library wraps it in an I/O error). Its text names the problem, such as
/// `invalid peer certificate: UnknownIssuer`, and never holds credentials.
pub(crate) fn tls_failure(e: &redis::RedisError) -> Option<String> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        // The client library keeps its causes behind an `Arc`, and `io::Error::source`
        // skips the error it wraps: both are looked into explicitly.
        let err = err.downcast_ref::<Shared>().map_or(err, |shared| {
            &**shared as &(dyn std::error::Error + 'static)
        });
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(tls) = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls.to_string());
        }
        next = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_is_installed_once_and_kept() {
        ensure_crypto_provider();
        let first = rustls::crypto::CryptoProvider::get_default().expect("installed");
        ensure_crypto_provider();
        let second = rustls::crypto::CryptoProvider::get_default().expect("still installed");
        assert!(std::sync::Arc::ptr_eq(first, second));
    }
}
