//! `etcd://` and `etcds://` URLs: one or more cluster members, optional credentials and
//! key prefix, and for TLS the CA to trust.
//!
//! - `etcd://[user:password@]host:port[,host:port…][?prefix=NAME]`: plain HTTP/2.
//! - `etcds://[user:password@]host:port[,host:port…]?ca=/path/to/ca.pem[&prefix=NAME]`:
//!   TLS to every member. `ca` is required: the PEM file of the CA that signed the
//!   members' certificates (no system roots are trusted). The file is read when the URL
//!   is opened; a file that is missing, unreadable or holds no PEM certificate is a
//!   [`LockError::Config`] naming the `ca` parameter and the path, never the contents.
//!   The members' certificates must be valid for the host names written in the URL.
//!
//! The members are a comma-separated list, which a generic URL parser cannot read as one
//! authority, so the authority is split here and each member checked on its own. A member
//! without a port gets etcd's client port, 2379. The client sticks to one member and moves
//! to the next when one cannot be reached (see `lock_etcd`). Messages never repeat the
//! credentials.

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
    /// The CA file of an `etcds://` URL.
    ca: Option<String>,
}

impl std::fmt::Debug for EtcdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUrl")
            .field("endpoints", &self.endpoints)
            .field("user", &self.credentials.as_ref().map(|(user, _)| user))
            .field("prefix", &self.prefix)
            .field("ca", &self.ca)
            .finish()
    }
}

