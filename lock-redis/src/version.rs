//! The oldest Redis server the scripts work on, checked when connecting.

/// The oldest supported Redis, 5.0. Before it, a script may not write after calling
/// `TIME` (Redis replicated scripts verbatim, so they had to be deterministic): the acquire
/// script would take its key and then fail to store the token, every time.
pub(crate) const MIN_VERSION: (u32, u32) = (5, 0);

/// The `redis_version` of an `INFO server` reply, as (major, minor, patch).
pub(crate) fn server_version(info: &str) -> Option<(u32, u32, u32)> {
    let version = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = version.trim().split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// Fails, saying which version was found, when the server of `info` is older than
/// [`MIN_VERSION`]. A reply without a version (a proxy, say) is let through: nothing
/// proves it old.
pub(crate) fn check(info: &str) -> Result<(), String> {
    match server_version(info) {
        Some((major, minor, patch)) if (major, minor) < MIN_VERSION => Err(format!(
            "Redis {major}.{minor}.{patch} is not supported: the lock scripts need Redis {}.{} or newer",
            MIN_VERSION.0, MIN_VERSION.1
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(version: &str) -> String {
        format!(
            "# Server\r\nredis_version:{version}\r\nredis_git_sha1:00000000\r\nredis_mode:standalone\r\n"
        )
    }

    #[test]
    fn the_version_is_read_from_info_server() {
        assert_eq!(server_version(&info("7.0.15")), Some((7, 0, 15)));
        assert_eq!(server_version(&info("5.0.0")), Some((5, 0, 0)));
        assert_eq!(server_version(&info("255.255.255")), Some((255, 255, 255)));
        assert_eq!(
            server_version("# Server\r\nredis_mode:standalone\r\n"),
            None
        );
    }

    #[test]
    fn servers_older_than_5_0_are_refused_with_their_version() {
        for old in ["4.0.14", "3.2.12", "2.8.24"] {
            let err = check(&info(old)).expect_err(old);
            assert!(err.contains(old) && err.contains("5.0"), "{err}");
        }
        for supported in ["5.0.0", "6.2.14", "7.0.15", "7.2.4", "10.0.0"] {
            assert!(check(&info(supported)).is_ok(), "{supported}");
        }
        assert!(check("no version here").is_ok());
    }
}
