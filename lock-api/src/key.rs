//! Lock names, fencing tokens and owner ids: the validated values every backend shares.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::LockError;

/// The longest key, in bytes, that any backend accepts.
pub const MAX_KEY_BYTES: usize = 512;

/// The name of a lock: 1 to 512 bytes of UTF-8 without control characters.
///
/// Cheap to clone. Backends namespace it (a prefix, a hash tag) themselves.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// Validates a lock name.
    ///
    /// ```
    /// use distlock::{LockError, LockKey};
    /// assert!(LockKey::new("payout:42").is_ok());
    /// assert!(matches!(LockKey::new(""), Err(LockError::InvalidKey { .. })));
    /// ```
    pub fn new(name: impl AsRef<str>) -> Result<Self, LockError> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(invalid_key("the key is empty"));
        }
        if name.len() > MAX_KEY_BYTES {
            return Err(invalid_key(format!(
                "the key is {} bytes long, the limit is {MAX_KEY_BYTES}",
                name.len()
            )));
        }
        if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
            return Err(invalid_key(format!(
                "the key contains the control character {c:?} at byte {at}"
            )));
        }
        Ok(Self(name.into()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// For a name of the form `<name>:permit:<digits>`, a permit slot of the
    /// [`Semaphore`](crate::Semaphore) called `<name>`: that name and the slot's digits as
    /// written. `None` for any other name.
    ///
    /// A store may keep a semaphore's slots together by it: the Redis backend puts every
    /// slot of one semaphore in the hash slot of the semaphore's name, so that on a Redis
    /// Cluster one script call can take any of them.
    ///
    /// ```
    /// use distlock_core::LockKey;
    ///
    /// let slot = LockKey::new("exports:tenant-7:permit:3")?;
    /// assert_eq!(slot.permit_slot(), Some(("exports:tenant-7", "3")));
    /// assert_eq!(LockKey::new("exports:permit:x")?.permit_slot(), None);
    /// # Ok::<(), distlock_core::LockError>(())
    /// ```
    pub fn permit_slot(&self) -> Option<(&str, &str)> {
        self.0.rsplit_once(":permit:").filter(|(name, slot)| {
            !name.is_empty() && !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_digit())
        })
    }
}

fn invalid_key(reason: impl Into<String>) -> LockError {
    LockError::InvalidKey {
        reason: reason.into(),
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::str::FromStr for LockKey {
    type Err = LockError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl Serialize for LockKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for LockKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::new(s).map_err(serde::de::Error::custom)
    }
}

/// A fencing token: strictly increasing per key across every grant of that key.
///
/// Attach it to every write a lock holder makes; the downstream store rejects a token
/// lower than the highest it has seen (see [`crate::FencedResource`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token `value`, as a store or a downstream column gave it back.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The token as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for FencingToken {
    fn from(value: u64) -> Self {
        Self(value)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> Self {
        token.0
    }
}

/// For a signed 64-bit column (PostgreSQL `bigint`): every token a distlock store grants
/// fits (they are at most microseconds since 1970 plus a count), and one that does not is
/// an error, never a wrapped negative number.
///
/// ```
/// use distlock::FencingToken;
///
/// let column = i64::try_from(FencingToken::new(1_764_000_000_000_000)).unwrap();
/// assert_eq!(FencingToken::try_from(column).unwrap().get(), 1_764_000_000_000_000);
/// assert!(i64::try_from(FencingToken::new(u64::MAX)).is_err());
/// assert!(FencingToken::try_from(-1_i64).is_err());
/// ```
impl TryFrom<FencingToken> for i64 {
    type Error = std::num::TryFromIntError;

    fn try_from(token: FencingToken) -> Result<Self, Self::Error> {
        i64::try_from(token.0)
    }
}

/// From a signed 64-bit column; a negative value is an error.
impl TryFrom<i64> for FencingToken {
    type Error = std::num::TryFromIntError;

    fn try_from(value: i64) -> Result<Self, Self::Error> {
        u64::try_from(value).map(Self)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The owner of one acquisition: 128 random bits from the operating system's
/// cryptographic generator, fresh for every acquisition attempt, never per process.
///
/// Only the holder of the exact owner id can renew or release a lease, so an owner id
/// must be unguessable. It prints as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OwnerId(u128);

impl OwnerId {
    /// A fresh random owner id.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// An owner id from its 128 bits, as stored by a backend.
    pub fn from_u128(bits: u128) -> Self {
        Self(bits)
    }

    /// The 128 bits.
    pub fn as_u128(self) -> u128 {
        self.0
    }

    /// Parses the 32-hex-digit form printed by `Display`.
    pub fn parse(s: &str) -> Result<Self, LockError> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LockError::Config(
                "an owner id is 32 hexadecimal digits".into(),
            ));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|e| LockError::Config(format!("invalid owner id: {e}")))
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated() {
        assert!(matches!(
            LockKey::new(""),
            Err(LockError::InvalidKey { .. })
        ));
        assert!(LockKey::new("a".repeat(MAX_KEY_BYTES)).is_ok());
        assert!(matches!(
            LockKey::new("a".repeat(MAX_KEY_BYTES + 1)),
            Err(LockError::InvalidKey { .. })
        ));
        assert!(matches!(
            LockKey::new("job\n1"),
            Err(LockError::InvalidKey { .. })
        ));
        assert!(matches!(
            LockKey::new("job\u{7f}"),
            Err(LockError::InvalidKey { .. })
        ));
        let odd = LockKey::new("job {x} ünïcödé 例").unwrap();
        assert_eq!(odd.as_str(), "job {x} ünïcödé 例");
    }

    #[test]
    fn a_multibyte_key_is_measured_in_bytes() {
        // 171 three-byte characters = 513 bytes: too long although only 171 chars.
        assert!(LockKey::new("例".repeat(171)).is_err());
        assert!(LockKey::new("例".repeat(170)).is_ok());
    }

    #[test]
    fn owner_ids_are_fresh_and_round_trip() {
        let a = OwnerId::random();
        let b = OwnerId::random();
        assert_ne!(a, b);
        assert_eq!(a.to_string().len(), 32);
        assert_eq!(OwnerId::parse(&a.to_string()).unwrap(), a);
        assert!(OwnerId::parse("xyz").is_err());
    }

    #[test]
    fn deserializing_a_key_validates_it() {
        let bad: Result<LockKey, _> = serde_json_like("\"\"");
        assert!(bad.is_err());
    }

    // A minimal JSON string reader so the test needs no extra dependency.
    fn serde_json_like(s: &str) -> Result<LockKey, serde::de::value::Error> {
        use serde::de::IntoDeserializer;
        let inner = s.trim_matches('"').to_string();
        LockKey::deserialize(inner.into_deserializer())
    }
}
