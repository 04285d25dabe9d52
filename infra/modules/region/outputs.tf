output "kms_key_arns" {
  description = "This Region's customer managed keys: data, secrets, logs."
  value       = { for k, key in aws_kms_key.this : k => key.arn }
}

output "private_subnet_ids" {
  description = "Private subnets, one per AZ."
  value       = aws_subnet.private[*].id
}

output "alb_dns_name" {
  description = "DNS name of the API's ALB."
  value       = aws_lb.api.dns_name
}

output "alb_zone_id" {
  description = "Hosted zone of the ALB (for Route 53 alias records)."
  value       = aws_lb.api.zone_id
}

output "global_cluster_id" {
  description = "The global cluster, available once this Region's instances exist (a secondary joins after the primary's writer)."
  value       = aws_rds_cluster.this.global_cluster_identifier
  depends_on  = [aws_rds_cluster_instance.this]
}

output "aurora_endpoint" {
  description = "Cluster (writer) endpoint; on a secondary it takes writes only after promotion."
  value       = aws_rds_cluster.this.endpoint
}

output "aurora_reader_endpoint" {
  description = "Reader endpoint (catalog and reporting reads that tolerate lag)."
  value       = aws_rds_cluster.this.reader_endpoint
}

output "msk_cluster_arn" {
  description = "MSK cluster."
  value       = aws_msk_cluster.this.arn
}

output "msk_topic_arn_prefix" {
  description = "ARN prefix of this cluster's topics (for kafka-cluster IAM actions)."
  value       = replace(aws_msk_cluster.this.arn, ":cluster/", ":topic/")
}

output "msk_group_arn_prefix" {
  description = "ARN prefix of this cluster's consumer groups (for kafka-cluster IAM actions)."
  value       = replace(aws_msk_cluster.this.arn, ":cluster/", ":group/")
}

output "kafka_bootstrap_brokers" {
  description = "SASL/SCRAM over TLS bootstrap brokers."
  value       = aws_msk_cluster.this.bootstrap_brokers_sasl_scram
}

output "vpc_id" {
  description = "The Region's VPC."
  value       = aws_vpc.this.id
}

output "msk_security_group_id" {
  description = "Security group of the MSK brokers."
  value       = aws_security_group.this["msk"].id
}

output "redis_endpoint" {
  description = "Primary endpoint of the waiting-room Redis."
  value       = aws_elasticache_replication_group.this.primary_endpoint_address
}

output "database_url_secret_arn" {
  description = "Secret to fill with the services' database URL in this Region."
  value       = aws_secretsmanager_secret.database_url.arn
}
