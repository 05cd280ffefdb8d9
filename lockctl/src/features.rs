//! Which stores this build of lockctl can open. etcd is opt-in (the `etcd` feature): its
//! client's build needs a protobuf compiler, which the demo and the other stores do not.
//! A URL whose store was left out fails before anything is sent, saying how to get it.

/// The cargo feature each URL scheme needs, and whether this build has it.
const SCHEMES: &[(&str, &str, bool)] = &[
    ("redis", "redis", cfg!(feature = "redis")),
    ("rediss", "redis", cfg!(feature = "redis")),
    ("redis+cluster", "redis", cfg!(feature = "redis")),
    ("redis+sentinel", "redis", cfg!(feature = "redis")),
    ("rediss+sentinel", "redis", cfg!(feature = "redis")),
    ("etcd", "etcd", cfg!(feature = "etcd")),
    ("etcds", "etcd", cfg!(feature = "etcd")),
    ("postgres", "postgres", cfg!(feature = "postgres")),
    ("postgresql", "postgres", cfg!(feature = "postgres")),
];

/// Fails for the first URL whose store this build of lockctl cannot open.
pub fn check(urls: &[&str]) -> Result<(), String> {
    for url in urls {
        let Some((scheme, _)) = url.split_once("://") else {
            continue; // malformed: `connect` names the problem
        };
        let scheme = scheme.to_ascii_lowercase();
        if let Some((_, feature, false)) = SCHEMES.iter().find(|(s, _, _)| *s == scheme) {
            return Err(missing(feature, &scheme));
        }
    }
    Ok(())
}

fn missing(feature: &str, scheme: &str) -> String {
    let build_needs = if feature == "etcd" {
        " (etcd-client's build needs protoc and the protobuf includes: \
         apt-get install protobuf-compiler libprotobuf-dev)"
    } else {
        ""
    };
    format!(
        "feature `{feature}` is not enabled in this lockctl, so it cannot open {scheme}:// URLs: \
         build it with `cargo build --release -p lockctl --features {feature}`{build_needs}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheme_is_refused_exactly_when_its_feature_is_off() {
        for (scheme, feature, enabled) in SCHEMES {
            let url = format!("{scheme}://127.0.0.1:1");
            match check(&[&url]) {
                Ok(()) => assert!(enabled, "{url} passed without `{feature}`"),
                Err(message) => {
                    assert!(!enabled, "{url} refused with `{feature}` on: {message}");
                    assert!(
                        message.contains(&format!("--features {feature}")),
                        "{message}"
                    );
                }
            }
        }
    }

    #[test]
    fn memory_and_malformed_urls_are_left_to_connect() {
        assert_eq!(check(&["memory://", "not a url", "unknown://h"]), Ok(()));
    }
}
