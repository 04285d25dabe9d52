# Route 53 failover for the API (design §15). Each Region's health is CALCULATED from two
# checks that must both pass: the API's own /healthz through its ALB, and the Region's gate,
# /_region/active, which the ALB answers 200 only in the Region named by var.active_region.
# So DNS never moves by itself to a Region that has not been promoted, and never moves back
# to an old primary that comes up again: the operator opens the gate after fencing, promotion
# and the synthetic hold and webhook tests. Route 53 is global; these use aws.primary except
# the DR record.

locals {
  alb_dns_names = { primary = module.primary.alb_dns_name, dr = module.dr.alb_dns_name }
}

resource "aws_route53_health_check" "api" {
  for_each          = local.alb_dns_names
  provider          = aws.primary
  fqdn              = each.value
  type              = "HTTPS"
  port              = 443
  resource_path     = "/healthz"
  request_interval  = 10
  failure_threshold = 3
  tags              = { Name = "${var.name}-${each.key}-api" }
}

resource "aws_route53_health_check" "gate" {
  for_each          = local.alb_dns_names
  provider          = aws.primary
  fqdn              = each.value
  type              = "HTTPS"
  port              = 443
  resource_path     = "/_region/active"
  request_interval  = 10
  failure_threshold = 1
  tags              = { Name = "${var.name}-${each.key}-gate" }
}

resource "aws_route53_health_check" "region" {
  for_each               = local.alb_dns_names
  provider               = aws.primary
  type                   = "CALCULATED"
  child_health_threshold = 2
  child_healthchecks     = [aws_route53_health_check.api[each.key].id, aws_route53_health_check.gate[each.key].id]
  tags                   = { Name = "${var.name}-${each.key}" }
}

resource "aws_route53_record" "api_primary" {
  provider        = aws.primary
  zone_id         = var.hosted_zone_id
  name            = var.api_domain_name
  type            = "A"
  set_identifier  = "primary"
  health_check_id = aws_route53_health_check.region["primary"].id

  failover_routing_policy {
    type = "PRIMARY"
  }

  alias {
    name                   = module.primary.alb_dns_name
    zone_id                = module.primary.alb_zone_id
    evaluate_target_health = true
  }
}

resource "aws_route53_record" "api_dr" {
  provider        = aws.dr
  zone_id         = var.hosted_zone_id
  name            = var.api_domain_name
  type            = "A"
  set_identifier  = "dr"
  health_check_id = aws_route53_health_check.region["dr"].id

  failover_routing_policy {
    type = "SECONDARY"
  }

  alias {
    name                   = module.dr.alb_dns_name
    zone_id                = module.dr.alb_zone_id
    evaluate_target_health = true
  }
}
