use super::*;

const MS: u64 = 1_000_000;

fn rec(worker: u32, event: Event) -> Record {
    Record {
        worker,
        incarnation: 0,
        event,
    }
}

fn grant(worker: u32, token: u64, invoked: u64, granted: u64, valid: u64) -> Record {
    rec(
        worker,
        Event::Grant {
            key: 0,
            token,
            invoked,
            granted,
            valid,
        },
    )
}

fn step(worker: u32, token: u64, checked: u64, read: u64, admitted: bool) -> Record {
    rec(
        worker,
        Event::Step {
            key: 0,
            token,
            checked,
            valid: checked + 100 * MS,
            read: Some(read),
            admitted,
        },
    )
}

fn release(worker: u32, token: u64, invoked: u64) -> Record {
    rec(
        worker,
        Event::Release {
            key: 0,
            token,
            invoked,
            released: Some(true),
        },
    )
}

/// Two holders one after the other, each writing twice; a third, stale one refused.
fn clean() -> Vec<Record> {
    vec![
        grant(0, 10, 0, MS, 500 * MS),
        step(0, 10, 2 * MS, 0, true),
        step(0, 10, 3 * MS, 1, true),
        release(0, 10, 4 * MS),
        grant(1, 11, 3 * MS, 5 * MS, 500 * MS),
        step(1, 11, 6 * MS, 2, true),
        step(1, 11, 7 * MS, 3, true),
        release(1, 11, 8 * MS),
        // Worker 0 again, with a lease that ran out while it was paused: refused.
        grant(0, 12, 9 * MS, 10 * MS, 20 * MS),
        grant(1, 13, 25 * MS, 26 * MS, 500 * MS),
        step(1, 13, 27 * MS, 4, true),
        rec(
            0,
            Event::Step {
                key: 0,
                token: 12,
                checked: 15 * MS,
                valid: 20 * MS,
                read: Some(4),
                admitted: false,
            },
        ),
        release(1, 13, 30 * MS),
    ]
}

fn properties(records: &[Record], last: u64) -> Vec<Property> {
    check(records, &Deaths::new(), &[Some(last)])
        .1
        .into_iter()
        .map(|v| v.property)
        .collect()
}

#[test]
fn a_clean_run_breaks_nothing_and_is_counted() {
    let (tally, violations) = check(&clean(), &Deaths::new(), &[Some(5)]);
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(tally.grants, 4);
    assert_eq!(tally.sections, 3);
    assert_eq!(tally.writes_admitted, 5);
    assert_eq!(tally.writes_refused, 1);
}

#[test]
fn a_lower_token_after_a_finished_grant_breaks_token_order() {
    let mut records = clean();
    records.push(grant(2, 11, 40 * MS, 41 * MS, 42 * MS));
    let found = properties(&records, 5);
    assert!(found.contains(&Property::TokenOrder), "{found:?}");
}

#[test]
fn a_grant_inside_anothers_validity_is_an_overlap() {
    let mut records = clean();
    // Token 13 is valid to 500 ms and released at 30 ms; this one comes at 29.
    records.push(grant(2, 14, 28 * MS, 29 * MS, 600 * MS));
    let found = properties(&records, 5);
    assert_eq!(found, vec![Property::Overlap], "{found:?}");
}

#[test]
fn a_window_ends_at_the_release_not_at_the_validity() {
    let mut records = clean();
    records.push(grant(2, 14, 30 * MS, 31 * MS, 600 * MS));
    assert!(properties(&records, 5).is_empty());
}

#[test]
fn a_release_that_failed_ends_the_window_and_counts_as_no_section() {
    let mut records = clean();
    // Token 13's release failed (the store restarting): the store may have freed the key.
    let last = records.pop().unwrap();
    records.push(rec(
        last.worker,
        Event::Release {
            key: 0,
            token: 13,
            invoked: 30 * MS,
            released: None,
        },
    ));
    // The same worker takes the key again at once.
    records.push(grant(1, 14, 30 * MS, 31 * MS, 600 * MS));
    let (tally, violations) = check(&records, &Deaths::new(), &[Some(5)]);
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!((tally.sections, tally.releases_not_held), (2, 0));
}

