//! Opening a fenced resource from a URL: [`fenced_resource`] is to the stores'
//! [`FencedResource`] implementations what [`connect`](crate::connect) is to their lock
//! backends.

use std::sync::Arc;

use distlock_core::{EnforcementMode, FencedResource, LockError, MemoryFencedResource};

use crate::connect::{Scheme, checked, feature_off, memory};

/// Opens the [`FencedResource`] kept in the store a URL names, in `mode`: the store's
/// own implementation on the same servers, key prefix or schema as the lock backend
/// [`connect`](crate::connect) opens for that URL. Its writes are the fenced writes a
/// job makes with its lease's token: stored only when the token is not below the highest
/// the resource has admitted, in one atomic step.
///
/// | URL | resource |
/// |---|---|
/// | `memory://` | a new in-process [`MemoryFencedResource`] (nothing is shared between calls) |
/// | `redis://…`, `rediss://…`, `redis+cluster://…`, `redis+sentinel://…` | `distlock::redis::RedisFencedResource` |
/// | `etcd://…`, `etcds://…` | `distlock::etcd::EtcdFencedResource` |
/// | `postgres://…` | `distlock::postgres::PgFencedResource` in the URL's `schema` (whatever its `mode`); its table comes from [`setup`](crate::setup) |
///
/// # Errors
///
/// Those of [`connect`](crate::connect) for the same URL.
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves nothing behind but the connections it opened,
/// which close with it.
pub async fn fenced_resource(
    url: &str,
    mode: EnforcementMode,
) -> Result<Arc<dyn FencedResource>, LockError> {
    match checked(url)? {
        Scheme::Memory => {
            memory(url)?;
            Ok(Arc::new(MemoryFencedResource::new(mode)))
        }
        #[cfg(feature = "redis")]
        Scheme::Redis | Scheme::RedisTls | Scheme::RedisCluster | Scheme::RedisSentinel => {
            let backend = lock_redis::RedisBackendBuilder::from_url(url)?
                .build()
                .await?;
            Ok(Arc::new(lock_redis::RedisFencedResource::new(
                backend, mode,
            )))
        }
        #[cfg(feature = "etcd")]
        Scheme::Etcd | Scheme::EtcdTls => {
            let backend = lock_etcd::EtcdBuilder::from_url(url)?.build().await?;
            Ok(Arc::new(lock_etcd::EtcdFencedResource::new(&backend, mode)))
        }
        #[cfg(feature = "postgres")]
        Scheme::Postgres => {
            let backend = lock_postgres::PgBuilder::from_url(url)?.build_lease_backend()?;
            backend.connect().await?;
            Ok(Arc::new(lock_postgres::PgFencedResource::new(
                backend.pool().clone(),
                backend.schema(),
                mode,
            )?))
        }
        // Reached only for a store whose feature is off, which `checked` refused already.
        #[allow(unreachable_patterns)]
        scheme => Err(feature_off(scheme)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::FencingToken;

    #[tokio::test]
    async fn a_memory_url_opens_an_in_process_resource_that_fences() {
        let resource = fenced_resource("memory://", EnforcementMode::Enforce)
            .await
            .unwrap();
        let admitted = resource.write("r", FencingToken(2), b"new").await.unwrap();
        let stale = resource.write("r", FencingToken(1), b"old").await.unwrap();
        assert!(admitted.is_admitted());
        assert!(!stale.is_admitted());
        assert_eq!(
            resource.read("r").await.unwrap().as_deref(),
            Some(&b"new"[..])
        );
    }

    #[tokio::test]
    async fn a_bad_url_is_refused_as_connect_refuses_it() {
        for url in ["memory://host", "carrier-pigeon://coop", "not a url"] {
            let err = fenced_resource(url, EnforcementMode::Enforce)
                .await
                .err()
                .unwrap_or_else(|| panic!("{url} opened"));
            assert!(matches!(err, LockError::Config(_)), "{url}: {err}");
        }
    }
}
