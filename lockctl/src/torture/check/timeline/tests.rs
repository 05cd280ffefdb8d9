use super::super::{Deaths, check};
use super::*;
use crate::torture::fault::deaths;

const MS: u64 = 1_000_000;

fn rec(worker: u32, incarnation: u32, event: Event) -> Record {
    Record {
        worker,
        incarnation,
        event,
    }
}

fn grant(worker: u32, key: u32, token: u64, granted: u64, valid: u64) -> Record {
    let event = Event::Grant {
        key,
        token,
        invoked: granted - MS,
        granted,
        valid,
    };
    rec(worker, 0, event)
}

fn step(worker: u32, key: u32, token: u64, checked: u64, read: u64) -> Record {
    let event = Event::Step {
        key,
        token,
        checked,
        valid: checked + 100 * MS,
        read: Some(read),
        admitted: true,
    };
    rec(worker, 0, event)
}

fn release(worker: u32, key: u32, token: u64, invoked: u64) -> [Record; 2] {
    [
        rec(
            worker,
            0,
            Event::Releasing {
                key,
                token,
                invoked,
            },
        ),
        rec(
            worker,
            0,
            Event::Release {
                key,
                token,
                invoked,
                released: Some(true),
            },
        ),
    ]
}

fn fault(at: u64, kind: FaultKind) -> Fault {
    Fault { at, kind }
}

/// Lock 0: worker 1 takes it (token 13) and is killed at 40 ms without releasing it;
/// worker 0, paused from 10 ms to 31 ms, is granted it at 32 ms (token 14), inside worker
/// 1's window. Lock 1, at the same time, clean: worker 2 (token 70), then worker 0
/// (token 71). The nemesis pauses worker 2, which never touches lock 0, twice, and
/// worker 3, which takes no lock.
fn overlap() -> (Vec<Record>, Vec<Fault>) {
    let mut records = vec![
        grant(1, 0, 13, 26 * MS, 500 * MS),
        step(1, 0, 13, 27 * MS, 4),
        grant(2, 1, 70, 28 * MS, 500 * MS),
        step(2, 1, 70, 29 * MS, 0),
    ];
    records.extend(release(2, 1, 70, 30 * MS));
    records.push(grant(0, 0, 14, 32 * MS, 600 * MS));
    records.push(step(0, 0, 14, 41 * MS, 5));
    records.extend(release(0, 0, 14, 45 * MS));
    records.push(grant(0, 1, 71, 46 * MS, 600 * MS));
    records.extend(release(0, 1, 71, 47 * MS));
    let (w0, w1, w2) = ((0, 0), (1, 0), (2, 0));
    let faults = vec![
        // Worker 3 takes no lock: paused before the lock's events and still then.
        fault(5 * MS, pause((3, 0))),
        fault(10 * MS, pause(w0)),
        fault(20 * MS, pause(w2)),
        fault(24 * MS, resume(w2)),
        fault(31 * MS, resume(w0)),
        fault(35 * MS, pause(w2)),
        // Noted once reaped, after the restart's start: out of time order.
        fault(
            40 * MS + MS / 2,
            FaultKind::Restart {
                worker: 1,
                incarnation: 1,
            },
        ),
        fault(
            40 * MS,
            FaultKind::Kill {
                worker: w1.0,
                incarnation: w1.1,
            },
        ),
        fault(44 * MS, resume(w2)),
    ];
    (records, faults)
}

fn pause((worker, incarnation): (u32, u32)) -> FaultKind {
    FaultKind::Pause {
        worker,
        incarnation,
    }
}

fn resume((worker, incarnation): (u32, u32)) -> FaultKind {
    FaultKind::Resume {
        worker,
        incarnation,
    }
}

/// The index of the one line of `text` that holds every piece.
fn line(text: &str, pieces: &[&str]) -> usize {
    let found: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| pieces.iter().all(|p| l.contains(p)))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(found.len(), 1, "{pieces:?} in\n{text}");
    found[0]
}

