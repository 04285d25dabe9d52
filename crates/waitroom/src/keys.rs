//! Redis key names. Everything lives under one configurable prefix, so deployments (and
//! tests running in parallel) sharing a Redis never see each other's keys. The event's keys
//! share the hash tag `{event}`.

use uuid::Uuid;

/// The key names, under a prefix.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    prefix: String,
}

/// The eight keys every event script takes, in `KEYS[1..8]` order.
pub(crate) struct EventKeys(pub [String; 8]);

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self { prefix: format!("{prefix}wr:") }
    }

    pub fn event(&self, event: Uuid) -> EventKeys {
        let p = &self.prefix;
        let k = |s: &str| format!("{p}e:{{{event}}}:{s}");
        EventKeys([
            k("meta"),
            k("q"),
            k("pre"),
            k("hb"),
            k("adm"),
            k("users"),
            self.events(),
            self.lapse_clock(),
        ])
    }

    /// The lapse clock: the last sweeping script's time and the pauses (see `scripts`).
    pub fn lapse_clock(&self) -> String {
        format!("{}lapse-clock", self.prefix)
    }

    /// Events that have a queue, for the release controller.
    pub fn events(&self) -> String {
        format!("{}events", self.prefix)
    }

    pub fn ticket(&self, ticket: Uuid) -> String {
        format!("{}t:{ticket}", self.prefix)
    }

    pub fn user(&self, user: Uuid) -> String {
        format!("{}u:{user}", self.prefix)
    }

    /// A user's running admission slots in every event (for the per-user limit).
    pub fn user_slots(&self, user: Uuid) -> String {
        format!("{}us:{user}", self.prefix)
    }

    pub fn revoked(&self, jti: Uuid) -> String {
        format!("{}rv:{jti}", self.prefix)
    }

    /// Present while the revocation set holds every unexpired revocation of the ledger.
    pub fn revocations_seeded(&self) -> String {
        format!("{}rv-seeded", self.prefix)
    }

    /// The token of the revocation seed in progress.
    pub fn revocations_seeding(&self) -> String {
        format!("{}rv-seeding", self.prefix)
    }

    /// One second's count of `name` for `event` (the operator's activity counters).
    pub fn counter(&self, event: Uuid, name: &str, unix_s: i64) -> String {
        format!("{}e:{{{event}}}:n:{name}:{unix_s}", self.prefix)
    }

    pub fn bucket(&self, scope: &str, id: &str) -> String {
        format!("{}rl:{scope}:{id}", self.prefix)
    }
}
