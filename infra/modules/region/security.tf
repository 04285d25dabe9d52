# One security group per kind of endpoint; every rule names its peer group (or the internet,
# for the ALB's listeners and the tasks' HTTPS egress). MSK Replicator's groups are in the
# root module, beside the replicator.

locals {
  security_groups = {
    alb    = "Public ALB in front of the API"
    api    = "API tasks"
    worker = "Worker tasks (relay, saga, payments, tickets, expiry)"
    aurora = "Aurora PostgreSQL"
    msk    = "MSK brokers"
    redis  = "ElastiCache Redis (waiting room)"
  }

  # name = [group, peer group or CIDR, port, description]
  ingress_rules = {
    alb_https    = ["alb", "0.0.0.0/0", 443, "HTTPS from buyers and Stripe webhooks"]
    alb_http     = ["alb", "0.0.0.0/0", 80, "HTTP, answered with a redirect to HTTPS"]
    api_from_alb = ["api", "alb", 8080, "API port from the ALB only"]
    pg_api       = ["aurora", "api", 5432, "PostgreSQL from the API"]
    pg_worker    = ["aurora", "worker", 5432, "PostgreSQL from the workers"]
    kafka_api    = ["msk", "api", 9096, "Kafka SASL/SCRAM over TLS from the API"]
    kafka_worker = ["msk", "worker", 9096, "Kafka SASL/SCRAM over TLS from the workers"]
    redis_api    = ["redis", "api", 6379, "Redis over TLS from the API"]
  }

  egress_rules = {
    alb_to_api   = ["alb", "api", 8080, "To the API tasks"]
    api_https    = ["api", "0.0.0.0/0", 443, "HTTPS: identity provider JWKS, ECR, Secrets Manager, CloudWatch"]
    api_pg       = ["api", "aurora", 5432, "To Aurora"]
    api_kafka    = ["api", "msk", 9096, "To MSK"]
    api_redis    = ["api", "redis", 6379, "To Redis"]
    worker_https = ["worker", "0.0.0.0/0", 443, "HTTPS: Stripe, ECR, Secrets Manager, CloudWatch"]
    worker_pg    = ["worker", "aurora", 5432, "To Aurora"]
    worker_kafka = ["worker", "msk", 9096, "To MSK"]
  }
}

resource "aws_security_group" "this" {
  for_each    = local.security_groups
  name        = "${local.prefix}-${each.key}"
  description = each.value
  vpc_id      = aws_vpc.this.id

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "this" {
  for_each                     = local.ingress_rules
  security_group_id            = aws_security_group.this[each.value[0]].id
  description                  = each.value[3]
  ip_protocol                  = "tcp"
  from_port                    = each.value[2]
  to_port                      = each.value[2]
  cidr_ipv4                    = can(cidrhost(each.value[1], 0)) ? each.value[1] : null
  referenced_security_group_id = can(cidrhost(each.value[1], 0)) ? null : aws_security_group.this[each.value[1]].id
}

resource "aws_vpc_security_group_egress_rule" "this" {
  for_each                     = local.egress_rules
  security_group_id            = aws_security_group.this[each.value[0]].id
  description                  = each.value[3]
  ip_protocol                  = "tcp"
  from_port                    = each.value[2]
  to_port                      = each.value[2]
  cidr_ipv4                    = can(cidrhost(each.value[1], 0)) ? each.value[1] : null
  referenced_security_group_id = can(cidrhost(each.value[1], 0)) ? null : aws_security_group.this[each.value[1]].id
}

# The region witness lives outside both Regions: every task renews its region lease there,
# so the API and worker groups reach its addresses on its PostgreSQL port (and nothing else
# beyond the Region but HTTPS).
resource "aws_vpc_security_group_egress_rule" "witness" {
  for_each          = { for p in setproduct(["api", "worker"], var.witness_cidrs) : "${p[0]} ${p[1]}" => p }
  security_group_id = aws_security_group.this[each.value[0]].id
  description       = "PostgreSQL to the region witness (outside both Regions)"
  ip_protocol       = "tcp"
  from_port         = var.witness_port
  to_port           = var.witness_port
  cidr_ipv4         = each.value[1]
}
