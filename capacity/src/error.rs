//! [`BenchError`]: the one error of a measurement run, keeping its source.

/// Everything that can stop a benchmark run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A server the run starts or drives itself failed (the `benchmarks` crate starts its
    /// servers from the test harness; `lockctl bench` measures deployments it is given).
    #[error("starting a server: {0}")]
    Server(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A distlock backend failed.
    #[error("{subject}: {source}")]
    Lock {
        /// The subject that failed.
        subject: &'static str,
        /// The backend's error.
        #[source]
        source: distlock_core::LockError,
    },
    /// A raw client (baseline or peer) failed.
    #[error("{subject}: {detail}")]
    Client {
        /// The subject that failed.
        subject: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// A measurement saw something that cannot happen when the subject works (an
    /// uncontended acquire that was refused, a batch that took fewer keys than asked).
    #[error("{subject}: {detail}")]
    Unexpected {
        /// The subject.
        subject: &'static str,
        /// What was seen.
        detail: String,
    },
    /// Writing the report failed.
    #[error("writing {path}: {detail}")]
    Output {
        /// The file being written.
        path: String,
        /// What went wrong.
        detail: String,
    },
}

impl BenchError {
    /// A failure of a server the run started itself (the test harness's error, for one).
    pub fn server(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        BenchError::Server(e.into())
    }

    /// A raw-client failure of `subject`.
    pub fn client(subject: &'static str, e: impl std::fmt::Display) -> Self {
        BenchError::Client {
            subject,
            detail: e.to_string(),
        }
    }
}