#[test]
fn a_holder_killed_after_it_sent_its_release_holds_nothing_from_the_release_on() {
    let mut records = clean();
    // Token 13's holder (worker 1) says at 30 ms that it releases, and is killed at 40 ms
    // before it can report the outcome. The store carried the release out: worker 0 is
    // granted the key at 32 ms.
    let last = records.pop().unwrap();
    records.push(rec(
        last.worker,
        Event::Releasing {
            key: 0,
            token: 13,
            invoked: 30 * MS,
        },
    ));
    records.push(grant(0, 14, 31 * MS, 32 * MS, 600 * MS));
    let mut deaths = Deaths::new();
    deaths.insert((1, 0), 40 * MS);
    let (tally, violations) = check(&records, &deaths, &[Some(5)]);
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!((tally.sections, tally.releases_not_held), (2, 0));
}

#[test]
fn two_admitted_writes_of_one_read_are_a_lost_update() {
    let mut records = clean();
    records.push(step(1, 13, 28 * MS, 4, true));
    let found = properties(&records, 5);
    assert!(found.contains(&Property::LostUpdate), "{found:?}");
}

#[test]
fn an_older_token_admitted_after_a_newer_one_is_a_stale_write() {
    let mut records = clean();
    // Token 12 (stale) admitted writing count 6, after token 13 wrote count 5.
    records.push(rec(
        0,
        Event::Step {
            key: 0,
            token: 12,
            checked: 16 * MS,
            valid: 20 * MS,
            read: Some(5),
            admitted: true,
        },
    ));
    let found = properties(&records, 6);
    assert!(found.contains(&Property::StaleWriteAdmitted), "{found:?}");
}

#[test]
fn a_ledger_behind_its_admitted_writes_lost_an_update() {
    let found = properties(&clean(), 4);
    assert_eq!(found, vec![Property::LostUpdate], "{found:?}");
}

#[test]
fn a_step_after_a_newer_grant_is_a_step_after_loss() {
    let mut records = clean();
    // Token 12's holder takes a step at 27 ms, after token 13 was granted at 26 ms.
    records.push(rec(
        0,
        Event::Step {
            key: 0,
            token: 12,
            checked: 27 * MS,
            valid: 40 * MS,
            read: None,
            admitted: false,
        },
    ));
    let found = properties(&records, 5);
    assert!(found.contains(&Property::StepAfterLoss), "{found:?}");
}

#[test]
fn a_killed_holder_holds_nothing_after_its_death() {
    let mut records = clean();
    // Token 13 (worker 1, process 0) is valid to 500 ms; its process is killed at 28 ms
    // and a store that frees dead sessions' locks grants the lock at 29 ms.
    records.push(grant(2, 14, 28 * MS, 29 * MS, 600 * MS));
    let deaths = Deaths::from([((1, 0), 28 * MS)]);
    let (_, violations) = check(&records, &deaths, &[Some(5)]);
    assert!(violations.is_empty(), "{violations:?}");
    let deaths = Deaths::from([((1, 0), 30 * MS)]);
    let (_, violations) = check(&records, &deaths, &[Some(5)]);
    assert_eq!(violations.len(), 1, "{violations:?}");
}

#[test]
fn a_grant_whose_reply_came_after_its_validity_overlaps_nothing() {
    let mut records = clean();
    // Asked for at 1 ms, valid to 20 ms, but its holder was stopped until 29 ms, inside
    // token 13's window (26 ms to 30 ms).
    records.push(grant(2, 9, MS, 29 * MS, 20 * MS));
    let found = properties(&records, 5);
    assert!(!found.contains(&Property::Overlap), "{found:?}");
}
