//! Kafka connection settings shared by the relay, consumers and topic provisioning.

/// Where the cluster is and how topics are named and sized.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// Prefix of every physical topic and consumer-group name (empty in production; tests use
    /// a unique prefix per test so they can share one broker).
    pub prefix: String,
    /// Partitions of the purchase topic. Sizing (design §12):
    /// `partitions ≥ max(peak_bytes_per_s / tested_partition_bytes_per_s, desired_parallel_consumers)`.
    pub partitions: i32,
    /// Replication factor (3 in production with `min.insync.replicas=2`; 1 on one broker).
    pub replication: i32,
    /// How consumers retry transient failures (design §8).
    pub retry: RetryPolicy,
}

/// The retry ladder of a consumer: a few quick attempts in place, then the retry topics,
/// then the dead-letter topic.
///
/// With the defaults a message is tried 3 times within about a second, once more after 5 s
/// (`ticketing.purchase.retry-5s.v1`), then every minute (`ticketing.purchase.retry-1m.v1`)
/// until 8 attempts in all, i.e. about 5 minutes before it is dead-lettered.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Attempts in place, on the main topic, before the message is handed to the 5 s topic.
    pub inline_attempts: u32,
    /// Delay of the first retry topic, ms (5,000).
    pub retry_5s_delay_ms: u64,
    /// Delay of the second retry topic, ms (60,000).
    pub retry_1m_delay_ms: u64,
    /// Attempts in all (inline + retry topics) before the dead-letter topic.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { inline_attempts: 3, retry_5s_delay_ms: 5_000, retry_1m_delay_ms: 60_000, max_attempts: 8 }
    }
}

impl KafkaConfig {
    /// Physical name of a logical topic.
    pub fn topic(&self, logical: &str) -> String {
        format!("{}{}", self.prefix, logical)
    }

    /// The logical name of a physical topic (strips the prefix).
    pub fn logical<'a>(&self, physical: &'a str) -> &'a str {
        physical.strip_prefix(&self.prefix).unwrap_or(physical)
    }

    /// Consumer group of a consumer (`{prefix}ticketing-{name}`).
    pub fn group(&self, consumer: &str) -> String {
        format!("{}ticketing-{}", self.prefix, consumer)
    }
}
