//! Commands to a Redis server through the `redis` crate, one fresh RESP2 connection per
//! command ([`resp_command`]), and the replies as [`RespValue`].

use std::net::SocketAddr;
use std::time::Duration;

use redis::IntoConnectionInfo;

use crate::error::HarnessError;

/// Default time limit for one command sent by [`RedisServer::command`].
///
/// [`RedisServer::command`]: super::RedisServer::command
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// One RESP2 reply, as the `redis` crate reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`-style status reply.
    Simple(String),
    /// `-ERR ...` error reply (the text after the `-`).
    Error(String),
    /// `:42` integer reply.
    Integer(i64),
    /// `$n` bulk string; `None` is the nil bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*n` array. Always `Some`: the `redis` crate reads the nil array (`*-1`) as nil,
    /// which is `Bulk(None)` here.
    Array(Option<Vec<RespValue>>),
}

impl RespValue {
    /// The reply as text, for simple strings, errors, integers and bulk strings.
    pub fn as_text(&self) -> Option<String> {
        match self {
            RespValue::Simple(s) | RespValue::Error(s) => Some(s.clone()),
            RespValue::Integer(i) => Some(i.to_string()),
            RespValue::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            RespValue::Bulk(None) | RespValue::Array(_) => None,
        }
    }

    /// True for an error reply.
    pub fn is_error(&self) -> bool {
        matches!(self, RespValue::Error(_))
    }
}

impl TryFrom<redis::Value> for RespValue {
    type Error = String;

    /// Converts a reply read on a RESP2 connection; the RESP3-only kinds (maps, sets,
    /// doubles, ...) never arrive there and are refused.
    fn try_from(value: redis::Value) -> Result<Self, String> {
        use redis::Value;
        Ok(match value {
            Value::Nil => RespValue::Bulk(None),
            Value::Int(i) => RespValue::Integer(i),
            Value::BulkString(bytes) => RespValue::Bulk(Some(bytes)),
            Value::Array(items) => RespValue::Array(Some(
                items
                    .into_iter()
                    .map(RespValue::try_from)
                    .collect::<Result<_, _>>()?,
            )),
            Value::SimpleString(s) => RespValue::Simple(s),
            Value::Okay => RespValue::Simple("OK".into()),
            Value::ServerError(e) => RespValue::Error(error_text(&e)),
            other => return Err(format!("a reply RESP2 does not have: {other:?}")),
        })
    }
}

/// The text of an error reply as the server sent it, e.g. `MOVED 12182 127.0.0.1:7001`.
fn error_text(e: &redis::ServerError) -> String {
    match e.details() {
        Some(details) => format!("{} {details}", e.code()),
        None => e.code().to_owned(),
    }
}

/// Sends one command over a fresh connection (after `AUTH password` when given) and
/// returns the reply. An error reply is returned as `Ok(RespValue::Error(..))`, except a
/// failed `AUTH`, which is a [`HarnessError::Protocol`]; a server that cannot be reached
/// is a [`HarnessError::Client`], one that does not answer within `timeout` a
/// [`HarnessError::Timeout`].
pub async fn resp_command<A: AsRef<[u8]>>(
    addr: SocketAddr,
    password: Option<&str>,
    args: &[A],
    timeout: Duration,
) -> Result<RespValue, HarnessError> {
    let name = args
        .first()
        .map(|a| String::from_utf8_lossy(a.as_ref()).into_owned())
        .unwrap_or_default();
    let what = format!("redis {name} on {addr}");
    let mut cmd = redis::Cmd::new();
    for arg in args {
        cmd.arg(arg.as_ref());
    }
    let fut = async {
        let conn = connect(addr, password).await;
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) if e.kind() == redis::ErrorKind::AuthenticationFailed => {
                return Err(HarnessError::Protocol {
                    what: what.clone(),
                    detail: format!("AUTH failed: {e}"),
                });
            }
            Err(e) => return Err(HarnessError::client(format!("connecting for {what}"), e)),
        };
        match cmd.query_async::<redis::Value>(&mut conn).await {
            Ok(value) => RespValue::try_from(value).map_err(|detail| HarnessError::Protocol {
                what: what.clone(),
                detail,
            }),
            Err(e) => match redis::ServerError::try_from(e) {
                Ok(server) => Ok(RespValue::Error(error_text(&server))),
                Err(e) => Err(HarnessError::client(what.clone(), e)),
            },
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(HarnessError::Timeout {
            what,
            after: timeout,
        }),
    }
}

/// A RESP2 connection to `addr` that sends nothing before the caller's command but `AUTH`
/// (no `CLIENT SETINFO`), so command statistics count only what a test sent. The caller's
/// time limit covers connecting and the reply, so the client's own limits are off.
async fn connect(
    addr: SocketAddr,
    password: Option<&str>,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let mut settings = redis::RedisConnectionInfo::default().set_skip_set_lib_name();
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    let info = redis::ConnectionAddr::Tcp(addr.ip().to_string(), addr.port())
        .into_connection_info()?
        .set_redis_settings(settings);
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(None)
        .set_response_timeout(None);
    redis::Client::open(info)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_convert_to_resp2_values_and_errors_keep_their_text() {
        use redis::Value;
        let reply = Value::Array(vec![
            Value::Okay,
            Value::Int(-7),
            Value::BulkString(b"hello".to_vec()),
            Value::Nil,
            Value::SimpleString("QUEUED".into()),
        ]);
        assert_eq!(
            RespValue::try_from(reply),
            Ok(RespValue::Array(Some(vec![
                RespValue::Simple("OK".into()),
                RespValue::Integer(-7),
                RespValue::Bulk(Some(b"hello".to_vec())),
                RespValue::Bulk(None),
                RespValue::Simple("QUEUED".into()),
            ])))
        );
        for line in [
            "MOVED 12182 127.0.0.1:7001",
            "NOAUTH Authentication required.",
            "ERR unknown command 'NOPE'",
            "BUSYKEY",
        ] {
            let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
            assert_eq!(
                RespValue::try_from(value),
                Ok(RespValue::Error(line.into()))
            );
        }
        assert!(RespValue::try_from(Value::Double(1.5)).is_err());
    }
}
