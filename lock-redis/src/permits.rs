//! A semaphore's permit index (see `scripts/permits.lua`): which `acquire_any` calls it
//! serves, and its Redis keys.
//!
//! A semaphore asks for its slots from slot 0 here (the backend declares
//! `Capabilities::permit_index`), or from a random one onwards, wrapping to slot 0, where it
//! does not (a user the server refuses the index), and, for `k` permits, asks again for
//! the slots after the one it was granted. Such a list is a
//! [`PermitRun`]: one semaphore's slots `first..=last`, then, optionally, `0..=wrapped`.
//! The index script takes the first free slot of that run in that order, which is what
//! `acquire_any` promises, without the list being sent or each key read. Any other list of
//! keys goes to `acquire_any.lua`.

use std::time::Duration;

use distlock_core::{LockKey, OwnerId};

use crate::keys::{LockKeys, Mark};

/// One semaphore's permit slots, in the order a call asks for them: `first..=last`, then
/// `0..=wrapped` if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PermitRun {
    /// The semaphore's name: its slot `i` is the key `<semaphore>:permit:<i>`.
    pub(crate) semaphore: String,
    /// The semaphore's index (the bitmap); its due set and waiters' flag are named after it.
    pub(crate) index: String,
    /// What every slot key starts with, `<prefix>:{<name>}:permit:`.
    pub(crate) slots: String,
    pub(crate) first: u32,
    pub(crate) last: u32,
    pub(crate) wrapped: Option<u32>,
}

impl PermitRun {
    /// The run `keys` make, or `None` when they are not one semaphore's slots in such an
    /// order (or fewer than two).
    pub(crate) fn of(prefix: &str, keys: &[LockKey]) -> Option<Self> {
        let (name, first) = keys.first()?.permit_slot()?;
        if keys.len() < 2 {
            return None;
        }
        // What each slot's name starts with, `<name>:permit:`: the rest is its number.
        let stem = &keys[0].as_str()[..name.len() + ":permit:".len()];
        let first = slot_number(first)?;
        let (mut last, mut wrapped) = (first, None);
        for key in &keys[1..] {
            let slot = slot_number(key.as_str().strip_prefix(stem)?)?;
            match wrapped {
                None if slot == last.checked_add(1)? => last = slot,
                None if slot == 0 && first > 0 => wrapped = Some(0),
                Some(w) if slot == w + 1 && slot < first => wrapped = Some(slot),
                _ => return None,
            }
        }
        let (index, slots) = names(prefix, name)?;
        Some(Self {
            semaphore: name.to_owned(),
            index,
            slots,
            first,
            last,
            wrapped,
        })
    }

    /// How many slots the run asks for.
    pub(crate) fn len(&self) -> usize {
        (self.last - self.first) as usize + 1 + self.wrapped.map_or(0, |w| w as usize + 1)
    }

    /// Where slot `slot` is in the list the run was made from, if it is in the run.
    pub(crate) fn position(&self, slot: u32) -> Option<usize> {
        if (self.first..=self.last).contains(&slot) {
            Some((slot - self.first) as usize)
        } else {
            let w = self.wrapped?;
            (slot <= w).then(|| (self.last - self.first) as usize + 1 + slot as usize)
        }
    }

    /// The key of slot `slot`, when the run asks for it.
    pub(crate) fn slot_key(&self, slot: u32) -> Option<LockKey> {
        self.position(slot)?;
        LockKey::new(format!("{}:permit:{slot}", self.semaphore)).ok()
    }

    /// The index's keys, as the scripts take them: the bitmap, its due set, its waiters'
    /// flag.
    pub(crate) fn keys(&self) -> Vec<String> {
        vec![
            self.index.clone(),
            format!("{}:due", self.index),
            format!("{}:waited", self.index),
        ]
    }

    /// `acquire_permit.lua`'s six arguments of one attempt over this run, by `owner` for
    /// `ttl`, marking as `mark` says.
    pub(crate) fn attempt_args(&self, owner: OwnerId, ttl: Duration, mark: Mark) -> [Vec<u8>; 6] {
        [
            owner.to_string().into_bytes(),
            ttl.as_millis().to_string().into_bytes(),
            vec![mark.arg()],
            self.first.to_string().into_bytes(),
            self.last.to_string().into_bytes(),
            self.wrapped
                .map_or_else(|| "-1".to_owned(), |w| w.to_string())
                .into_bytes(),
        ]
    }
}

/// The index keys of the semaphore whose permit slot `key` is (the bitmap, its due set,
/// its waiters' flag), or `None` for any other key: what a purge of the slot deletes with
/// it (the index is rebuilt from the slot keys as attempts meet them).
pub(crate) fn index_keys(prefix: &str, key: &LockKey) -> Option<[String; 3]> {
    let (name, slot) = key.permit_slot()?;
    slot_number(slot)?;
    let (index, _) = names(prefix, name)?;
    Some([format!("{index}:due"), format!("{index}:waited"), index])
}

