//! The idempotent producer (`enable.idempotence=true`, `acks=all`): retries inside one
//! producer session never duplicate or reorder a partition. It does not deduplicate across
//! process restarts — consumers' inbox does that.

use crate::KafkaConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::time::Duration;

/// Builds the producer used by the relay and the dead-letter router.
pub fn build(cfg: &KafkaConfig) -> anyhow::Result<FutureProducer> {
    Ok(cfg
        .client_config()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("message.timeout.ms", "30000")
        .set("queue.buffering.max.messages", "200000")
        .create()?)
}

/// Sends one message and awaits its delivery report.
pub async fn send(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header { key: k, value: Some(*v) });
    }
    let record = FutureRecord::to(topic).key(key).payload(payload).headers(h);
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("delivery to {topic} failed: {e}"))?;
    Ok(())
}

/// Whether the producer can reach a broker (for `/readyz`): fetches cluster metadata.
pub fn healthy(producer: &FutureProducer) -> bool {
    producer.client().fetch_metadata(None, Duration::from_millis(1500)).is_ok()
}
