# One ECS service per role of `boxoffice serve --roles ROLE` on Fargate, in the private
# subnets without public IPs. Only the API sits behind the ALB.

locals {
  kafka_roles = ["api", "relay", "saga", "payments", "tickets"]

  # The secrets each role uses. The production check of `boxoffice serve` is not role-aware
  # yet: it refuses to start any role while stripe_secret_key, stripe_webhook_secret or
  # admission_private_key has its built-in value, so every role also gets these three. Drop
  # them from the roles that do not use them once the check is per role.
  startup_secrets = ["stripe_secret_key", "stripe_webhook_secret", "admission_private_key"]
  role_secrets    = {
    api      = ["database_url", "redis_url", "kafka"] # + webhook secret, admission key
    relay    = ["database_url", "kafka"]
    saga     = ["database_url", "kafka"]
    payments = ["database_url", "kafka"] # + Stripe key
    tickets  = ["database_url", "kafka"]
    expiry   = ["database_url"]
  }

  # Region epoch and witness (design §15), in every role: each process renews a lease at the
  # witness for (REGION, REGION_EPOCH) and the ledger refuses its writes without one. The
  # peer database is the other Region's ledger, for `boxoffice region fence` run as a task
  # from any role's task definition.
  region_secrets = ["witness_database_url", "region_peer_database_url"]
  region_env     = {
    REGION       = var.region_key
    REGION_EPOCH = tostring(var.region_epoch)
  }

  # The witness secret and the other Region's database-url are both copies in this Region
  # (the witness secret's own or its replica; the peer's replica): no task depends on the
  # other Region to start.
  secret_arns = merge(var.app_secret_arns, {
    database_url             = aws_secretsmanager_secret.database_url.arn
    redis_url                = aws_secretsmanager_secret.redis_url.arn
    kafka                    = aws_secretsmanager_secret.kafka_scram.arn
    witness_database_url     = var.witness_database_url_secret_arn
    region_peer_database_url = var.peer_database_url_secret_arn
  })

  # Environment variable (after BOXOFFICE_) and valueFrom of each secret.
  secret_env = {
    database_url             = { DATABASE_URL = local.secret_arns.database_url }
    redis_url                = { REDIS_URL = local.secret_arns.redis_url }
    kafka                    = { KAFKA_SASL_USERNAME = "${local.secret_arns.kafka}:username::", KAFKA_SASL_PASSWORD = "${local.secret_arns.kafka}:password::" }
    stripe_secret_key        = { STRIPE_SECRET_KEY = local.secret_arns.stripe_secret_key }
    stripe_webhook_secret    = { STRIPE_WEBHOOK_SECRET = local.secret_arns.stripe_webhook_secret }
    admission_private_key    = { ADMISSION_PRIVATE_KEY = local.secret_arns.admission_private_key }
    witness_database_url     = { WITNESS_DATABASE_URL = local.secret_arns.witness_database_url }
    region_peer_database_url = { REGION_PEER_DATABASE_URL = local.secret_arns.region_peer_database_url }
  }

  # Kafka settings of the roles that use a broker (SASL/SCRAM over TLS).
  kafka_env = {
    KAFKA_BROKERS           = aws_msk_cluster.this.bootstrap_brokers_sasl_scram
    KAFKA_SECURITY_PROTOCOL = "sasl_ssl"
    KAFKA_SASL_MECHANISM    = "SCRAM-SHA-512"
    KAFKA_REPLICATION       = "3"
  }

  roles = {
    for role, s in var.services : role => {
      cpu     = s.cpu
      memory  = s.memory
      count   = var.desired_counts[role]
      secrets = distinct(concat(local.role_secrets[role], local.region_secrets, local.startup_secrets))
      env     = tomap(merge(var.app_settings, local.region_env, contains(local.kafka_roles, role) ? local.kafka_env : {}))
    }
  }
}

resource "aws_ecs_cluster" "this" {
  name = local.prefix

  setting {
    name  = "containerInsights"
    value = "enhanced"
  }
}

resource "aws_cloudwatch_log_group" "service" {
  for_each          = local.roles
  name              = "/${var.name}/${var.region_key}/${each.key}"
  retention_in_days = var.log_retention
  kms_key_id        = aws_kms_key.this["logs"].arn
}

