//! The checker on hand-built histories: a clean one passes, and each broken invariant
//! is reported as itself.

use super::*;

const MS: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_millis(100);

/// Builds events at chosen instants (milliseconds after a fixed origin).
struct Builder {
    origin: Instant,
    key: LockKey,
    events: Vec<Event>,
}

impl Builder {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            key: LockKey::new("k").unwrap(),
            events: Vec::new(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.origin + MS * ms as u32
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        op: Op,
        lease: Option<(OwnerId, u64)>,
        invoked: u64,
        completed: u64,
        valid_until: Option<u64>,
        reply: Reply,
    ) -> &mut Self {
        let event = Event {
            seq: self.events.len() as u64,
            op,
            key: self.key.clone(),
            owner: lease.map(|l| l.0),
            token: lease.map(|l| FencingToken(l.1)),
            ttl: Some(TTL),
            invoked: self.at(invoked),
            completed: self.at(completed),
            valid_until: valid_until.map(|v| self.at(v)),
            reply,
        };
        self.events.push(event);
        self
    }

    /// A grant invoked at `at`, completed 1 ms later, valid for 90 ms from `at`.
    fn grant(&mut self, lease: (OwnerId, u64), at: u64) -> &mut Self {
        self.push(
            Op::Acquire,
            Some(lease),
            at,
            at + 1,
            Some(at + 90),
            Reply::Granted,
        )
    }

    fn op(&mut self, op: Op, lease: (OwnerId, u64), at: u64, reply: Reply) -> &mut Self {
        self.push(op, Some(lease), at, at + 1, None, reply)
    }

    fn write(&mut self, token: u64, at: u64, reply: Reply) -> &mut Self {
        self.push(Op::Write, None, at, at, None, reply)
            .events
            .last_mut()
            .unwrap()
            .token = Some(FencingToken(token));
        self
    }

    fn check(&self) -> Vec<Violation> {
        check(&self.events, &CheckOptions::default())
    }
}

fn only(violations: &[Violation], invariant: Invariant) {
    assert!(
        !violations.is_empty() && violations.iter().all(|v| v.invariant == invariant),
        "expected only {invariant} violations, got {violations:#?}"
    );
}