/// The index of semaphore `name` and what its slot keys start with, as `LockKeys` names
/// a slot: `<prefix>:{<name>}:permits` and `<prefix>:{<name>}:permit:`.
fn names(prefix: &str, name: &str) -> Option<(String, String)> {
    let slot0 = LockKeys::new(prefix, &LockKey::new(format!("{name}:permit:0")).ok()?).lock;
    let slots = slot0.strip_suffix('0')?.to_owned();
    let index = format!("{}s", slots.strip_suffix(':')?);
    Some((index, slots))
}

/// A slot's number, when written canonically (`07` is not slot 7: it is a key of its own,
/// which the index does not cover).
fn slot_number(slot: &str) -> Option<u32> {
    let digits = !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_digit());
    if !digits || (slot.len() > 1 && slot.starts_with('0')) {
        return None;
    }
    slot.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(slots: &[&str]) -> Option<PermitRun> {
        let keys: Vec<LockKey> = slots.iter().map(|s| LockKey::new(*s).unwrap()).collect();
        PermitRun::of("distlock", &keys)
    }

    fn of(name: &str, slots: impl IntoIterator<Item = u32>) -> Option<PermitRun> {
        let keys: Vec<LockKey> = slots
            .into_iter()
            .map(|i| LockKey::new(format!("{name}:permit:{i}")).unwrap())
            .collect();
        PermitRun::of("distlock", &keys)
    }

    #[test]
    fn a_semaphores_slots_from_any_one_onwards_are_a_run() {
        let r = of("exports", (5..8).chain(0..5)).unwrap();
        assert_eq!((r.first, r.last, r.wrapped), (5, 7, Some(4)));
        assert_eq!(r.index, "distlock:{exports}:permits");
        assert_eq!(r.slots, "distlock:{exports}:permit:");
        assert_eq!(r.len(), 8);
        for (at, slot) in (5..8).chain(0..5).enumerate() {
            assert_eq!(r.position(slot), Some(at), "slot {slot}");
        }
        assert_eq!(r.position(8), None);
        assert_eq!(
            r.slot_key(6),
            Some(LockKey::new("exports:permit:6").unwrap())
        );
        assert_eq!(r.slot_key(8), None);
        // From slot 0, and what is left after a grant (k permits): no wrap.
        let r = of("exports", 0..8).unwrap();
        assert_eq!((r.first, r.last, r.wrapped), (0, 7, None));
        let r = of("exports", (6..8).chain(0..2)).unwrap();
        assert_eq!((r.first, r.last, r.wrapped), (6, 7, Some(1)));
        assert_eq!(r.position(5), None);
        let r = of("exports", 2..5).unwrap();
        assert_eq!((r.first, r.last, r.wrapped, r.len()), (2, 4, None, 3));
    }

    #[test]
    fn anything_else_is_not_a_run() {
        // Fewer than two, gaps, repeats, another order, two semaphores, a plain key.
        assert_eq!(of("s", [0]), None);
        assert_eq!(of("s", [0, 2]), None);
        assert_eq!(of("s", [1, 0, 1]), None);
        assert_eq!(of("s", [2, 1]), None);
        assert_eq!(of("s", [2, 3, 0, 1, 2]), None);
        assert_eq!(of("s", [0, 1, 0]), None);
        assert_eq!(run(&["s:permit:0", "t:permit:1"]), None);
        assert_eq!(run(&["s:permit:0", "s"]), None);
        assert_eq!(run(&["s", "s:permit:0"]), None);
        // `07` is a key of its own, not slot 7.
        assert_eq!(run(&["s:permit:06", "s:permit:07"]), None);
        assert_eq!(run(&["s:permit:6", "s:permit:07"]), None);
        // Another semaphore whose name ends like a slot, a sign, a longer name.
        assert_eq!(run(&["s:permit:0", "s:permit:1:permit:2"]), None);
        assert_eq!(run(&["s:permit:0", "s:permit:+1"]), None);
        assert_eq!(run(&["s:permit:0", "xs:permit:1"]), None);
        assert_eq!(
            run(&["a:permit:1:permit:0", "a:permit:1:permit:1"]).map(|r| r.last),
            Some(1)
        );
    }

    #[test]
    fn its_keys_are_the_slot_keys_layout_with_the_index_beside_them() {
        // The slot keys the script builds are the ones `LockKeys` names.
        let keys: Vec<LockKey> = (0..3)
            .map(|i| LockKey::new(format!("a}}b:permit:{i}")).unwrap())
            .collect();
        let r = PermitRun::of("p", &keys).unwrap();
        let slot2 = LockKeys::new("p", &keys[2]).lock;
        assert_eq!(format!("{}2", r.slots), slot2);
        assert_eq!(r.index, "p:{a%7Db}:permits");
        assert_eq!(
            r.keys(),
            [
                "p:{a%7Db}:permits",
                "p:{a%7Db}:permits:due",
                "p:{a%7Db}:permits:waited",
            ]
        );
    }
}