resource "aws_ecs_task_definition" "role" {
  for_each                 = local.roles
  family                   = "${local.prefix}-${each.key}"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = each.value.cpu
  memory                   = each.value.memory
  execution_role_arn       = aws_iam_role.execution[each.key].arn
  task_role_arn            = aws_iam_role.task[each.key].arn

  runtime_platform {
    operating_system_family = "LINUX"
    cpu_architecture        = "X86_64"
  }

  container_definitions = jsonencode([{
    name                   = each.key
    image                  = var.image
    command                = ["serve", "--roles", each.key]
    essential              = true
    readonlyRootFilesystem = true
    stopTimeout            = 60 # SIGTERM drains in-flight work first
    portMappings           = each.key == "api" ? [{ containerPort = 8080, protocol = "tcp" }] : []
    environment            = [for k, v in each.value.env : { name = "BOXOFFICE_${k}", value = v }]
    secrets                = flatten([
      for s in each.value.secrets : [for k, from in local.secret_env[s] : { name = "BOXOFFICE_${k}", valueFrom = from }]
    ])
    logConfiguration = {
      logDriver = "awslogs"
      options   = {
        awslogs-group         = aws_cloudwatch_log_group.service[each.key].name
        awslogs-region        = local.region
        awslogs-stream-prefix = each.key
      }
    }
  }])
}

resource "aws_ecs_service" "role" {
  for_each                           = local.roles
  name                               = each.key
  cluster                            = aws_ecs_cluster.this.id
  task_definition                    = aws_ecs_task_definition.role[each.key].arn
  desired_count                      = each.value.count
  launch_type                        = "FARGATE"
  platform_version                   = "LATEST"
  availability_zone_rebalancing      = "ENABLED"
  deployment_minimum_healthy_percent = 100
  deployment_maximum_percent         = 200
  enable_execute_command             = false
  propagate_tags                     = "SERVICE"
  health_check_grace_period_seconds  = each.key == "api" ? 30 : null

  deployment_circuit_breaker {
    enable   = true
    rollback = true
  }

  network_configuration {
    assign_public_ip = false
    subnets          = aws_subnet.private[*].id
    security_groups  = [each.key == "api" ? aws_security_group.this["api"].id : aws_security_group.this["worker"].id]
  }

  dynamic "load_balancer" {
    for_each = each.key == "api" ? [aws_lb_target_group.api.arn] : []
    content {
      target_group_arn = load_balancer.value
      container_name   = "api"
      container_port   = 8080
    }
  }

  depends_on = [aws_lb_listener.https]
}

# Execution role per role: pull the image, write its own log group, read its own secrets
# (the witness's and the other Region's database-url among them, both copies in this Region,
# under this Region's `secrets` key or, for the witness, the AWS managed key).
resource "aws_iam_role" "execution" {
  for_each           = local.roles
  name               = "${local.prefix}-${each.key}-execution"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ecs-tasks.amazonaws.com" }
      Action    = "sts:AssumeRole"
      Condition = { StringEquals = { "aws:SourceAccount" = local.account_id } }
    }]
  })
}

resource "aws_iam_role_policy" "execution" {
  for_each = local.roles
  name     = "start-${each.key}"
  role     = aws_iam_role.execution[each.key].id
  policy   = jsonencode({
    Version   = "2012-10-17"
    Statement = [
      {
        Sid      = "EcrAuth" # GetAuthorizationToken has no resource to scope to
        Effect   = "Allow"
        Action   = "ecr:GetAuthorizationToken"
        Resource = "*"
      },
      {
        Sid      = "PullImage"
        Effect   = "Allow"
        Action   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
        Resource = "arn:aws:ecr:${local.region}:${local.account_id}:repository/${var.image_repository}"
      },
      {
        Sid      = "WriteLogs"
        Effect   = "Allow"
        Action   = ["logs:CreateLogStream", "logs:PutLogEvents"]
        Resource = "${aws_cloudwatch_log_group.service[each.key].arn}:*"
      },
      {
        Sid      = "ReadOwnSecrets"
        Effect   = "Allow"
        Action   = "secretsmanager:GetSecretValue"
        Resource = [for s in each.value.secrets : local.secret_arns[s]]
      },
      {
        Sid       = "DecryptSecrets"
        Effect    = "Allow"
        Action    = "kms:Decrypt"
        Resource  = aws_kms_key.this["secrets"].arn
        Condition = { StringEquals = { "kms:ViaService" = "secretsmanager.${local.region}.amazonaws.com" } }
      },
    ]
  })
}

# Task role per role: the binary calls no AWS API, so it carries no policy at all.
resource "aws_iam_role" "task" {
  for_each           = local.roles
  name               = "${local.prefix}-${each.key}-task"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ecs-tasks.amazonaws.com" }
      Action    = "sts:AssumeRole"
      Condition = { StringEquals = { "aws:SourceAccount" = local.account_id } }
    }]
  })
}
