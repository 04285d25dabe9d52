# The Region's data services: its member of the Aurora global cluster, its MSK cluster and
# its waiting-room Redis. All in the private subnets, encrypted with this Region's keys.

# ---- Aurora PostgreSQL -------------------------------------------------------------------

resource "aws_db_subnet_group" "this" {
  name       = local.prefix
  subnet_ids = aws_subnet.private[*].id
}

resource "aws_rds_cluster_parameter_group" "this" {
  name   = "${local.prefix}-aurora-pg"
  family = "aurora-postgresql${split(".", var.sizing.aurora_engine_version)[0]}"

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "500"
  }
  parameter {
    name  = "log_lock_waits"
    value = "1"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
}

# A global-cluster member gets no manage_master_user_password (AWS refuses it on global
# clusters): the primary takes the master password from the db-master secret's
# random_password, and a secondary has none of its own. Only the primary takes a final
# snapshot: it holds the global cluster's data.
resource "aws_rds_cluster" "this" {
  cluster_identifier                  = local.prefix
  global_cluster_identifier           = var.global_cluster_id
  engine                              = "aurora-postgresql"
  engine_version                      = var.sizing.aurora_engine_version
  database_name                       = var.aurora_primary ? var.db_name : null
  master_username                     = var.aurora_primary ? var.db_master_user : null
  master_password                     = var.aurora_primary ? var.db_master_pass : null
  db_subnet_group_name                = aws_db_subnet_group.this.name
  vpc_security_group_ids              = [aws_security_group.this["aurora"].id]
  db_cluster_parameter_group_name     = aws_rds_cluster_parameter_group.this.name
  storage_encrypted                   = true
  kms_key_id                          = aws_kms_key.this["data"].arn
  deletion_protection                 = true
  backup_retention_period             = 35
  copy_tags_to_snapshot               = true
  skip_final_snapshot                 = !var.aurora_primary
  final_snapshot_identifier           = var.aurora_primary ? "${local.prefix}-final" : null
  iam_database_authentication_enabled = true
  enabled_cloudwatch_logs_exports     = ["postgresql"]

  lifecycle {
    # Set by AWS on a secondary; changes at promotion.
    ignore_changes = [replication_source_identifier, global_cluster_identifier]
  }
}

resource "aws_rds_cluster_instance" "this" {
  count                                 = var.sizing.aurora_instances
  identifier                            = "${local.prefix}-${count.index}"
  cluster_identifier                    = aws_rds_cluster.this.id
  instance_class                        = var.sizing.aurora_instance_class
  engine                                = aws_rds_cluster.this.engine
  engine_version                        = aws_rds_cluster.this.engine_version
  db_subnet_group_name                  = aws_db_subnet_group.this.name
  availability_zone                     = local.azs[count.index % 3]
  publicly_accessible                   = false
  auto_minor_version_upgrade            = true
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.this["data"].arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 15
  monitoring_role_arn                   = aws_iam_role.rds_monitoring.arn
}

resource "aws_iam_role" "rds_monitoring" {
  name               = "${local.prefix}-rds-monitoring"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Principal = { Service = "monitoring.rds.amazonaws.com" }, Action = "sts:AssumeRole" }]
  })
}

