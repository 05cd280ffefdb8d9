//! Showing a store's URL to a person or a log without its secrets. Every backend and the
//! facade use [`redact_url`], so a URL is hidden the same way wherever it is shown.

use std::ops::Range;

/// What replaces each secret.
const HIDDEN: &str = "***";

/// What text without a `scheme://` is shown as.
const NOT_A_URL: &str = "<not a URL>";

/// Parts of query parameter names that mark the value as a secret (compared in lower case).
const SECRET_NAME_PARTS: &[&str] = &["pass", "pwd", "secret", "token"];

/// The URL with its secrets replaced by `***`: the password of its userinfo, and the value
/// of every password-like query parameter (`password`, `sslpassword`, `pass`, `passwd`,
/// `pwd`: any name containing `pass`, `pwd`, `secret` or `token`, in any case, escaped or
/// not). The user, hosts, path and other parameters stay, so the URL still says where
/// it points.
///
/// A user or password may hold any character, escaped or not: the userinfo ends at the
/// last `@`, and the user at its first `:`. When an `@` follows the first `/`, `?` or `#`,
/// the URL reads two ways (an unescaped delimiter in the userinfo, or an `@` in the path or
/// query; see [`url_userinfo_is_ambiguous`]) and whatever is a secret in either reading is
/// hidden, which may hide more than the password.
///
/// A query value ends at the next `&`, so an `&` in a password given as a parameter must
/// be escaped (`%26`) for the drivers as well as for this function.
///
/// A Redis URL's userinfo without a `:` (`redis://secret@host`) is hidden whole, since
/// Redis users often put the password there; in other schemes it is a user name.
/// Text without a `scheme://` is shown as `<not a URL>`: it may be a password pasted in
/// the wrong place.
///
/// ```
/// use distlock::redact_url;
///
/// assert_eq!(redact_url("redis://:hunter2@127.0.0.1:6379/0"), "redis://:***@127.0.0.1:6379/0");
/// assert_eq!(redact_url("redis://u:p#ss/w?rd@h:6379"), "redis://u:***@h:6379");
/// assert_eq!(
///     redact_url("etcd://root:12,secret@h1:2379,h2:2379?prefix=jobs"),
///     "etcd://root:***@h1:2379,h2:2379?prefix=jobs"
/// );
/// assert_eq!(
///     redact_url("postgres://app@db/jobs?sslmode=require&password=hunter2"),
///     "postgres://app@db/jobs?sslmode=require&password=***"
/// );
/// assert_eq!(redact_url("hunter2"), "<not a URL>");
/// ```
pub fn redact_url(url: &str) -> String {
    let url = url.trim();
    let Some((scheme, rest)) = split_scheme(url) else {
        return NOT_A_URL.to_owned();
    };
    let lone_user_is_secret = {
        let scheme = scheme.to_ascii_lowercase();
        scheme.starts_with("redis") || scheme.starts_with("valkey")
    };
    let mut secrets = Vec::new();
    let standard = rest[..authority_end(rest)].rfind('@');
    let last = rest.rfind('@');
    mark_secrets(rest, standard, lone_user_is_secret, &mut secrets);
    if last != standard {
        mark_secrets(rest, last, lone_user_is_secret, &mut secrets);
    }
    let offset = url.len() - rest.len();
    let mut shown = url[..offset].to_owned();
    shown.push_str(&hide(rest, secrets));
    shown
}

