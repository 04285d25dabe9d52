//! Topic provisioning. Topics are created explicitly (by `boxoffice migrate` or
//! `boxoffice topics create`) with the configured partition count — never by broker
//! auto-create, which would give them the broker's default size.
//!
//! Sizing (design §12): `partitions ≥ max(peak topic bytes/s ÷ tested bytes/s per partition,
//! parallel consumer members)` — the consumer term decides for this workload (see
//! `kafka_partitions` in the boxoffice configuration); retention needs `events/s × average
//! bytes × retention s × replication factor` of broker storage, and consumers' inboxes keep
//! their rows longer than the topics keep messages (`inbox_retention_s`), so anything that
//! can still be replayed is still deduplicated.

use crate::KafkaConfig;
use boxoffice_domain::Topic;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use std::time::Duration;

/// Creates every topic of [`Topic::ALL`] that does not exist yet; existing topics are left
/// as they are. Returns the physical names created.
pub async fn create_all(cfg: &KafkaConfig) -> anyhow::Result<Vec<String>> {
    let admin: AdminClient<DefaultClientContext> = cfg.client_config().create()?;
    let names: Vec<String> = Topic::ALL.iter().map(|t| cfg.topic(t.name())).collect();
    let new: Vec<NewTopic> = names
        .iter()
        .map(|n| NewTopic::new(n, cfg.partitions, TopicReplication::Fixed(cfg.replication)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let mut created = Vec::new();
    for r in admin.create_topics(&new, &opts).await? {
        match r {
            Ok(name) => created.push(name),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    Ok(created)
}
