//! An ACL user a `redis-server` is started with ([`RedisUser`]): its name, password and
//! rules, given on the command line as a `user` directive so that it survives a restart.

use std::fmt;
use std::net::SocketAddr;

use sha2::{Digest, Sha256};

use crate::error::HarnessError;

/// An ACL user for [`RedisServerBuilder::user`](super::RedisServerBuilder::user): a name, a
/// password and ACL rules (`~distlock:*`, `-@all`, `+get`, ...). The server is given the
/// password's SHA-256 (`#<hex>`), never the password; `Debug` never shows it either.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUser {
    name: String,
    password: String,
    rules: Vec<String>,
}

impl fmt::Debug for RedisUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisUser")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .field("rules", &self.rules)
            .finish()
    }
}

impl RedisUser {
    /// A user called `name` with `password` and `rules`. The rules may not set passwords
    /// themselves (`>…`, `<…`, `#…`, `nopass`): the password is `password`.
    pub fn new<I, S>(name: &str, password: &str, rules: I) -> Result<Self, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let rules: Vec<String> = rules.into_iter().map(Into::into).collect();
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(HarnessError::Setup(format!(
                "an ACL user name must be one word, not {name:?}"
            )));
        }
        if let Some(rule) = rules
            .iter()
            .find(|r| r.starts_with(['>', '<', '#', '!']) || r.as_str() == "nopass" || r.is_empty())
        {
            return Err(HarnessError::Setup(format!(
                "the rules of ACL user {name} may not set a password or be empty: {}",
                if rule.is_empty() {
                    "\"\""
                } else {
                    "a password rule"
                }
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            password: password.to_owned(),
            rules,
        })
    }

    /// The user an `ACL SETUSER NAME rules…` line describes (as a README gives it), with
    /// `password` in place of its `>…` rule. Fails unless the line is such a command with
    /// exactly one `>…` rule.
    pub fn from_setuser_line(line: &str, password: &str) -> Result<Self, HarnessError> {
        let mut words = line.split_whitespace();
        let (Some(acl), Some(setuser), Some(name)) = (words.next(), words.next(), words.next())
        else {
            return Err(HarnessError::Setup(
                "the line does not start with `ACL SETUSER NAME`".to_owned(),
            ));
        };
        if !acl.eq_ignore_ascii_case("ACL") || !setuser.eq_ignore_ascii_case("SETUSER") {
            return Err(HarnessError::Setup(
                "the line does not start with `ACL SETUSER NAME`".to_owned(),
            ));
        }
        let (passwords, rules): (Vec<&str>, Vec<&str>) = words.partition(|w| w.starts_with('>'));
        if passwords.len() != 1 {
            return Err(HarnessError::Setup(format!(
                "the ACL SETUSER line for {name} has {} `>password` rules, not one",
                passwords.len()
            )));
        }
        Self::new(name, password, rules)
    }

    /// The user of the one line of `doc` (a README) that starts with `ACL SETUSER`, as
    /// [`from_setuser_line`](Self::from_setuser_line) reads it; fails unless there is
    /// exactly one such line.
    pub fn from_doc(doc: &str, password: &str) -> Result<Self, HarnessError> {
        let mut lines = doc
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("ACL SETUSER "));
        match (lines.next(), lines.next()) {
            (Some(line), None) => Self::from_setuser_line(line, password),
            (None, _) => Err(HarnessError::Setup(
                "the document has no `ACL SETUSER` line".to_owned(),
            )),
            (Some(_), Some(_)) => Err(HarnessError::Setup(
                "the document has more than one `ACL SETUSER` line".to_owned(),
            )),
        }
    }

    /// The same user without the rule `rule` (for example a channel rule); fails if the
    /// user has no such rule.
    pub fn without_rule(mut self, rule: &str) -> Result<Self, HarnessError> {
        let before = self.rules.len();
        self.rules.retain(|r| r != rule);
        if self.rules.len() == before {
            return Err(HarnessError::Setup(format!(
                "ACL user {} has no rule {rule:?}",
                self.name
            )));
        }
        Ok(self)
    }

    /// The user's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The user's password.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// `redis://NAME:PASSWORD@ADDR/`, percent-encoded: this user's login at `addr` (the
    /// server, or a proxy in front of it).
    pub fn url(&self, addr: SocketAddr) -> String {
        url_with_login(
            &format!("redis://{addr}/"),
            Some(&self.name),
            Some(&self.password),
        )
    }

    /// The user's ACL rules, without the password.
    pub fn rules(&self) -> &[String] {
        &self.rules
    }

    /// The arguments of the `--user` directive: the name, `on`, the password's SHA-256,
    /// and the rules, each its own argument (redis-server joins them into one config line).
    pub(super) fn directive(&self) -> Vec<String> {
        let hash: String = Sha256::digest(self.password.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let mut args = vec![
            "--user".to_owned(),
            self.name.clone(),
            "reset".to_owned(),
            "on".to_owned(),
            format!("#{hash}"),
        ];
        args.extend(self.rules.iter().cloned());
        args
    }
}

