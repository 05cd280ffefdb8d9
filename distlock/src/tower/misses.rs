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
use std::time::Duration;

use distlock_core::LockKey;
use tokio::time::Instant;

/// At most this many keys remembered; past it, one is forgotten, and that job's count of
/// misses starts again (it is dead-lettered later, never sooner).
const MAX_KEYS: usize = 65_536;

/// The first missed delivery of each key, since this process last took it; where no
/// delivery count is known, the misses counted and when the last one was.
#[derive(Debug, Default)]
pub(super) struct Misses {
    first: Mutex<HashMap<LockKey, u32>>,
    counted: Mutex<HashMap<LockKey, (u32, Instant)>>,
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
    /// counted since the key was last taken, this one included (at least 1). A miss
    /// less than `spacing` after the last one counted is not counted: the queue sent
    /// the job back sooner than the layer asked (apalis-redis 1.0 does, at once), and
    /// such misses must not run the count down while a lease that is about to lapse
    /// still holds the key.
    pub(super) fn counted(&self, key: &LockKey, spacing: Duration) -> u32 {
        let mut counted = self.counted.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if let Some((count, last)) = counted.get_mut(key) {
            if now.duration_since(*last) >= spacing {
                *count = count.saturating_add(1);
                *last = now;
            }
            return *count;
        }
        make_room(&mut counted, key);
        counted.insert(key.clone(), (1, now));
        1
    }

    /// Forgets `key`'s misses: it was taken, or its job dead-lettered.
    pub(super) fn forget(&self, key: &LockKey) {
        self.first
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
        self.counted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

/// Forgets one key when `key` is new and the record is full.
fn make_room<V>(first: &mut HashMap<LockKey, V>, key: &LockKey) {
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
        let every = Duration::ZERO;
        assert_eq!(misses.counted(&key("job:1"), every), 1);
        assert_eq!(misses.counted(&key("job:1"), every), 2);
        assert_eq!(misses.counted(&key("job:2"), every), 1);
        assert_eq!(misses.counted(&key("job:1"), every), 3);
        misses.forget(&key("job:1"));
        assert_eq!(misses.counted(&key("job:1"), every), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn misses_sooner_than_the_spacing_after_the_last_counted_are_not_counted() {
        let misses = Misses::default();
        let spacing = Duration::from_millis(500);
        assert_eq!(misses.counted(&key("job:1"), spacing), 1);
        // A queue that sends the job straight back: a hundred deliveries in 100 ms.
        for _ in 0..100 {
            tokio::time::advance(Duration::from_millis(1)).await;
            assert_eq!(misses.counted(&key("job:1"), spacing), 1);
        }
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(misses.counted(&key("job:1"), spacing), 2);
        tokio::time::advance(Duration::from_millis(499)).await;
        assert_eq!(misses.counted(&key("job:1"), spacing), 2);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(misses.counted(&key("job:1"), spacing), 3);
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
