//! The payment ledger the jobs write to: the side effect that must happen once per job.
//!
//! It records every payment it is asked to apply, so a job paid twice shows up as a
//! duplicate. [`Ledger::apply_once`] records an idempotency key in the same critical
//! section as the payment, as a database would in one transaction: a repeat of the key
//! applies nothing.

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;

/// What the ledger did with a payment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The payment was recorded.
    Recorded,
    /// The idempotency key was seen before: nothing was recorded.
    Repeat,
}

/// An in-memory payment ledger.
#[derive(Debug, Default)]
pub struct Ledger {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Payments recorded per job: (count, amount of one payment).
    paid: HashMap<u32, (u64, u64)>,
    idempotency_keys: HashSet<String>,
}

impl Ledger {
    /// Records a payment for `job`, whatever was recorded before.
    pub fn apply(&self, job: u32, amount_cents: u64) -> Applied {
        let mut state = self.state.lock();
        let entry = state.paid.entry(job).or_insert((0, amount_cents));
        entry.0 += 1;
        Applied::Recorded
    }

    /// Records a payment for `job` unless `idempotency_key` was recorded before; the key
    /// and the payment are recorded together.
    pub fn apply_once(&self, idempotency_key: &str, job: u32, amount_cents: u64) -> Applied {
        let mut state = self.state.lock();
        if !state.idempotency_keys.insert(idempotency_key.to_owned()) {
            return Applied::Repeat;
        }
        let entry = state.paid.entry(job).or_insert((0, amount_cents));
        entry.0 += 1;
        Applied::Recorded
    }

    /// Totals over the jobs `0..jobs`.
    pub fn summary(&self, jobs: u32) -> LedgerSummary {
        let state = self.state.lock();
        let mut summary = LedgerSummary::default();
        for job in 0..jobs {
            match state.paid.get(&job) {
                None => summary.unpaid_jobs += 1,
                Some(&(count, amount)) => {
                    summary.payments += count;
                    summary.duplicate_payments += count - 1;
                    summary.overpaid_cents += (count - 1) * amount;
                }
            }
        }
        summary
    }
}

/// What the ledger holds at the end of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerSummary {
    /// Payments recorded.
    pub payments: u64,
    /// Payments beyond the first for a job: duplicate side effects.
    pub duplicate_payments: u64,
    /// The money paid out by duplicate payments.
    pub overpaid_cents: u64,
    /// Jobs never paid.
    pub unpaid_jobs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_paid_twice_is_a_duplicate() {
        let ledger = Ledger::default();
        ledger.apply(0, 500);
        ledger.apply(0, 500);
        ledger.apply(1, 200);
        let summary = ledger.summary(3);
        assert_eq!(summary.payments, 3);
        assert_eq!(summary.duplicate_payments, 1);
        assert_eq!(summary.overpaid_cents, 500);
        assert_eq!(summary.unpaid_jobs, 1);
    }

    #[test]
    fn a_repeated_idempotency_key_applies_nothing() {
        let ledger = Ledger::default();
        assert_eq!(ledger.apply_once("payment:0", 0, 500), Applied::Recorded);
        assert_eq!(ledger.apply_once("payment:0", 0, 500), Applied::Repeat);
        assert_eq!(ledger.summary(1).duplicate_payments, 0);
    }
}
