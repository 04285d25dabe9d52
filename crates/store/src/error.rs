//! Storage errors and the one place that decides which of them are worth retrying, now
//! ([`is_retryable`]) or once the server is less busy ([`is_overload`]).

/// A storage failure. `Db` keeps the sqlx error as its source.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database answered with an error or could not be reached.
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// A stored value could not be read back (a bug or a manual edit).
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// A status write the domain's transition table does not list; nothing was written.
    #[error(transparent)]
    IllegalTransition(#[from] IllegalTransition),
}

/// A refused status move: a bug or a stale fact, never applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("illegal {aggregate} transition {from} -> {to}")]
pub struct IllegalTransition {
    /// `order`, `hold` or `payment`.
    pub aggregate: &'static str,
    /// The stored status.
    pub from: String,
    /// The requested status.
    pub to: String,
}

impl IllegalTransition {
    /// An order move `from → to`.
    pub fn order(from: boxoffice_domain::OrderStatus, to: boxoffice_domain::OrderStatus) -> Self {
        Self { aggregate: "order", from: from.to_string(), to: to.to_string() }
    }

    /// A hold move `from → to`.
    pub fn hold(from: boxoffice_domain::HoldStatus, to: boxoffice_domain::HoldStatus) -> Self {
        Self { aggregate: "hold", from: from.to_string(), to: to.to_string() }
    }

    /// A payment mirror move `from → to`.
    pub fn payment(
        from: &boxoffice_domain::PaymentIntentStatus,
        to: &boxoffice_domain::PaymentIntentStatus,
    ) -> Self {
        Self { aggregate: "payment", from: from.to_string(), to: to.to_string() }
    }
}

impl StoreError {
    /// Whether repeating the whole transaction may succeed (serialization failure, deadlock,
    /// lost connection, pool exhaustion).
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Db(e) => is_retryable(e),
            StoreError::Corrupt(_) | StoreError::IllegalTransition(_) => false,
        }
    }
}

/// SQLSTATE 40001 (serialization_failure), 40P01 (deadlock_detected), 55P03
/// (lock_not_available), 57P01 (admin_shutdown), class 08 (connection) and pool/IO errors
/// are transient; so are the region fence's refusals ([`crate::region::refusal`]): the write
/// belongs to another region now, and a message must never be dead-lettered for it.
/// Constraint violations and the rest are not.
pub fn is_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            matches!(code.as_ref(), "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03")
                || code.starts_with("08")
                || code.starts_with("BXF")
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        _ => false,
    }
}

/// SQLSTATE 57014 (query_canceled: the session's `statement_timeout` passed, or an operator
/// cancelled the statement) and class 53 (insufficient resources: too many connections, out
/// of memory, disk full): the server gave the statement up for want of time or room, and
/// its transaction, if one was open, can only roll back. The same work may succeed once the
/// server is less busy, so a consumer retries it later (on the retry topics, not in place;
/// dead-lettered only once its attempts are spent) and the API answers 503 `unavailable`
/// with a jittered `Retry-After`. Repeating it at once only adds to the load, so
/// [`is_retryable`] (repeat the transaction now) leaves it out.
pub fn is_overload(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            code == "57014" || code.starts_with("53")
        }
        _ => false,
    }
}

/// The name of the violated constraint, if `e` is a unique/check violation.
pub fn constraint(e: &sqlx::Error) -> Option<&str> {
    match e {
        sqlx::Error::Database(db) => db.constraint(),
        _ => None,
    }
}