/// True when `url` reads two ways: an `@` follows its first `/`, `?` or `#` (after the
/// `scheme://`), so either its user or password holds one of those characters unescaped,
/// or its path, query or fragment holds an `@`. A URL parser takes the first reading's
/// host, which may be part of the password; a message about such a URL must not quote
/// its path or query parameters. Escaping the characters (`%2F`, `%3F`, `%23`, `%40`)
/// removes the doubt.
///
/// ```
/// use distlock::url_userinfo_is_ambiguous;
///
/// assert!(url_userinfo_is_ambiguous("redis://:12/secret@h:6379"));
/// assert!(!url_userinfo_is_ambiguous("redis://:12%2Fsecret@h:6379"));
/// assert!(!url_userinfo_is_ambiguous("redis://u:p@ss@h:6379/0"));
/// ```
pub fn url_userinfo_is_ambiguous(url: &str) -> bool {
    let Some((_, rest)) = split_scheme(url.trim()) else {
        return false;
    };
    rest.rfind('@').is_some_and(|at| at > authority_end(rest))
}

/// The scheme and what follows its `://`, when `url` starts with a valid scheme.
fn split_scheme(url: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some((scheme, rest))
}

/// Where the authority ends as a URL parser reads it: at the first `/`, `?` or `#`.
fn authority_end(rest: &str) -> usize {
    rest.find(['/', '?', '#']).unwrap_or(rest.len())
}

/// Marks the secrets of `rest` (the URL after `scheme://`) read with the userinfo ending
/// at the `@` at `userinfo_end` (`None`: no userinfo).
fn mark_secrets(
    rest: &str,
    userinfo_end: Option<usize>,
    lone_user_is_secret: bool,
    secrets: &mut Vec<Range<usize>>,
) {
    let host_start = match userinfo_end {
        Some(at) => {
            match rest[..at].find(':') {
                Some(colon) => secrets.push(colon + 1..at),
                None if lone_user_is_secret => secrets.push(0..at),
                None => {}
            }
            at + 1
        }
        None => 0,
    };
    let Some(query) = rest[host_start..].find('?').map(|i| host_start + i + 1) else {
        return;
    };
    let mut start = query;
    for pair in rest[query..].split('&') {
        if let Some((name, _)) = pair.split_once('=')
            && is_secret_name(name)
        {
            secrets.push(start + name.len() + 1..start + pair.len());
        }
        start += pair.len() + 1;
    }
}

/// True for a query parameter name that says its value is a secret.
fn is_secret_name(name: &str) -> bool {
    let name = percent_decoded(name).to_ascii_lowercase();
    SECRET_NAME_PARTS.iter().any(|part| name.contains(part))
}

