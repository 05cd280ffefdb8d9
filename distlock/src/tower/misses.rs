//! [`Misses`]: how many deliveries of a job in a row have found its key held, for
//! [`LockLayer::dead_letter_after`](super::LockLayer::dead_letter_after), whose docs state
//! the rule.
//!
//! The layer learns one number from a job, its delivery count, which also grows with every
//! delivery on which the job ran and failed for its own reasons: so the layer remembers,
//! per key, the delivery on which this process first found the key held since it last
//! took it, and counts the misses from there.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use distlock_core::LockKey;

/// At most this many keys remembered; past it, one is forgotten, and that job's count of
/// misses starts again (it is dead-lettered later, never sooner).
const MAX_KEYS: usize = 65_536;

/// The first missed delivery of each key, since this process last took it.
#[derive(Debug, Default)]
pub(super) struct Misses {
    first: Mutex<HashMap<LockKey, u32>>,
}

impl Misses {
    /// Records that delivery `delivery` found `key` held; returns the misses counted,
    /// this one included (at least 1).
    pub(super) fn missed(&self, key: &LockKey, delivery: u32) -> u32 {
        let mut first = self.first.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&since) = first.get(key)
            && since <= delivery
        {
            return (delivery - since).saturating_add(1);
        }
        make_room(&mut first, key);
        first.insert(key.clone(), delivery);
        1
    }

    /// Records a miss of `key` where no delivery count is known; returns the misses
    /// counted since the key was last taken, this one included (at least 1).
    pub(super) fn counted(&self, key: &LockKey) -> u32 {
        let mut first = self.first.lock().unwrap_or_else(PoisonError::into_inner);
        make_room(&mut first, key);
        let count = first.entry(key.clone()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    /// Forgets `key`'s misses: it was taken, or its job dead-lettered.
    pub(super) fn forget(&self, key: &LockKey) {
        self.first
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

/// Forgets one key when `key` is new and the record is full.
fn make_room(first: &mut HashMap<LockKey, u32>, key: &LockKey) {
    if first.contains_key(key) || first.len() < MAX_KEYS {
        return;
    }
    let any = first.keys().next().cloned();
    if let Some(any) = any {
        first.remove(&any);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    #[test]
    fn misses_count_from_the_first_missed_delivery() {
        let misses = Misses::default();
        assert_eq!(misses.missed(&key("job:1"), 20), 1);
        assert_eq!(misses.missed(&key("job:1"), 21), 2);
        assert_eq!(misses.missed(&key("job:1"), 24), 5);
        assert_eq!(misses.missed(&key("job:2"), 7), 1);
    }

    #[test]
    fn misses_counted_without_deliveries_start_again_once_forgotten() {
        let misses = Misses::default();
        assert_eq!(misses.counted(&key("job:1")), 1);
        assert_eq!(misses.counted(&key("job:1")), 2);
        assert_eq!(misses.counted(&key("job:2")), 1);
        assert_eq!(misses.counted(&key("job:1")), 3);
        misses.forget(&key("job:1"));
        assert_eq!(misses.counted(&key("job:1")), 1);
    }

    #[test]
    fn taking_the_key_or_a_lower_delivery_starts_the_count_again() {
        let misses = Misses::default();
        misses.missed(&key("job:1"), 3);
        misses.forget(&key("job:1"));
        assert_eq!(misses.missed(&key("job:1"), 9), 1);
        assert_eq!(misses.missed(&key("job:1"), 2), 1);
        assert_eq!(misses.missed(&key("job:1"), 3), 2);
    }
}
