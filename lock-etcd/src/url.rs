//! [`EtcdBuilder::from_url`] and [`EtcdBuilder::from_env`]: `etcd://` and `etcds://` URLs,
//! one or more cluster members, optional credentials and key prefix, and for TLS the CA
//! to trust.
//!
//! - `etcd://[user:password@]host:port[,host:port…][?key_prefix=NAME]`: plain HTTP/2.
//! - `etcds://[user:password@]host:port[,host:port…]?ca=/path/to/ca.pem[&key_prefix=NAME]`:
//!   TLS to every member. `ca` is required: the PEM file of the CA that signed the
//!   members' certificates (no system roots are trusted). The file is read by
//!   `from_url`; a file that is missing, unreadable or holds no PEM certificate is a
//!   [`LockError::Config`] naming the `ca` parameter and the path, never the contents.
//!   The members' certificates must be valid for the host names written in the URL.
//!
//! `key_prefix` is named as the builder's [`EtcdBuilder::key_prefix`] is; `prefix`, its
//! spelling before 0.1.0, is still read (giving both is giving it twice).
//!
//! The members are a comma-separated list, which a generic URL parser cannot read as one
//! authority, so the authority is split here and each member checked on its own. A member
//! without a port gets etcd's client port, 2379. The client sticks to one member and moves
//! to the next when one cannot be reached (see the crate docs). Messages never repeat the
//! credentials.

use distlock_core::LockError;
use url::Url;

use crate::config::EtcdBuilder;