/// `plain` (a URL with a host) with `user` and `password`, percent-encoded, as user info.
pub(crate) fn url_with_login(plain: &str, user: Option<&str>, password: Option<&str>) -> String {
    let Ok(mut url) = url::Url::parse(plain) else {
        return plain.to_owned();
    };
    // Neither can fail: the URL has a host, so it takes a user name and a password.
    let login = url
        .set_username(user.unwrap_or_default())
        .and_then(|()| url.set_password(password));
    match login {
        Ok(()) => url.into(),
        Err(()) => plain.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = "ACL SETUSER distlock on >PASSWORD resetkeys ~distlock:* \
                        resetchannels &distlock:* -@all +ping +get";

    #[test]
    fn a_setuser_line_gives_its_rules_and_the_password_given() {
        let user = RedisUser::from_setuser_line(LINE, "s3cret").unwrap();
        assert_eq!(user.name(), "distlock");
        assert_eq!(user.password(), "s3cret");
        assert_eq!(
            user.rules(),
            [
                "on",
                "resetkeys",
                "~distlock:*",
                "resetchannels",
                "&distlock:*",
                "-@all",
                "+ping",
                "+get"
            ]
        );
        let user = user.without_rule("&distlock:*").unwrap();
        assert!(!user.rules().iter().any(|r| r.starts_with('&')));
        assert!(user.clone().without_rule("&distlock:*").is_err());
    }

    #[test]
    fn the_password_is_never_in_the_directive_nor_debug() {
        let user = RedisUser::from_setuser_line(LINE, "s3cret").unwrap();
        let directive = user.directive().join(" ");
        assert!(!directive.contains("s3cret"), "{directive}");
        // sha256("s3cret")
        assert!(
            directive.contains("#1ec1c26b50d5d3c58d9583181af8076655fe00756bf7285940ba3670f99fcba0"),
            "{directive}"
        );
        assert!(!format!("{user:?}").contains("s3cret"));
    }

    #[test]
    fn a_document_gives_its_one_setuser_line() {
        let doc = format!("# Redis\n\n```text\n{LINE}\n```\n");
        let user = RedisUser::from_doc(&doc, "pw").unwrap();
        assert_eq!(user, RedisUser::from_setuser_line(LINE, "pw").unwrap());
        assert!(RedisUser::from_doc("no line here", "pw").is_err());
        assert!(RedisUser::from_doc(&format!("{doc}{doc}"), "pw").is_err());
        assert_eq!(
            user.url("127.0.0.1:6379".parse().unwrap()),
            "redis://distlock:pw@127.0.0.1:6379/"
        );
    }

    #[test]
    fn lines_that_are_not_one_user_with_one_password_are_refused() {
        for line in [
            "ACL SETUSER",
            "SET distlock on >pw",
            "ACL SETUSER distlock on ~*",
            "ACL SETUSER distlock on >a >b",
        ] {
            assert!(RedisUser::from_setuser_line(line, "pw").is_err(), "{line}");
        }
        assert!(RedisUser::new("two words", "pw", ["~*"]).is_err());
        assert!(RedisUser::new("u", "pw", ["nopass"]).is_err());
    }
}
