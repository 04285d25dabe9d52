//! An embedded Kafka-protocol broker (librdkafka's mock cluster) for single-process runs such
//! as the default `boxoffice onsale`: real protocol on real loopback sockets, no install, but
//! nothing survives the process. Tests and anything that restarts processes use a real
//! broker instead.

use crate::KafkaConfig;
use boxoffice_domain::Topic;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

/// A running in-process cluster; dropping it stops the brokers.
pub struct EmbeddedBroker {
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl EmbeddedBroker {
    /// Starts `brokers` mock brokers on loopback.
    pub fn start(brokers: i32) -> anyhow::Result<Self> {
        Ok(Self { cluster: MockCluster::new(brokers)? })
    }

    /// Bootstrap servers of the cluster.
    pub fn bootstrap_servers(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Creates every topic (the mock cluster does not implement CreateTopics over the wire);
    /// topics that exist already are left alone.
    pub fn create_topics(&self, cfg: &KafkaConfig) -> anyhow::Result<()> {
        for t in Topic::ALL {
            match self.cluster.create_topic(&cfg.topic(t.name()), cfg.partitions, 1) {
                Err(e)
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists) => {}
                other => other?,
            }
        }
        Ok(())
    }
}
