//! Waiting for a server to be ready: [`wait_until_ready`] polls a probe, which answers a
//! [`Probe`] or anything else that is a [`ProbeOutcome`].

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::HarnessError;

/// The outcome of one readiness probe, for [`wait_until_ready`].
#[derive(Debug)]
pub enum Probe<T> {
    /// Ready, with a value.
    Ready(T),
    /// Not ready yet, with a description of why.
    NotYet(String),
    /// Will never become ready: stop waiting with this error.
    Fatal(HarnessError),
}

/// What a probe of [`wait_until_ready`] may answer: a [`Probe`], or `Result<T, String>`
/// (`Ok` ready, `Err` not ready yet, with why).
pub trait ProbeOutcome {
    /// The value a ready probe gives.
    type Value;

    /// This answer as a [`Probe`].
    fn into_probe(self) -> Probe<Self::Value>;
}

impl<T> ProbeOutcome for Probe<T> {
    type Value = T;

    fn into_probe(self) -> Probe<T> {
        self
    }
}

impl<T> ProbeOutcome for Result<T, String> {
    type Value = T;

    fn into_probe(self) -> Probe<T> {
        match self {
            Ok(v) => Probe::Ready(v),
            Err(e) => Probe::NotYet(e),
        }
    }
}

/// Polls `probe` every `interval` until it is ready, or fails with
/// [`HarnessError::NotReady`] (carrying the last probe's reason) once `timeout` has
/// passed; a probe that answers [`Probe::Fatal`] ends the wait at once with its error.
///
/// Each probe call is itself cut off at the deadline, so a probe that hangs (a paused
/// server) cannot make this wait longer than `timeout`.
pub async fn wait_until_ready<F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut probe: F,
) -> Result<<Fut::Output as ProbeOutcome>::Value, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output: ProbeOutcome>,
{
    let start = Instant::now();
    let deadline = start + timeout;
    let mut last = String::from("no probe finished");
    loop {
        match tokio::time::timeout_at(deadline, probe())
            .await
            .map(ProbeOutcome::into_probe)
        {
            Ok(Probe::Ready(v)) => return Ok(v),
            Ok(Probe::NotYet(e)) => last = e,
            Ok(Probe::Fatal(e)) => return Err(e),
            Err(_) => last = format!("the last probe was still running at the deadline ({last})"),
        }
        if Instant::now() + interval >= deadline {
            return Err(HarnessError::NotReady {
                what: what.to_string(),
                waited: start.elapsed(),
                detail: last,
            });
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wait_until_ready_times_out_with_the_last_error() {
        let started = Instant::now();
        let mut calls = 0u32;
        let err = wait_until_ready(
            "nothing",
            Duration::from_millis(300),
            Duration::from_millis(20),
            || {
                calls += 1;
                let n = calls;
                async move { Err::<(), _>(format!("attempt {n}")) }
            },
        )
        .await
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        match err {
            HarnessError::NotReady { detail, .. } => assert!(detail.starts_with("attempt ")),
            other => panic!("unexpected {other}"),
        }
        assert!(calls > 3);

        let mut n = 0;
        let v = wait_until_ready(
            "counter",
            Duration::from_secs(5),
            Duration::from_millis(1),
            || {
                n += 1;
                let n = n;
                async move {
                    if n >= 3 {
                        Ok(n)
                    } else {
                        Err("not yet".to_string())
                    }
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn a_hanging_probe_is_cut_at_the_deadline() {
        let started = Instant::now();
        let err = wait_until_ready(
            "hang",
            Duration::from_millis(200),
            Duration::from_millis(10),
            || async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok::<(), String>(())
            },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, HarnessError::NotReady { .. }));
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
