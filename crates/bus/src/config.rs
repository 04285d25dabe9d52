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
