//! Kafka connection settings shared by the relay, consumers, topic provisioning, the
//! dead-letter tools and the release controller's lag probe. Every client is built from
//! [`KafkaConfig::client_config`], so the cluster's security settings (TLS, SASL) reach the
//! producer and every consumer alike: a fact on the bus moves money. The SASL password is a
//! [`SecretString`] (`Debug` redacts it) and only leaves it for librdkafka's configuration.

use rdkafka::ClientConfig;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

/// Where the cluster is and how topics are named and sized.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// How clients authenticate and encrypt (default: plaintext, no authentication).
    pub security: KafkaSecurity,
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
    /// The region epoch this process writes at (design §15): a fact stamped with an older
    /// epoch is applied only when it is inside this ledger's cut
    /// ([`crate::consumer::handle_once_at`]). `None`: no check (one region).
    pub writer_epoch: Option<i64>,
    /// The region and purchase cell of this deployment, on every consumer and relay span
    /// (design §16).
    pub labels: boxoffice_trace::Labels,
}

/// librdkafka's `security.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecurityProtocol {
    /// No TLS, no authentication.
    Plaintext,
    /// TLS (server verified against `ssl_ca_location` or the system's CAs).
    Ssl,
    /// SASL without TLS: credentials and facts cross the network in the clear.
    SaslPlaintext,
    /// SASL over TLS.
    SaslSsl,
}

impl SecurityProtocol {
    /// librdkafka's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Ssl => "ssl",
            Self::SaslPlaintext => "sasl_plaintext",
            Self::SaslSsl => "sasl_ssl",
        }
    }

    /// Whether clients authenticate with SASL.
    pub fn is_sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }

    /// Whether the connection is TLS.
    pub fn is_tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }
}

/// librdkafka's `sasl.mechanism` (username and password mechanisms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SaslMechanism {
    /// The password itself is sent: only over TLS.
    #[serde(rename = "PLAIN")]
    Plain,
    /// SCRAM with SHA-256.
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// SCRAM with SHA-512.
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    /// librdkafka's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// Client security of every Kafka client (`None` fields leave librdkafka's defaults).
#[derive(Debug, Clone, Default)]
pub struct KafkaSecurity {
    /// `security.protocol`.
    pub protocol: Option<SecurityProtocol>,
    /// `sasl.mechanism`.
    pub sasl_mechanism: Option<SaslMechanism>,
    /// `sasl.username`.
    pub sasl_username: Option<String>,
    /// `sasl.password` (secret).
    pub sasl_password: Option<SecretString>,
    /// `ssl.ca.location`: PEM file of the CAs that sign the brokers' certificates (default:
    /// the system's).
    pub ssl_ca_location: Option<String>,
}

impl KafkaSecurity {
    /// Sets these properties on `c`.
    pub fn apply(&self, c: &mut ClientConfig) {
        if let Some(p) = self.protocol {
            c.set("security.protocol", p.as_str());
        }
        if let Some(m) = self.sasl_mechanism {
            c.set("sasl.mechanism", m.as_str());
        }
        if let Some(u) = &self.sasl_username {
            c.set("sasl.username", u);
        }
        if let Some(p) = &self.sasl_password {
            c.set("sasl.password", p.expose_secret());
        }
        if let Some(ca) = &self.ssl_ca_location {
            c.set("ssl.ca.location", ca);
        }
    }
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
    /// A client configuration with the bootstrap servers and the security settings; callers
    /// add their role's own properties.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        self.security.apply(&mut c);
        c
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::consumer::BaseConsumer;
    use rdkafka::producer::FutureProducer;

    fn secured() -> KafkaConfig {
        KafkaConfig {
            brokers: "127.0.0.1:1".into(),
            security: KafkaSecurity {
                protocol: Some(SecurityProtocol::SaslSsl),
                sasl_mechanism: Some(SaslMechanism::ScramSha512),
                sasl_username: Some("boxoffice".into()),
                sasl_password: Some("kafka-password-not-for-logs".into()),
                ssl_ca_location: None,
            },
            prefix: String::new(),
            partitions: 1,
            replication: 1,
            retry: RetryPolicy::default(),
            writer_epoch: None,
            labels: boxoffice_trace::Labels::default(),
        }
    }

    /// The client is built with TLS and SCRAM support, the properties reach librdkafka, and
    /// `Debug` never shows the password.
    #[tokio::test]
    async fn security_settings_reach_every_client_and_the_password_stays_secret() {
        let cfg = secured();
        let c = cfg.client_config();
        assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(c.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(c.get("sasl.username"), Some("boxoffice"));
        assert_eq!(c.get("sasl.password"), Some("kafka-password-not-for-logs"));
        let _: FutureProducer = crate::producer::build(&cfg).expect("producer with sasl_ssl + SCRAM");
        let _: BaseConsumer =
            c.clone().set("group.id", "g").create().expect("consumer with sasl_ssl + SCRAM");
        let ca = KafkaConfig {
            security: KafkaSecurity {
                protocol: Some(SecurityProtocol::Ssl),
                ssl_ca_location: Some("probe".into()),
                ..KafkaSecurity::default()
            },
            ..cfg.clone()
        };
        assert_eq!(ca.client_config().get("ssl.ca.location"), Some("probe"));
        assert!(!format!("{cfg:?}").contains("kafka-password-not-for-logs"));
        assert!(KafkaConfig { security: KafkaSecurity::default(), ..cfg }
            .client_config()
            .get("security.protocol")
            .is_none());
    }
}
