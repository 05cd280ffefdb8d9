//! Redis URLs: the check of a URL given to the builder, and the reading of a
//! `redis+sentinel://` URL (the forms are listed under the builder's "URLs"). The client
//! library parses the rest when connecting. Messages never show the password.

use distlock_core::{LockError, redact_url};

/// The URL to give the builder for `url`, the way `from_url` takes it: trimmed, checked
/// (see [`check`]), and for a scheme other than `redis+sentinel://` parsed, with one of
/// the schemes the builder knows and a host.
pub(crate) fn checked(url: &str) -> Result<String, LockError> {
    let url = url.trim();
    check(url)?;
    if SentinelUrl::parse(url)?.is_some() {
        return Ok(url.to_owned());
    }
    let parsed = url::Url::parse(url).map_err(|e| {
        // The url crate's messages never repeat the input.
        LockError::Config(format!("malformed Redis URL: {e}"))
    })?;
    let scheme = parsed.scheme();
    if !matches!(
        scheme,
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster"
    ) {
        return Err(LockError::Config(
            "a Redis URL starts with redis://, rediss:// (TLS), redis+cluster:// or \
             redis+sentinel://"
                .into(),
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(LockError::Config(format!(
            "the {scheme}:// URL has no host: write {scheme}://host:port"
        )));
    }
    Ok(parsed.as_str().to_owned())
}

/// True for a URL over TLS: `rediss://` or `rediss+sentinel://`.
pub(crate) fn is_tls(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("rediss+sentinel://")
}

/// The Sentinel port when a `redis+sentinel://` host names none.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// What a `redis+sentinel://` URL says: where the Sentinels are, the name they monitor the
/// master by, and how to talk to the master once found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    /// Each Sentinel's host and port, in the order given.
    pub(crate) sentinels: Vec<(String, u16)>,
    pub(crate) master_name: String,
    /// A `redis://` (or `rediss://`) URL of the master with its credentials, database and
    /// fragment, and the first Sentinel's address in place of the master's own, which is
    /// found when connecting.
    pub(crate) master_url: String,
}

impl SentinelUrl {
    /// `None` for a URL of another scheme; a [`LockError::Config`] for a sentinel URL
    /// without a host or master name, with a bad host or port, or with more path than
    /// `/master_name/db`. Messages never show the password.
    pub(crate) fn parse(url: &str) -> Result<Option<Self>, LockError> {
        let url = url.trim();
        let (base, rest) = if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            ("redis", rest)
        } else if let Some(rest) = url.strip_prefix("rediss+sentinel://") {
            ("rediss", rest)
        } else {
            return Ok(None);
        };
        let shown = redact_url(url);
        let bad = |why: String| LockError::Config(format!("the Sentinel URL {shown} {why}"));
        let (rest, fragment) = match rest.split_once('#') {
            Some((rest, fragment)) => (rest, Some(fragment)),
            None => (rest, None),
        };
        let rest = rest.split('?').next().unwrap_or_default();
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let mut sentinels = Vec::new();
        for host in hosts.split(',') {
            let parsed = url::Url::parse(&format!("redis://{host}/"))
                .ok()
                .filter(|u| u.host_str().is_some_and(|h| !h.is_empty()))
                .filter(|u| u.username().is_empty() && u.path() == "/");
            let Some(parsed) = parsed else {
                return Err(bad(format!(
                    "has {host:?} where a Sentinel's host[:port] belongs: write \
                     redis+sentinel://host:port,host:port/master_name"
                )));
            };
            // An IPv6 address without its brackets, as a socket address takes it.
            let host = parsed.host_str().unwrap_or_default();
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            sentinels.push((host, parsed.port().unwrap_or(DEFAULT_SENTINEL_PORT)));
        }
        let mut segments = path.split('/');
        let master_name = segments.next().unwrap_or_default();
        if master_name.is_empty() {
            return Err(bad(
                "names no master: write redis+sentinel://host:port/master_name[/db]".into(),
            ));
        }
        let db = segments.next().filter(|db| !db.is_empty());
        if let Some(db) = db {
            if db.parse::<u32>().is_err() {
                return Err(bad(format!(
                    "has {db:?} where the database number belongs (/master_name/db)"
                )));
            }
        }
        if segments.any(|s| !s.is_empty()) {
            return Err(bad("has more path than /master_name/db".into()));
        }
        let first = hosts.split(',').next().unwrap_or_default();
        let master_url = format!(
            "{base}://{}{first}/{}{}",
            userinfo.map(|u| format!("{u}@")).unwrap_or_default(),
            db.unwrap_or("0"),
            fragment.map(|f| format!("#{f}")).unwrap_or_default(),
        );
        url::Url::parse(&master_url).map_err(|e| bad(format!("is malformed: {e}")))?;
        Ok(Some(Self {
            sentinels,
            master_name: master_name.to_owned(),
            master_url,
        }))
    }
}

/// Refuses a URL whose userinfo may hold an unescaped delimiter (the client would read a
/// piece of the password as the host), and any query parameter: the client reads none
/// that distlock supports, so a parameter would be silently ignored.
pub(crate) fn check(url: &str) -> Result<(), LockError> {
    if distlock_core::url_userinfo_is_ambiguous(url) {
        return Err(LockError::Config(format!(
            "the Redis URL {} has an `@` after a `/`, `?` or `#`: escape those characters \
             in the user and password (`%2F`, `%3F`, `%23`, `%40`)",
            redact_url(url)
        )));
    }
    let after_fragment = url.split('#').next().unwrap_or_default();
    let Some((_, query)) = after_fragment.split_once('?') else {
        return Ok(());
    };
    match query.split('&').find(|pair| !pair.is_empty()) {
        Some(pair) => {
            let name = pair.split_once('=').map_or(pair, |(name, _)| name);
            Err(LockError::Config(format!(
                "unknown parameter `{name}` in the Redis URL {}: a Redis URL takes no query \
                 parameters; the builder's methods set the options",
                redact_url(url)
            )))
        }
        None => Ok(()),
    }
}