#[test]
fn a_clean_history_passes() {
    let (a, b) = (OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .write(1, 5, Reply::Admitted { read: 0, wrote: 1 })
        .op(Op::Fence, (a, 1), 10, Reply::Current)
        .push(Op::Renew, Some((a, 1)), 30, 31, Some(120), Reply::Renewed)
        .op(Op::Fence, (a, 1), 100, Reply::Current)
        .op(Op::Release, (a, 1), 110, Reply::Released)
        .push(Op::Acquire, None, 111, 112, None, Reply::Busy)
        .grant((b, 2), 115)
        .write(2, 120, Reply::Admitted { read: 1, wrote: 2 })
        .write(
            1,
            121,
            Reply::Rejected {
                latest: FencingToken(2),
            },
        )
        .op(Op::Release, (a, 1), 122, Reply::NotHeld)
        .op(Op::Renew, (a, 1), 123, Reply::Lost)
        .op(
            Op::Fence,
            (a, 1),
            124,
            Reply::Stale {
                current: FencingToken(2),
            },
        )
        .op(Op::Release, (b, 2), 150, Reply::Released);
    assert_eq!(h.check(), vec![]);
}

#[test]
fn i1_duplicate_and_decreasing_tokens_are_reported() {
    let (a, b, c) = (OwnerId::random(), OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.grant((a, 5), 0)
        .op(Op::Release, (a, 5), 10, Reply::Released)
        .grant((b, 5), 20)
        .op(Op::Release, (b, 5), 30, Reply::Released)
        .grant((c, 4), 40);
    let v = h.check();
    only(&v, Invariant::I1);
    assert!(
        v.iter().any(|v| v.message.contains("granted twice")),
        "{v:#?}"
    );
    assert!(v.iter().any(|v| v.message.contains("went down")), "{v:#?}");
}

#[test]
fn concurrent_grants_are_not_ordered_by_i1() {
    // Overlapping calls may complete in either order; only their windows matter.
    let (a, b) = (OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.push(Op::Acquire, Some((a, 2)), 0, 10, Some(5), Reply::Granted)
        .push(Op::Acquire, Some((b, 1)), 1, 2, Some(1), Reply::Granted);
    assert!(h.check().iter().all(|v| v.invariant != Invariant::I1));
}

#[test]
fn i2_stale_admission_and_lost_update_are_reported() {
    let mut h = Builder::new();
    h.write(3, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
        2,
        1,
        Reply::Admitted { read: 1, wrote: 2 },
    );
    only(&h.check(), Invariant::I2);

    let mut h = Builder::new();
    h.write(1, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
        2,
        1,
        Reply::Admitted { read: 0, wrote: 1 },
    );
    let v = h.check();
    only(&v, Invariant::I2);
    assert!(v[0].message.contains("lost update"), "{v:#?}");

    let mut h = Builder::new();
    h.write(1, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
        1,
        1,
        Reply::Rejected {
            latest: FencingToken(1),
        },
    );
    only(&h.check(), Invariant::I2);
}

#[test]
fn i3_overlapping_windows_are_reported() {
    let (a, b) = (OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.grant((a, 1), 0).grant((b, 2), 50);
    let v = h.check();
    only(&v, Invariant::I3);
    assert!(v[0].message.contains("overlap"), "{v:#?}");
    // The same history is acceptable when faults were injected.
    let faults = CheckOptions {
        faults: true,
        ..CheckOptions::default()
    };
    assert_eq!(check(&h.events, &faults), vec![]);
}

#[test]
fn i3_validity_beyond_reply_plus_ttl_is_reported() {
    let a = OwnerId::random();
    let mut h = Builder::new();
    h.push(Op::Acquire, Some((a, 1)), 0, 1, Some(150), Reply::Granted);
    let v = h.check();
    only(&v, Invariant::I3);
    assert!(
        v[0].message.contains("past its reply plus the TTL"),
        "{v:#?}"
    );
}

#[test]
fn i4_a_lost_lease_released_or_renewed_is_reported() {
    let (a, b) = (OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .grant((b, 2), 200)
        .op(Op::Release, (a, 1), 210, Reply::Released);
    only(&h.check(), Invariant::I4);

    let mut h = Builder::new();
    h.grant((a, 1), 0).grant((b, 2), 200).push(
        Op::Renew,
        Some((a, 1)),
        210,
        211,
        Some(300),
        Reply::Renewed,
    );
    assert!(h.check().iter().any(|v| v.invariant == Invariant::I4));
}

#[test]
fn i4_a_release_by_a_non_owner_is_reported() {
    let (a, forged) = (OwnerId::random(), OwnerId::random());
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .op(Op::Release, (forged, 1), 10, Reply::Released);
    let v = h.check();
    only(&v, Invariant::I4);
    assert!(v[0].message.contains("nobody was granted"), "{v:#?}");
}

#[test]
fn i4_a_disturbed_holder_is_reported() {
    // The holder's fence check fails while its window lasts: someone freed its key.
    let a = OwnerId::random();
    let mut h = Builder::new();
    h.grant((a, 1), 0).op(
        Op::Fence,
        (a, 1),
        40,
        Reply::Stale {
            current: FencingToken(1),
        },
    );
    only(&h.check(), Invariant::I4);
}

#[test]
fn i5_resurrection_and_lost_token_after_renewal_are_reported() {
    let a = OwnerId::random();
    // Renewed 300 ms after a 100 ms lease was granted: resurrected.
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .push(Op::Renew, Some((a, 1)), 300, 301, Some(390), Reply::Renewed);
    let v = h.check();
    only(&v, Invariant::I5);
    assert!(v[0].message.contains("resurrected"), "{v:#?}");

    // A renewal succeeded, then the fence inside the renewed window says stale.
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .push(Op::Renew, Some((a, 1)), 50, 51, Some(140), Reply::Renewed)
        .op(
            Op::Fence,
            (a, 1),
            120,
            Reply::Stale {
                current: FencingToken(1),
            },
        );
    only(&h.check(), Invariant::I5);

    // A renewal after a successful release brings the lease back.
    let mut h = Builder::new();
    h.grant((a, 1), 0)
        .op(Op::Release, (a, 1), 10, Reply::Released)
        .push(Op::Renew, Some((a, 1)), 20, 21, Some(110), Reply::Renewed);
    assert!(h.check().iter().any(|v| v.invariant == Invariant::I5));
}

#[test]
fn i5_a_renewal_that_shortens_validity_is_reported() {
    let a = OwnerId::random();
    let mut h = Builder::new();
    h.grant((a, 1), 10)
        .push(Op::Renew, Some((a, 1)), 20, 21, Some(50), Reply::Renewed);
    let v = h.check();
    only(&v, Invariant::I5);
    assert!(v[0].message.contains("shortened"), "{v:#?}");
}

/// Grants of three slots of a semaphore, each released 50 ms after it was taken:
/// `overlapping` puts the third inside the other two's windows, else after the first
/// was released.
fn permits_history(overlapping: bool) -> Vec<Event> {
    let mut h = Builder::new();
    let third = if overlapping { 20 } else { 60 };
    for (slot, at) in [(0, 0), (1, 10), (2, third)] {
        h.key = LockKey::new(format!("sem:permit:{slot}")).unwrap();
        let owner = OwnerId::random();
        h.grant((owner, 1), at)
            .op(Op::Release, (owner, 1), at + 50, Reply::Released);
    }
    h.events
}

#[test]
fn i6_more_permits_at_once_than_the_semaphore_has_are_reported() {
    let options = |permits| CheckOptions {
        semaphores: vec![SemaphoreSpec {
            name: LockKey::new("sem").unwrap(),
            permits,
        }],
        ..CheckOptions::default()
    };
    only(&check(&permits_history(true), &options(2)), Invariant::I6);
    assert_eq!(check(&permits_history(true), &options(3)), vec![]);
    assert_eq!(check(&permits_history(false), &options(2)), vec![]);
}
