//! `etcd://` URLs: one or more cluster members, optional credentials and key prefix.
//!
//! `etcd://[user:password@]host:port[,host:port…][?prefix=NAME]`. The members are a
//! comma-separated list, which a generic URL parser cannot read as one authority, so the
//! authority is split here and each member checked on its own. A member without a port
//! gets etcd's client port, 2379. Messages never repeat the credentials.

use std::sync::Arc;

use lock_api::{LockBackend, LockError};
use url::Url;

/// etcd's default client port.
const DEFAULT_PORT: u16 = 2379;

/// A parsed `etcd://` URL.
#[derive(PartialEq, Eq)]
pub(crate) struct EtcdUrl {
    endpoints: Vec<String>,
    credentials: Option<(String, String)>,
    prefix: Option<String>,
}

impl std::fmt::Debug for EtcdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUrl")
            .field("endpoints", &self.endpoints)
            .field("user", &self.credentials.as_ref().map(|(user, _)| user))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl EtcdUrl {
    /// Parses `url`, whose scheme `connect` has already checked.
    pub(crate) fn parse(url: &str) -> Result<Self, LockError> {
        let rest = url.trim().split_once("://").map_or("", |(_, rest)| rest);
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, members) = match authority.rsplit_once('@') {
            Some((userinfo, members)) => (Some(userinfo), members),
            None => (None, authority),
        };
        let credentials = userinfo.map(credentials).transpose()?;
        let endpoints = members
            .split(',')
            .enumerate()
            .map(|(i, member)| endpoint(i, member))
            .collect::<Result<Vec<_>, _>>()?;

        // The rest (path, query) read as a URL of its own, without the members.
        let tail = Url::parse(&format!("etcd://members{tail}"))
            .map_err(|e| LockError::Config(format!("malformed etcd URL: {e}")))?;
        if !matches!(tail.path(), "" | "/") || tail.fragment().is_some() {
            return Err(LockError::Config(
                "an etcd URL takes no path: set the key prefix with ?prefix=NAME".into(),
            ));
        }
        let mut prefix = None;
        for (name, value) in tail.query_pairs() {
            match &*name {
                "prefix" if prefix.is_none() => prefix = Some(value.into_owned()),
                "prefix" => {
                    return Err(LockError::Config(
                        "the etcd URL sets `prefix` more than once".into(),
                    ));
                }
                other => {
                    return Err(LockError::Config(format!(
                        "unknown parameter `{other}` in the etcd URL: distlock reads prefix"
                    )));
                }
            }
        }
        Ok(Self {
            endpoints,
            credentials,
            prefix,
        })
    }

    /// Connects to the cluster.
    pub(crate) async fn open(self) -> Result<Arc<dyn LockBackend>, LockError> {
        let mut builder = lock_etcd::EtcdBackend::builder().endpoints(self.endpoints);
        if let Some((user, password)) = self.credentials {
            builder = builder.credentials(user, password);
        }
        if let Some(prefix) = self.prefix {
            builder = builder.key_prefix(prefix);
        }
        Ok(Arc::new(builder.build().await?))
    }
}

/// `user:password`, percent-decoded.
fn credentials(userinfo: &str) -> Result<(String, String), LockError> {
    let (user, password) = userinfo.split_once(':').ok_or_else(|| {
        LockError::Config("etcd credentials need a password: write etcd://user:password@…".into())
    })?;
    let user = percent_decode(user)
        .ok_or_else(|| LockError::Config("the etcd user name is not valid UTF-8".into()))?;
    let password = percent_decode(password)
        .ok_or_else(|| LockError::Config("the etcd password is not valid UTF-8".into()))?;
    if user.is_empty() {
        return Err(LockError::Config(
            "etcd credentials need a user name".into(),
        ));
    }
    Ok((user, password))
}

/// Member `i` (`host[:port]`) as `http://host:port`.
fn endpoint(i: usize, member: &str) -> Result<String, LockError> {
    let n = i + 1;
    if member.is_empty() {
        return Err(LockError::Config(format!(
            "etcd member {n} is empty: write etcd://host:port[,host:port…]"
        )));
    }
    let url = Url::parse(&format!("http://{member}"))
        .map_err(|e| LockError::Config(format!("etcd member {n} is malformed: {e}")))?;
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| LockError::Config(format!("etcd member {n} has no host")))?;
    if !matches!(url.path(), "" | "/") || url.query().is_some() || !url.username().is_empty() {
        return Err(LockError::Config(format!(
            "etcd member {n} must be host:port"
        )));
    }
    Ok(format!(
        "http://{host}:{}",
        url.port().unwrap_or(DEFAULT_PORT)
    ))
}

/// Decodes `%XX` escapes; `None` when the result is not UTF-8 or an escape is broken.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(url: &str) -> String {
        match EtcdUrl::parse(url) {
            Ok(parsed) => panic!("{url} parsed as {parsed:?}"),
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("{url}: expected a configuration error, got {other}"),
        }
    }

    #[test]
    fn members_credentials_and_prefix_are_read() {
        let parsed =
            EtcdUrl::parse("etcd://root:p%40ss@10.0.0.1:2379,10.0.0.2,[::1]:32379/?prefix=jobs")
                .unwrap();
        assert_eq!(
            parsed,
            EtcdUrl {
                endpoints: vec![
                    "http://10.0.0.1:2379".into(),
                    "http://10.0.0.2:2379".into(),
                    "http://[::1]:32379".into(),
                ],
                credentials: Some(("root".into(), "p@ss".into())),
                prefix: Some("jobs".into()),
            }
        );
        let single = EtcdUrl::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(single.endpoints, ["http://127.0.0.1:2379"]);
        assert_eq!((single.credentials, single.prefix), (None, None));
    }

    #[test]
    fn bad_members_and_params_are_config_errors_that_hide_the_password() {
        for (url, says) in [
            ("etcd://h1:2379,,h3:2379", "member 2 is empty"),
            ("etcd://h1:2379,h2:99999", "member 2 is malformed"),
            ("etcd://u:hunter2@h1:2379/locks", "no path"),
            (
                "etcd://u:hunter2@h1:2379?perfix=x",
                "unknown parameter `perfix`",
            ),
            (
                "etcd://u:hunter2@h1:2379?prefix=a&prefix=b",
                "more than once",
            ),
            ("etcd://hunter2@h1:2379", "need a password"),
            ("etcd://:hunter2@h1:2379", "need a user name"),
        ] {
            let message = config_error(url);
            assert!(message.contains(says), "{url}: {message}");
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
        let parsed = EtcdUrl::parse("etcd://u:hunter2@h1:2379").unwrap();
        assert!(!format!("{parsed:?}").contains("hunter2"));
    }
}
