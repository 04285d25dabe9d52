output "api_url" {
  description = "Public URL of the API (Route 53 failover between the Regions' ALBs)."
  value       = "https://${var.api_domain_name}"
}

output "active_region" {
  description = "The Region whose DNS gate is open and whose workers run."
  value       = var.active_region == "primary" ? var.primary_region : var.dr_region
}

output "alb_dns_names" {
  description = "ALB of each Region (synthetic tests reach the DR Region here before its gate opens)."
  value       = local.alb_dns_names
}

output "aurora_global_cluster_id" {
  description = "Aurora global cluster (promote the DR member with failover-global-cluster or switchover)."
  value       = aws_rds_global_cluster.this.id
}

output "aurora_endpoints" {
  description = "Writer (cluster) and reader endpoints per Region; the DR cluster endpoint takes writes only after promotion."
  value       = {
    primary = { writer = module.primary.aurora_endpoint, reader = module.primary.aurora_reader_endpoint }
    dr      = { writer = module.dr.aurora_endpoint, reader = module.dr.aurora_reader_endpoint }
  }
}

output "kafka_bootstrap_brokers" {
  description = "SASL/SCRAM over TLS bootstrap brokers per Region."
  value       = { primary = module.primary.kafka_bootstrap_brokers, dr = module.dr.kafka_bootstrap_brokers }
}

output "msk_replicator_arn" {
  description = "MSK Replicator copying the purchase topics and consumer offsets into the DR cluster (its lag is part of the declared RPO)."
  value       = aws_msk_replicator.to_dr.arn
}

output "redis_endpoints" {
  description = "Primary endpoint of each Region's waiting-room Redis (not replicated: a failover starts with an empty queue)."
  value       = { primary = module.primary.redis_endpoint, dr = module.dr.redis_endpoint }
}

output "database_url_secret_arns" {
  description = "Per-Region secrets to fill with the services' database URL (their own login role, sslmode=require) once `boxoffice migrate` has created it."
  value       = { primary = module.primary.database_url_secret_arn, dr = module.dr.database_url_secret_arn }
}

output "app_secret_arns" {
  description = "Secrets whose values an operator puts (replicated to the DR Region)."
  value       = { for k, s in aws_secretsmanager_secret.app : k => s.arn }
}

output "db_master_secret_arn" {
  description = "Master credentials of the global cluster (replicated to the DR Region)."
  value       = aws_secretsmanager_secret.db_master.arn
}

output "witness_database_url_secret_arn" {
  description = "The region witness's URL secret (the witness lives outside both Regions), as given."
  value       = var.witness_database_url_secret_arn
}

output "region_writers" {
  description = "Per Region, what its tasks get for the region epoch (design §15): BOXOFFICE_REGION, BOXOFFICE_REGION_EPOCH, and the secrets of BOXOFFICE_WITNESS_DATABASE_URL and BOXOFFICE_REGION_PEER_DATABASE_URL (copies in that Region)."
  value       = {
    primary = {
      region                       = "primary"
      epoch                        = var.region_epochs.primary
      witness_secret_arn           = local.witness_secret_arns.primary
      peer_database_url_secret_arn = local.peer_database_url_secret_arns.primary
    }
    dr = {
      region                       = "dr"
      epoch                        = var.region_epochs.dr
      witness_secret_arn           = local.witness_secret_arns.dr
      peer_database_url_secret_arn = local.peer_database_url_secret_arns.dr
    }
  }
}

output "secrets_kms_key_arns" {
  description = "Each Region's `secrets` key: replicate the witness secret into each Region under it (or the AWS managed key); the execution roles may decrypt with it."
  value       = { primary = module.primary.kms_key_arns.secrets, dr = module.dr.kms_key_arns.secrets }
}

output "ecr_repository_url" {
  description = "Push the boxoffice image here; ECR replicates it to the DR Region."
  value       = aws_ecr_repository.boxoffice.repository_url
}
