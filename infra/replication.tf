# MSK Replicator copies the purchase topics and the consumer groups' offsets from the primary
# cluster into the DR cluster (design §15). A replicator lives in its target Region. The
# source cluster has multi-VPC connectivity with IAM and a cluster policy (modules/region).

resource "aws_iam_role" "dr_replicator" {
  provider = aws.dr
  name     = "${var.name}-msk-replicator"

  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "kafka.amazonaws.com" }
      Action    = "sts:AssumeRole"
      Condition = { StringEquals = { "aws:SourceAccount" = local.account_id } }
    }]
  })
}

resource "aws_iam_role_policy" "dr_replicator" {
  provider = aws.dr
  name     = "replicate-primary-to-dr"
  role     = aws_iam_role.dr_replicator.id

  policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [
      {
        Sid    = "ReadSource"
        Effect = "Allow"
        Action = [
          "kafka-cluster:Connect", "kafka-cluster:DescribeCluster", "kafka-cluster:DescribeTopic",
          "kafka-cluster:DescribeTopicDynamicConfiguration", "kafka-cluster:ReadData",
          "kafka-cluster:DescribeGroup",
        ]
        Resource = [
          module.primary.msk_cluster_arn,
          "${module.primary.msk_topic_arn_prefix}/*",
          "${module.primary.msk_group_arn_prefix}/*",
        ]
      },
      {
        Sid    = "WriteTarget"
        Effect = "Allow"
        Action = [
          "kafka-cluster:Connect", "kafka-cluster:DescribeCluster", "kafka-cluster:AlterCluster",
          "kafka-cluster:DescribeTopic", "kafka-cluster:CreateTopic", "kafka-cluster:AlterTopic",
          "kafka-cluster:DescribeTopicDynamicConfiguration", "kafka-cluster:AlterTopicDynamicConfiguration",
          "kafka-cluster:WriteData", "kafka-cluster:WriteDataIdempotently",
          "kafka-cluster:DescribeGroup", "kafka-cluster:AlterGroup",
        ]
        Resource = [
          module.dr.msk_cluster_arn,
          "${module.dr.msk_topic_arn_prefix}/*",
          "${module.dr.msk_group_arn_prefix}/*",
        ]
      },
    ]
  })
}

resource "aws_msk_replicator" "to_dr" {
  provider                   = aws.dr
  replicator_name            = "${var.name}-primary-to-dr"
  description                = "Purchase topics and consumer offsets, primary to DR"
  service_execution_role_arn = aws_iam_role.dr_replicator.arn

  kafka_cluster {
    amazon_msk_cluster {
      msk_cluster_arn = module.primary.msk_cluster_arn
    }
    vpc_config {
      subnet_ids          = module.primary.private_subnet_ids
      security_groups_ids = [aws_security_group.replicator_source.id]
    }
  }

  kafka_cluster {
    amazon_msk_cluster {
      msk_cluster_arn = module.dr.msk_cluster_arn
    }
    vpc_config {
      subnet_ids          = module.dr.private_subnet_ids
      security_groups_ids = [aws_security_group.dr_replicator_target.id]
    }
  }

  replication_info_list {
    source_kafka_cluster_arn = module.primary.msk_cluster_arn
    target_kafka_cluster_arn = module.dr.msk_cluster_arn
    target_compression_type  = "ZSTD"

    topic_replication {
      topics_to_replicate                  = var.replicated_topics
      detect_and_copy_new_topics           = true
      copy_topic_configurations            = true
      copy_access_control_lists_for_topics = false

      starting_position {
        type = "EARLIEST"
      }

      # Same names in both Regions: after failover the services use the same topics.
      topic_name_configuration {
        type = "IDENTICAL"
      }
    }

    consumer_group_replication {
      consumer_groups_to_replicate        = var.replicated_consumer_groups
      detect_and_copy_new_consumer_groups = true
      synchronise_consumer_group_offsets  = true
    }
  }
}

# The replicator's network interfaces: a group in each VPC that reaches that Region's brokers
# on the IAM port (9098) only, and that the brokers admit.
resource "aws_security_group" "replicator_source" {
  provider    = aws.primary
  name        = "${var.name}-primary-msk-replicator"
  description = "MSK Replicator ENIs reading the primary cluster"
  vpc_id      = module.primary.vpc_id
}

resource "aws_vpc_security_group_egress_rule" "replicator_source" {
  provider                     = aws.primary
  security_group_id            = aws_security_group.replicator_source.id
  referenced_security_group_id = module.primary.msk_security_group_id
  description                  = "To the primary brokers (IAM)"
  ip_protocol                  = "tcp"
  from_port                    = 9098
  to_port                      = 9098
}

resource "aws_vpc_security_group_ingress_rule" "replicator_source" {
  provider                     = aws.primary
  security_group_id            = module.primary.msk_security_group_id
  referenced_security_group_id = aws_security_group.replicator_source.id
  description                  = "Kafka IAM over TLS from MSK Replicator"
  ip_protocol                  = "tcp"
  from_port                    = 9098
  to_port                      = 9098
}

resource "aws_security_group" "dr_replicator_target" {
  provider    = aws.dr
  name        = "${var.name}-dr-msk-replicator"
  description = "MSK Replicator ENIs writing the DR cluster"
  vpc_id      = module.dr.vpc_id
}

resource "aws_vpc_security_group_egress_rule" "dr_replicator_target" {
  provider                     = aws.dr
  security_group_id            = aws_security_group.dr_replicator_target.id
  referenced_security_group_id = module.dr.msk_security_group_id
  description                  = "To the DR brokers (IAM)"
  ip_protocol                  = "tcp"
  from_port                    = 9098
  to_port                      = 9098
}

resource "aws_vpc_security_group_ingress_rule" "dr_replicator_target" {
  provider                     = aws.dr
  security_group_id            = module.dr.msk_security_group_id
  referenced_security_group_id = aws_security_group.dr_replicator_target.id
  description                  = "Kafka IAM over TLS from MSK Replicator"
  ip_protocol                  = "tcp"
  from_port                    = 9098
  to_port                      = 9098
}