impl EtcdUrl {
    /// Parses `url`, whose scheme `connect` has already checked (`etcd` or `etcds`).
    pub(crate) fn parse(url: &str) -> Result<Self, LockError> {
        if lock_api::url_userinfo_is_ambiguous(url) {
            // The members would be read from inside the password.
            return Err(LockError::Config(
                "the etcd URL has an `@` after a `/`, `?` or `#`: escape those characters in \
                 the user and password, and `@` in the prefix and CA path (`%2F`, `%3F`, \
                 `%23`, `%40`)"
                    .into(),
            ));
        }
        let (scheme, rest) = url.trim().split_once("://").unwrap_or(("", ""));
        let tls = scheme.eq_ignore_ascii_case("etcds");
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
            .map(|(i, member)| endpoint(i, member, tls))
            .collect::<Result<Vec<_>, _>>()?;

        // The rest (path, query) read as a URL of its own, without the members.
        let tail = Url::parse(&format!("etcd://members{tail}"))
            .map_err(|e| LockError::Config(format!("malformed etcd URL: {e}")))?;
        if !matches!(tail.path(), "" | "/") || tail.fragment().is_some() {
            return Err(LockError::Config(
                "an etcd URL takes no path: set the key prefix with ?prefix=NAME".into(),
            ));
        }
        let (mut prefix, mut ca) = (None, None);
        for (name, value) in tail.query_pairs() {
            let slot = match &*name {
                "prefix" => &mut prefix,
                "ca" if tls => &mut ca,
                "ca" => {
                    return Err(LockError::Config(
                        "`ca` is for TLS: write etcds://…?ca=/path/to/ca.pem".into(),
                    ));
                }
                other => {
                    return Err(LockError::Config(format!(
                        "unknown parameter `{other}` in the etcd URL: distlock reads prefix{}",
                        if tls { " and ca" } else { "" }
                    )));
                }
            };
            if slot.replace(value.into_owned()).is_some() {
                return Err(LockError::Config(format!(
                    "the etcd URL sets `{name}` more than once"
                )));
            }
        }
        if tls && ca.as_deref().is_none_or(str::is_empty) {
            return Err(LockError::Config(
                "an etcds:// URL needs the CA that signed the members' certificates: add \
                 ?ca=/path/to/ca.pem"
                    .into(),
            ));
        }
        Ok(Self {
            endpoints,
            credentials,
            prefix,
            ca,
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
        if let Some(path) = &self.ca {
            builder = builder.tls_ca_pem(read_ca(path)?);
        }
        Ok(Arc::new(builder.build().await?))
    }
}

/// The PEM file named by the `ca` parameter. Errors name the parameter and the path, and
/// never show what the file holds.
fn read_ca(path: &str) -> Result<Vec<u8>, LockError> {
    let pem = std::fs::read(path).map_err(|e| {
        LockError::Config(format!(
            "cannot read the CA file given by the etcd URL's `ca` parameter ({path}): {e}"
        ))
    })?;
    const BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----";
    if !pem.windows(BEGIN.len()).any(|w| w == BEGIN) {
        return Err(LockError::Config(format!(
            "the CA file given by the etcd URL's `ca` parameter ({path}) holds no PEM \
             certificate (-----BEGIN CERTIFICATE-----)"
        )));
    }
    Ok(pem)
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

/// Member `i` (`host[:port]`) as `http://host:port`, or `https://` for TLS.
fn endpoint(i: usize, member: &str, tls: bool) -> Result<String, LockError> {
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
        "{}://{host}:{}",
        if tls { "https" } else { "http" },
        url.port().unwrap_or(DEFAULT_PORT)
    ))
}

/// Decodes `%XX` escapes; a `%` not followed by two hex digits stays as written (as the
/// other stores' drivers read it). `None` when the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = (bytes[i] == b'%')
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escape {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
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
                ca: None,
            }
        );
        let single = EtcdUrl::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(single.endpoints, ["http://127.0.0.1:2379"]);
        assert_eq!((single.credentials, single.prefix), (None, None));
    }

    #[test]
    fn a_password_holding_a_comma_at_or_percent_is_read_whole() {
        for (written, password) in [
            ("12,hunter2", "12,hunter2"),
            ("a,b,c", "a,b,c"),
            ("p@ss", "p@ss"),
            ("50%off", "50%off"),
            ("p%2Fss%3F", "p/ss?"),
            ("pa:ss", "pa:ss"),
        ] {
            let url = format!("etcd://root:{written}@h1:2379,h2?prefix=jobs");
            let parsed = EtcdUrl::parse(&url).unwrap();
            assert_eq!(
                parsed.credentials,
                Some(("root".to_owned(), password.to_owned())),
                "{url}"
            );
            assert_eq!(parsed.endpoints, ["http://h1:2379", "http://h2:2379"]);
            assert!(!format!("{parsed:?}").contains(written), "{url}");
        }
    }

    #[test]
    fn an_unescaped_delimiter_in_the_userinfo_is_refused_without_showing_it() {
        for url in [
            "etcd://root:12/hunter2@h1:2379",
            "etcd://root:12?hunter2=x@h1:2379",
            "etcd://root:12#hunter2@h1:2379",
            "etcd://ro/ot:hunter2@h1:2379",
            "etcds://root:12?ca=hunter2@h1:2379",
        ] {
            let message = config_error(url);
            assert!(message.contains("%2F"), "{url}: {message}");
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
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
            ("etcds://u:hunter2@h1:2379", "needs the CA"),
            ("etcds://u:hunter2@h1:2379?ca=", "needs the CA"),
            (
                "etcds://u:hunter2@h1?ca=/a&ca=/b",
                "sets `ca` more than once",
            ),
            ("etcd://u:hunter2@h1:2379?ca=/etc/ca.pem", "`ca` is for TLS"),
        ] {
            let message = config_error(url);
            assert!(message.contains(says), "{url}: {message}");
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
        let parsed = EtcdUrl::parse("etcd://u:hunter2@h1:2379").unwrap();
        assert!(!format!("{parsed:?}").contains("hunter2"));
    }

    #[test]
    fn an_etcds_url_names_https_members_and_its_ca_file() {
        let parsed =
            EtcdUrl::parse("etcds://h1:2379,h2?ca=%2Fetc%2Fetcd%2Fca.pem&prefix=jobs").unwrap();
        assert_eq!(parsed.endpoints, ["https://h1:2379", "https://h2:2379"]);
        assert_eq!(parsed.ca.as_deref(), Some("/etc/etcd/ca.pem"));
        assert_eq!(parsed.prefix.as_deref(), Some("jobs"));
    }

    /// A file of this test's own in the temp dir, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(name: &str, contents: &str) -> Self {
            let path = std::env::temp_dir()
                .join(format!("distlock-etcd-url-{}-{name}", std::process::id()));
            std::fs::write(&path, contents).unwrap();
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    async fn open_error(url: &str) -> String {
        match EtcdUrl::parse(url).unwrap().open().await {
            Ok(_) => panic!("{url} opened"),
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("{url}: expected a configuration error, got {other}"),
        }
    }

    #[tokio::test]
    async fn a_missing_or_wrong_ca_file_is_a_config_error_that_shows_no_contents() {
        let missing = std::env::temp_dir().join("distlock-etcd-url-no-such-ca.pem");
        let message = open_error(&format!("etcds://127.0.0.1:1?ca={}", missing.display())).await;
        assert!(message.contains("`ca` parameter"), "{message}");
        assert!(message.contains("no-such-ca.pem"), "{message}");

        let key = TempFile::new(
            "key.pem",
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n",
        );
        let message = open_error(&format!("etcds://127.0.0.1:1?ca={}", key.0.display())).await;
        assert!(message.contains("`ca` parameter"), "{message}");
        assert!(message.contains("no PEM certificate"), "{message}");
        assert!(!message.contains("c2VjcmV0"), "{message}");
    }
}
