//! Reading a store's URL from the environment: the one body of the builders' `from_env()`.

use std::env::VarError;

use crate::error::LockError;

/// The URL in the environment variable `name`, as `lookup` finds it (`std::env::var` in
/// the builders' `from_env()`; a closure in tests, so they never touch the process's
/// environment). `wanted` says what the variable should hold, e.g. `"a redis:// URL"`.
///
/// # Errors
///
/// [`LockError::Config`] naming the variable when it is unset, empty or not UTF-8. The
/// variable's value is never part of an error: it may hold a password.
pub fn url_from_env(
    name: &str,
    wanted: &str,
    lookup: impl FnOnce(&str) -> Result<String, VarError>,
) -> Result<String, LockError> {
    match lookup(name) {
        Ok(url) if !url.trim().is_empty() => Ok(url),
        Ok(_) => Err(LockError::Config(format!(
            "the environment variable {name} is empty: set it to {wanted}"
        ))),
        Err(VarError::NotPresent) => Err(LockError::Config(format!(
            "the environment variable {name} is not set: set it to {wanted}"
        ))),
        Err(VarError::NotUnicode(_)) => Err(LockError::Config(format!(
            "the environment variable {name} is not valid UTF-8"
        ))),
    }
}

/// The builder `from_url` makes of the URL in the environment variable `name`: what every
/// backend's `from_env()` does, with its variable, `wanted` (see [`url_from_env`]) and its
/// own `from_url`. `lookup` reads the variable: `std::env::var` in `from_env()`, a closure
/// in tests.
///
/// # Errors
///
/// Those of [`url_from_env`], then those of `from_url`.
pub fn builder_from_env<B>(
    name: &str,
    wanted: &str,
    lookup: impl FnOnce(&str) -> Result<String, VarError>,
    from_url: impl FnOnce(&str) -> Result<B, LockError>,
) -> Result<B, LockError> {
    from_url(&url_from_env(name, wanted, lookup)?)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::*;

    #[test]
    fn a_variable_that_is_unset_empty_or_not_utf8_is_a_config_error_naming_it() {
        let cases: [(Result<String, VarError>, &str); 3] = [
            (
                Err(VarError::NotPresent),
                "is not set: set it to a redis:// URL",
            ),
            (Ok("  ".into()), "is empty: set it to a redis:// URL"),
            (
                Err(VarError::NotUnicode(OsString::from("x"))),
                "is not valid UTF-8",
            ),
        ];
        for (found, says) in cases {
            let Err(LockError::Config(message)) =
                url_from_env("SOME_URL", "a redis:// URL", |_| found)
            else {
                panic!("expected a Config error for {says}");
            };
            assert!(
                message.contains("SOME_URL") && message.contains(says),
                "{message}"
            );
        }
    }

    #[test]
    fn a_set_variable_is_read_under_its_name() {
        let url = url_from_env("SOME_URL", "a URL", |name| {
            assert_eq!(name, "SOME_URL");
            Ok("redis://u:pw@h:1/".into())
        })
        .unwrap();
        assert_eq!(url, "redis://u:pw@h:1/");
    }

    #[test]
    fn a_builder_is_made_from_the_url_found_and_not_without_one() {
        let built = builder_from_env(
            "SOME_URL",
            "a URL",
            |_| Ok("redis://h:1/".into()),
            |url| Ok(format!("built from {url}")),
        );
        assert_eq!(built.unwrap(), "built from redis://h:1/");
        let unset = builder_from_env(
            "SOME_URL",
            "a URL",
            |_| Err(VarError::NotPresent),
            |_| -> Result<(), LockError> { panic!("from_url called without a URL") },
        );
        assert!(matches!(unset, Err(LockError::Config(m)) if m.contains("SOME_URL")));
    }
}