resource "aws_iam_role_policy_attachment" "rds_monitoring" {
  role       = aws_iam_role.rds_monitoring.name
  policy_arn = "arn:aws:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

# The services' database URL: their own login role (created by migrations), not the master.
# An operator puts postgres://USER:PASSWORD@<this Region's cluster endpoint>/DB?sslmode=require.
# Replicated to the other Region under that Region's key: its tasks read the replica as
# BOXOFFICE_REGION_PEER_DATABASE_URL, even while this Region is down.
resource "aws_secretsmanager_secret" "database_url" {
  name                    = "${var.name}/${var.region_key}/database-url"
  description             = "BOXOFFICE_DATABASE_URL of the services in this Region (the other Region's BOXOFFICE_REGION_PEER_DATABASE_URL)"
  kms_key_id              = aws_kms_key.this["secrets"].arn
  recovery_window_in_days = 30

  replica {
    region     = var.peer_region
    kms_key_id = var.peer_secrets_kms_key_arn
  }
}

# ---- MSK ---------------------------------------------------------------------------------

resource "aws_msk_configuration" "this" {
  name           = local.prefix
  kafka_versions = [var.sizing.kafka_version]

  # Design §12: RF 3, acks=all with min.insync.replicas=2, no unclean leader election; topics
  # are created by `boxoffice migrate` (and by MSK Replicator in the DR cluster).
  server_properties = <<-PROPERTIES
    auto.create.topics.enable=false
    default.replication.factor=3
    min.insync.replicas=2
    unclean.leader.election.enable=false
    num.partitions=12
  PROPERTIES
}

resource "aws_cloudwatch_log_group" "msk" {
  name              = "/${var.name}/${var.region_key}/msk"
  retention_in_days = var.log_retention
  kms_key_id        = aws_kms_key.this["logs"].arn
}

resource "aws_msk_cluster" "this" {
  cluster_name           = local.prefix
  kafka_version          = var.sizing.kafka_version
  number_of_broker_nodes = var.msk_broker_count
  enhanced_monitoring    = "PER_TOPIC_PER_BROKER"

  broker_node_group_info {
    instance_type   = var.sizing.msk_instance_type
    client_subnets  = aws_subnet.private[*].id
    security_groups = [aws_security_group.this["msk"].id]

    storage_info {
      ebs_storage_info {
        volume_size = var.sizing.msk_volume_size
      }
    }

    connectivity_info {
      public_access {
        type = "DISABLED"
      }
      # Multi-VPC private connectivity with IAM: how MSK Replicator reaches a cross-Region
      # source (both Regions have it, so replication can run DR to primary for failback).
      vpc_connectivity {
        client_authentication {
          sasl {
            iam = true
          }
        }
      }
    }
  }

  # The services authenticate with SASL/SCRAM (what the binary's Kafka client speaks);
  # MSK Replicator with IAM. Nothing unauthenticated.
  client_authentication {
    unauthenticated = false
    sasl {
      scram = true
      iam   = true
    }
  }

  encryption_info {
    encryption_at_rest_kms_key_arn = aws_kms_key.this["data"].arn
    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }

  configuration_info {
    arn      = aws_msk_configuration.this.arn
    revision = aws_msk_configuration.this.latest_revision
  }

  logging_info {
    broker_logs {
      cloudwatch_logs {
        enabled   = true
        log_group = aws_cloudwatch_log_group.msk.name
      }
    }
  }
}

# Lets MSK Replicator (in the other Region) open its private connection to this cluster.
resource "aws_msk_cluster_policy" "replicator" {
  cluster_arn = aws_msk_cluster.this.arn
  policy      = jsonencode({
    Version   = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "kafka.amazonaws.com" }
      Action    = ["kafka:CreateVpcConnection", "kafka:GetBootstrapBrokers", "kafka:DescribeClusterV2"]
      Resource  = aws_msk_cluster.this.arn
    }]
  })
}

# SASL/SCRAM credentials of the services. MSK requires the AmazonMSK_ prefix and a customer
# managed key.
resource "random_password" "kafka" {
  length  = 40
  special = false
}

resource "aws_secretsmanager_secret" "kafka_scram" {
  name                    = "AmazonMSK_${var.name}_${var.region_key}"
  description             = "SASL/SCRAM user of the services on this Region's MSK cluster"
  kms_key_id              = aws_kms_key.this["secrets"].arn
  recovery_window_in_days = 30
}

resource "aws_secretsmanager_secret_version" "kafka_scram" {
  secret_id     = aws_secretsmanager_secret.kafka_scram.id
  secret_string = jsonencode({ username = var.name, password = random_password.kafka.result })
}

resource "aws_msk_scram_secret_association" "this" {
  cluster_arn     = aws_msk_cluster.this.arn
  secret_arn_list = [aws_secretsmanager_secret.kafka_scram.arn]
  depends_on      = [aws_secretsmanager_secret_version.kafka_scram]
}

# ---- ElastiCache Redis (waiting room) ----------------------------------------------------
# Per Region, not replicated: Redis is a shield, not a ledger; a failover starts with an
# empty queue and the ledger decides every seat.

resource "aws_elasticache_subnet_group" "this" {
  name       = local.prefix
  subnet_ids = aws_subnet.private[*].id
}

resource "random_password" "redis" {
  length  = 64
  special = false
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id        = local.prefix
  description                 = "boxoffice waiting room (${var.region_key})"
  engine                      = "redis"
  engine_version              = "7.1"
  node_type                   = var.sizing.redis_node_type
  port                        = 6379
  num_cache_clusters          = 3
  preferred_cache_cluster_azs = local.azs
  automatic_failover_enabled  = true
  multi_az_enabled            = true
  subnet_group_name           = aws_elasticache_subnet_group.this.name
  security_group_ids          = [aws_security_group.this["redis"].id]
  at_rest_encryption_enabled  = true
  kms_key_id                  = aws_kms_key.this["data"].arn
  transit_encryption_enabled  = true
  transit_encryption_mode     = "required"
  auth_token                  = random_password.redis.result
  auto_minor_version_upgrade  = true
  snapshot_retention_limit    = 1
}

resource "aws_secretsmanager_secret" "redis_url" {
  name                    = "${var.name}/${var.region_key}/redis-url"
  description             = "BOXOFFICE_REDIS_URL of the API in this Region"
  kms_key_id              = aws_kms_key.this["secrets"].arn
  recovery_window_in_days = 30
}

resource "aws_secretsmanager_secret_version" "redis_url" {
  secret_id     = aws_secretsmanager_secret.redis_url.id
  secret_string = "rediss://:${random_password.redis.result}@${aws_elasticache_replication_group.this.primary_endpoint_address}:6379"
}
