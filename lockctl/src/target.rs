//! The store a command works on: the URL given first, or, when it is left out, the URL
//! in `DISTLOCK_URL`, which `distlock::connect_from_env` reads too.

use clap::Args;

/// `[URL] NAME`: a store URL (or `DISTLOCK_URL`) and the name of a lock or role.
#[derive(Debug, Args)]
pub struct UrlAndName {
    /// The store's URL (when left out, the URL in DISTLOCK_URL), then the lock's or
    /// role's name.
    #[arg(num_args = 1..=2, required = true, value_names = ["URL", "NAME"])]
    words: Vec<String>,
}

impl UrlAndName {
    /// The URL and the name, the URL from `env` (the environment's `DISTLOCK_URL`) when
    /// only the name was given.
    pub fn resolve(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(String, String), String> {
        match self.words.as_slice() {
            [url, name] => Ok((url.clone(), name.clone())),
            [name] => match env(distlock::URL_ENV) {
                Some(url) if !url.is_empty() => Ok((url, name.clone())),
                _ => Err(format!(
                    "give the store's URL before {name:?}, or set {}",
                    distlock::URL_ENV
                )),
            },
            _ => Err("give the store's URL (or set DISTLOCK_URL) and a name".into()),
        }
    }
}

/// `[URL]`: a store URL, or the one in `DISTLOCK_URL`.
pub fn url_or_env(
    url: Option<String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    match url.or_else(|| env(distlock::URL_ENV).filter(|u| !u.is_empty())) {
        Some(url) => Ok(url),
        None => Err(format!(
            "give the store's URL, or set {}",
            distlock::URL_ENV
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(words: &[&str]) -> UrlAndName {
        UrlAndName {
            words: words.iter().map(|w| w.to_string()).collect(),
        }
    }

    #[test]
    fn a_url_given_wins_over_the_environment() {
        let env = |_: &str| Some("redis://env".to_owned());
        assert_eq!(
            words(&["memory://", "k"]).resolve(env).unwrap(),
            ("memory://".to_owned(), "k".to_owned())
        );
        assert_eq!(
            url_or_env(Some("memory://".into()), env).unwrap(),
            "memory://"
        );
    }

    #[test]
    fn a_name_alone_takes_the_url_from_distlock_url() {
        let env = |name: &str| (name == "DISTLOCK_URL").then(|| "redis://env".to_owned());
        assert_eq!(
            words(&["k"]).resolve(env).unwrap(),
            ("redis://env".to_owned(), "k".to_owned())
        );
        assert_eq!(url_or_env(None, env).unwrap(), "redis://env");
    }

    #[test]
    fn without_either_the_error_names_the_variable() {
        let env = |_: &str| None;
        let e = words(&["k"]).resolve(env).unwrap_err();
        assert!(e.contains("DISTLOCK_URL") && e.contains("\"k\""), "{e}");
        let e = url_or_env(None, |_: &str| Some(String::new())).unwrap_err();
        assert!(e.contains("DISTLOCK_URL"), "{e}");
    }
}