/// The environment variable [`EtcdBuilder::from_env`] reads the URL from.
pub const ETCD_URL_ENV: &str = "DISTLOCK_ETCD_URL";

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
    /// Parses an `etcd://` or `etcds://` URL.
    pub(crate) fn parse(url: &str) -> Result<Self, LockError> {
        if distlock_core::url_userinfo_is_ambiguous(url) {
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
        if !tls && !scheme.eq_ignore_ascii_case("etcd") {
            return Err(LockError::Config(
                "an etcd URL starts with etcd:// or etcds:// (TLS)".into(),
            ));
        }
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
                "an etcd URL takes no path: set the key prefix with ?key_prefix=NAME".into(),
            ));
        }
        let (mut prefix, mut ca) = (None, None);
        for (name, value) in tail.query_pairs() {
            let slot = match &*name {
                // `prefix`: the spelling before 0.1.0.
                "key_prefix" | "prefix" => &mut prefix,
                "ca" if tls => &mut ca,
                "ca" => {
                    return Err(LockError::Config(
                        "`ca` is for TLS: write etcds://…?ca=/path/to/ca.pem".into(),
                    ));
                }
                other => {
                    return Err(LockError::Config(format!(
                        "unknown parameter `{other}` in the etcd URL: distlock reads key_prefix{}",
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

    /// The builder these settings make; reads the CA file of an `etcds://` URL.
    fn into_builder(self) -> Result<EtcdBuilder, LockError> {
        let mut builder = EtcdBuilder::new().endpoints(self.endpoints);
        if let Some((user, password)) = self.credentials {
            builder = builder.credentials(user, password);
        }
        if let Some(prefix) = self.prefix {
            builder = builder.key_prefix(prefix);
        }
        if let Some(path) = &self.ca {
            builder = builder.tls_ca_pem(read_ca(path)?);
        }
        Ok(builder)
    }
}

impl EtcdBuilder {
    /// A builder for the cluster a URL names: its members, credentials, key prefix and,
    /// for TLS, the CA file, which is read here. Other settings keep their defaults and
    /// can be changed before [`build`](Self::build).
    ///
    /// - `etcd://[user:password@]host[:port][,host[:port]…][?key_prefix=NAME]`: plain HTTP/2;
    ///   a member without a port gets 2379.
    /// - `etcds://…?ca=/path/to/ca.pem[&key_prefix=NAME]`: TLS to every member, trusting only
    ///   the CA in that PEM file (required); the members' certificates must be valid for
    ///   the host names written in the URL.
    ///
    /// A `/`, `?`, `#` or `@` in the user or password is escaped (`%2F`, `%3F`, `%23`,
    /// `%40`); a `,` or `:` in the password needs no escape.
    ///
    /// ```
    /// let builder = distlock::etcd::EtcdBuilder::from_url("etcd://root:s3cret@h1:2379,h2?key_prefix=jobs")?;
    /// assert!(!format!("{builder:?}").contains("s3cret"));
    /// # Ok::<(), distlock::LockError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for a malformed URL, an unknown or repeated parameter, or a
    /// CA file that cannot be read or holds no certificate; the message never shows the
    /// password.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        EtcdUrl::parse(url)?.into_builder()
    }

    /// [`from_url`](Self::from_url) with the URL in the environment variable
    /// `DISTLOCK_ETCD_URL` ([`ETCD_URL_ENV`]).
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] naming the variable when it is unset, empty or not UTF-8;
    /// otherwise those of [`from_url`](Self::from_url).
    pub fn from_env() -> Result<Self, LockError> {
        Self::from_env_with(|name| std::env::var(name))
    }

    /// [`from_env`](Self::from_env) with the variable read by `lookup`.
    pub(crate) fn from_env_with(
        lookup: impl FnOnce(&str) -> Result<String, std::env::VarError>,
    ) -> Result<Self, LockError> {
        distlock_core::builder_from_env(ETCD_URL_ENV, "an etcd:// URL", lookup, Self::from_url)
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
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(std::borrow::Cow::into_owned)
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

    #[test]
    fn the_key_prefix_is_read_under_the_builders_name_and_the_old_one() {
        for url in ["etcd://h1?key_prefix=jobs", "etcd://h1?prefix=jobs"] {
            let parsed = EtcdUrl::parse(url).unwrap();
            assert_eq!(parsed.prefix.as_deref(), Some("jobs"), "{url}");
        }
        let message = config_error("etcd://h1?prefix=a&key_prefix=b");
        assert!(message.contains("more than once"), "{message}");
        let message = config_error("etcd://h1?key_prfix=a");
        assert!(message.contains("distlock reads key_prefix"), "{message}");
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

    fn from_url_error(url: &str) -> String {
        match EtcdBuilder::from_url(url) {
            Ok(_) => panic!("{url} was accepted"),
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("{url}: expected a configuration error, got {other}"),
        }
    }

    #[test]
    fn a_missing_or_wrong_ca_file_is_a_config_error_that_shows_no_contents() {
        let missing = std::env::temp_dir().join("distlock-etcd-url-no-such-ca.pem");
        let message = from_url_error(&format!("etcds://127.0.0.1:1?ca={}", missing.display()));
        assert!(message.contains("`ca` parameter"), "{message}");
        assert!(message.contains("no-such-ca.pem"), "{message}");

        let key = TempFile::new(
            "key.pem",
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n",
        );
        let message = from_url_error(&format!("etcds://127.0.0.1:1?ca={}", key.0.display()));
        assert!(message.contains("`ca` parameter"), "{message}");
        assert!(message.contains("no PEM certificate"), "{message}");
        assert!(!message.contains("c2VjcmV0"), "{message}");
    }

    #[test]
    fn from_env_reads_the_url_and_names_a_missing_variable() {
        use std::env::VarError;
        let builder = EtcdBuilder::from_env_with(|name| {
            assert_eq!(name, ETCD_URL_ENV);
            Ok("etcd://root:hunter2@h1:2379?prefix=jobs".into())
        })
        .unwrap();
        assert!(
            format!("{builder:?}").contains("http://h1:2379"),
            "{builder:?}"
        );
        for found in [
            Err(VarError::NotPresent),
            Err(VarError::NotUnicode("x".into())),
            Ok(" ".to_owned()),
        ] {
            let Err(LockError::Config(message)) = EtcdBuilder::from_env_with(|_| found) else {
                panic!("a missing URL was accepted");
            };
            assert!(message.contains("DISTLOCK_ETCD_URL"), "{message}");
        }
        let Err(LockError::Config(message)) =
            EtcdBuilder::from_env_with(|_| Ok("etcd://u:hunter2@h1?x=1".into()))
        else {
            panic!("a bad URL was accepted");
        };
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn a_url_of_another_store_is_refused() {
        assert!(from_url_error("redis://127.0.0.1:6379").contains("etcd://"));
    }
}
