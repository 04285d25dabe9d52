//! The dead-letter topic as an operator sees it: list what is there and re-inject it into
//! its source topic once the fault is fixed. Replays are safe because every consumer
//! deduplicates on the envelope's event id in its inbox (invariant 4): a letter that some
//! consumer did apply meanwhile is a no-op there.

use crate::KafkaConfig;
use boxoffice_domain::Topic;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use std::time::{Duration, Instant};

/// One dead letter: where it sits in the dead-letter topic, its key (the order id) and the
/// record the consumer runner wrote (consumer, error code, source coordinates, original).
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// `partition:offset` in the dead-letter topic; what `dlq replay --id` takes.
    pub id: String,
    /// Message key (the order id).
    pub key: String,
    /// The record.
    pub record: serde_json::Value,
}

/// Reads every dead letter currently in the topic (from the beginning up to the high
/// watermark of each partition), without joining a group or committing anything.
pub async fn list(cfg: &KafkaConfig, timeout: Duration) -> anyhow::Result<Vec<DeadLetter>> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || list_blocking(&cfg, timeout)).await?
}

/// Messages in the dead-letter topic: the sum over its partitions of high − low watermark
/// (one metadata and one watermark request per partition, no message read). Dead letters
/// are never deleted by a replay, so this is what [`list`] would return until retention
/// drops the oldest; the idempotent producer writes no control records, so the offsets
/// count messages. A reader of its own, never a group member.
pub async fn depth(cfg: &KafkaConfig, timeout: Duration) -> anyhow::Result<i64> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || {
        let topic = cfg.topic(Topic::DeadLetter.name());
        let consumer: BaseConsumer = cfg
            .client_config()
            .set("group.id", format!("{}ticketing-dlq-reader", cfg.prefix))
            .set("enable.auto.commit", "false")
            .create()?;
        let metadata = consumer.fetch_metadata(Some(&topic), timeout)?;
        let mut depth = 0;
        for p in metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())) {
            let (low, high) = consumer.fetch_watermarks(&topic, p, timeout)?;
            depth += (high - low).max(0);
        }
        Ok(depth)
    })
    .await?
}

fn list_blocking(cfg: &KafkaConfig, timeout: Duration) -> anyhow::Result<Vec<DeadLetter>> {
    let topic = cfg.topic(Topic::DeadLetter.name());
    let consumer: BaseConsumer = cfg
        .client_config()
        .set("group.id", format!("{}ticketing-dlq-reader", cfg.prefix))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let metadata = consumer.fetch_metadata(Some(&topic), timeout)?;
    let partitions: Vec<i32> =
        metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
    let mut tpl = TopicPartitionList::new();
    let mut remaining = std::collections::HashMap::new();
    for p in partitions {
        let (low, high) = consumer.fetch_watermarks(&topic, p, timeout)?;
        if high > low {
            tpl.add_partition_offset(&topic, p, Offset::Beginning)?;
            remaining.insert(p, high);
        }
    }
    let mut letters = Vec::new();
    if remaining.is_empty() {
        return Ok(letters);
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    while !remaining.is_empty() {
        anyhow::ensure!(Instant::now() < deadline, "timed out reading the dead-letter topic");
        let Some(m) = consumer.poll(Duration::from_millis(200)) else { continue };
        let m = m?;
        if let Some(high) = remaining.get(&m.partition()) {
            if m.offset() + 1 >= *high {
                remaining.remove(&m.partition());
            }
        }
        letters.push(DeadLetter {
            id: format!("{}:{}", m.partition(), m.offset()),
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default(),
            record: m
                .payload()
                .and_then(|p| serde_json::from_slice(p).ok())
                .unwrap_or(serde_json::Value::Null),
        });
    }
    letters.sort_by_key(|l| {
        let (p, o) = l.id.split_once(':').unwrap_or(("0", "0"));
        (p.parse::<i32>().unwrap_or(0), o.parse::<i64>().unwrap_or(0))
    });
    Ok(letters)
}

/// Publishes each letter's original message back to its source topic with its original key,
/// awaiting every delivery report. Returns how many were re-injected; letters without an
/// original payload are skipped with a warning.
pub async fn replay(
    cfg: &KafkaConfig,
    producer: &FutureProducer,
    letters: &[DeadLetter],
) -> anyhow::Result<usize> {
    let mut n = 0;
    for l in letters {
        let (Some(original), Some(source)) =
            (l.record["original"].as_str(), l.record["source_topic"].as_str())
        else {
            tracing::warn!(dlq.id = %l.id, "dead letter has no original message to replay");
            continue;
        };
        let topic = cfg.topic(source);
        crate::producer::send(producer, &topic, &l.key, original.as_bytes(), &[("replayed-from", &l.id)])
            .await?;
        n += 1;
    }
    Ok(n)
}