#[test]
fn an_overlap_prints_both_holders_events_in_order_with_the_kill_and_nothing_of_other_locks() {
    let (records, faults) = overlap();
    let (_, violations) = check(&records, &deaths(&faults), &[Some(6), Some(2)]);
    let found: Vec<(Property, u32)> = violations.iter().map(|v| (v.property, v.key)).collect();
    assert_eq!(found, [(Property::Overlap, 0)], "{violations:?}");

    let histories = histories(&records, &faults, &violations, 0);
    let text: String = histories.iter().map(|h| h.to_string()).collect();
    let expected: [&[&str]; 11] = [
        // Paused before the lock's first shown event, and still when it came.
        &["+10,000", "worker 0 process 0", "nemesis: paused"],
        &["+26,000", "worker 1 process 0", "token 13", "granted"],
        &["+27,000", "worker 1 process 0", "token 13", "wrote 5"],
        &["+31,000", "worker 0 process 0", "nemesis: resumed"],
        &["+32,000", "worker 0 process 0", "token 14", "granted"],
        &["+40,000", "worker 1 process 0", "nemesis: killed"],
        &["+40,500", "worker 1 process 1", "nemesis: started"],
        &["+41,000", "worker 0 process 0", "token 14", "wrote 6"],
        &["+45,000", "worker 0 process 0", "token 14", "releasing"],
        &["+45,000", "worker 0 process 0", "token 14", "released"],
        // The header.
        &["history of lock 0 (its 6 events"],
    ];
    let mut order: Vec<usize> = expected.iter().map(|pieces| line(&text, pieces)).collect();
    assert_eq!(order.pop(), Some(0), "{text}");
    assert!(order.is_sorted(), "{order:?} in\n{text}");
    // The later holder's grant is where the checker caught the overlap.
    assert_eq!(line(&text, &["<- overlap"]), order[4], "{text}");
    // Nothing of lock 1, nor of workers 2 and 3, which never took lock 0.
    for other in ["token 70", "token 71", "worker 2", "worker 3"] {
        assert!(!text.contains(other), "{other} in\n{text}");
    }
    assert_eq!(text.lines().count(), expected.len(), "{text}");
}

#[test]
fn a_clean_run_prints_no_history() {
    let (mut records, faults) = overlap();
    // Worker 1 released token 13 at 30 ms, before worker 0's grant.
    records.extend(release(1, 0, 13, 30 * MS));
    let (_, violations) = check(&records, &deaths(&faults), &[Some(6), Some(2)]);
    assert!(violations.is_empty(), "{violations:?}");
    assert!(histories(&records, &faults, &violations, 0).is_empty());
}

#[test]
fn a_long_history_is_cut_around_its_first_violation_and_few_locks_are_shown() {
    // On each of 5 locks, 100 holders one after another (grant, release: 200 events);
    // on each, holder 70 is granted the lock 1 ms before holder 69 releases it.
    let mut records = Vec::new();
    for key in 0..5 {
        for i in 0..100u64 {
            let at = 10 * MS * (i + 1);
            let granted = if i == 70 { at - 2 * MS } else { at };
            records.push(grant(0, key, i + 1, granted, at + 100 * MS));
            records.extend(release(0, key, i + 1, at + 9 * MS).into_iter().skip(1));
        }
    }
    let (_, violations) = check(&records, &Deaths::new(), &[]);
    assert!(
        violations.iter().all(|v| v.property == Property::Overlap),
        "{violations:?}"
    );
    let histories = histories(&records, &[], &violations, 0);
    let keys: Vec<u32> = histories.iter().map(|h| h.key).collect();
    assert_eq!(keys, [0, 1, 2]);
    let h = &histories[0];
    assert_eq!((h.events, h.shown, h.entries.len()), (200, 60, 60));
    // The overlapping grant (holder 70, token 71, at 708 ms) is the 140th event in time
    // order (holder 69's release comes at 709 ms): 30 shown before it.
    assert_eq!(h.skipped, 109, "{h}");
    let caught = h.entries.iter().position(|e| !e.caught.is_empty());
    assert_eq!(caught, Some(30), "{h}");
    assert_eq!(h.entries[30].token, Some(71), "{h}");
    assert!(
        h.to_string().contains("its events 110 to 169 of 200"),
        "{h}"
    );
}