/// `text` with `%XX` escapes decoded; anything else, broken escapes included, as written.
fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// `text` with each run of overlapping or adjacent non-empty `secrets` replaced by `***`.
fn hide(text: &str, mut secrets: Vec<Range<usize>>) -> String {
    secrets.retain(|r| !r.is_empty());
    secrets.sort_by_key(|r| r.start);
    let mut shown = String::with_capacity(text.len());
    let mut shown_up_to = 0;
    let mut secrets = secrets.into_iter().peekable();
    while let Some(mut secret) = secrets.next() {
        while let Some(next) = secrets.next_if(|next| next.start <= secret.end) {
            secret.end = secret.end.max(next.end);
        }
        shown.push_str(&text[shown_up_to..secret.start]);
        shown.push_str(HIDDEN);
        shown_up_to = secret.end;
    }
    shown.push_str(&text[shown_up_to..]);
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every character that ends a URL part, or separates etcd members, or escapes.
    const SPECIAL: &[char] = &['@', '#', '?', '/', ',', '%', ':', '&', '='];

    #[test]
    fn a_password_holding_any_special_character_is_hidden() {
        for c in SPECIAL {
            for password in [
                format!("hu{c}nter2"),
                format!("{c}hunter2"),
                format!("hunter2{c}"),
            ] {
                for (url, expected) in [
                    (
                        format!("redis://app:{password}@db:6379/2"),
                        "redis://app:***@db:6379/2",
                    ),
                    (
                        format!("postgres://app:{password}@db:5432/jobs?sslmode=disable"),
                        "postgres://app:***@db:5432/jobs?sslmode=disable",
                    ),
                    (
                        format!("etcd://root:{password}@h1:2379,h2:2379?prefix=jobs"),
                        "etcd://root:***@h1:2379,h2:2379?prefix=jobs",
                    ),
                ] {
                    assert_eq!(redact_url(&url), expected, "{url}");
                }
            }
        }
    }

    #[test]
    fn a_user_holding_any_special_character_is_kept_and_the_password_hidden() {
        // A `:` ends the user, so it cannot be told from one in the password.
        for c in SPECIAL.iter().filter(|&&c| c != ':') {
            let user = format!("ap{c}p");
            let url = format!("redis://{user}:hunter2@db:6379/2");
            assert_eq!(
                redact_url(&url),
                format!("redis://{user}:***@db:6379/2"),
                "{url}"
            );
        }
    }

    #[test]
    fn password_like_query_parameters_are_hidden_whatever_their_spelling() {
        for name in [
            "password",
            "sslpassword",
            "pass",
            "passwd",
            "pwd",
            "PassWord",
            "pass%77ord",
            "options[password]",
            "client_secret",
            "auth_token",
        ] {
            let url = format!("postgres://app@db/jobs?sslmode=require&{name}=hun@ter#2&mode=lease");
            assert_eq!(
                redact_url(&url),
                format!("postgres://app@db/jobs?sslmode=require&{name}=***&mode=lease"),
                "{url}"
            );
        }
        assert_eq!(
            redact_url("postgres://app:pw@db/jobs?password=hunter2"),
            "postgres://app:***@db/jobs?password=***"
        );
    }

    #[test]
    fn what_is_not_a_secret_is_shown_as_written() {
        for url in [
            "redis://127.0.0.1:6379",
            "rediss://h:6380/#insecure",
            "postgres://app@db:5432/jobs?sslmode=require&schema=locks",
            "etcd://h1,h2:2379?prefix=a%40b",
            "memory://",
            "redis://:@h",
        ] {
            assert_eq!(redact_url(url), url);
        }
        assert_eq!(redact_url("  redis://h \n"), "redis://h");
    }

    #[test]
    fn a_redis_userinfo_without_a_colon_is_taken_for_a_password() {
        assert_eq!(redact_url("redis://hunter2@h:6379"), "redis://***@h:6379");
        assert_eq!(redact_url("rediss://hunter2@h"), "rediss://***@h");
        assert_eq!(
            redact_url("redis+cluster://hunter2@h:7000"),
            "redis+cluster://***@h:7000"
        );
    }

    #[test]
    fn a_url_that_reads_two_ways_hides_what_either_reading_calls_secret() {
        // The password could be `pw@h/db?application_name=me`: everything up to the last @.
        let url = "postgres://u:pw@h/db?application_name=me@box";
        assert!(url_userinfo_is_ambiguous(url));
        assert_eq!(redact_url(url), "postgres://u:***@box");
        // Or the @ is in a parameter's value: the password parameter is still hidden.
        assert_eq!(
            redact_url("postgres://app@db/x?password=p@ss"),
            "postgres://app@db/x?password=***"
        );
    }

    #[test]
    fn text_that_is_not_a_url_is_not_shown() {
        for text in [
            "hunter2",
            "127.0.0.1:6379",
            "u:hunter2@h",
            "1x://u:hunter2@h",
            "",
        ] {
            assert_eq!(redact_url(text), "<not a URL>", "{text}");
        }
    }

    #[test]
    fn a_url_is_ambiguous_only_when_an_at_follows_a_delimiter() {
        for url in [
            "redis://u:p#ss@h",
            "redis://u:p?ss@h",
            "redis://u:p/ss@h",
            "etcd://h1/?prefix=a@b",
        ] {
            assert!(url_userinfo_is_ambiguous(url), "{url}");
        }
        for url in [
            "redis://u:p@ss@h:6379/0?x=1#f",
            "etcd://root:12,secret@h1,h2",
            "redis://h",
            "hunter2@h/x",
        ] {
            assert!(!url_userinfo_is_ambiguous(url), "{url}");
        }
    }
}
