# Both Regions of boxoffice (design §14–§15): one `region` module per Region, plus what spans
# them — the Aurora global cluster, replicated secrets and images, MSK replication into the DR
# Region, and Route 53 failover. Naming rule (checked by infra/tests): a root resource whose
# name has the word `dr` uses provider aws.dr; every other one uses aws.primary.

data "aws_caller_identity" "current" {
  provider = aws.primary
}

locals {
  account_id = data.aws_caller_identity.current.account_id

  # Secrets whose values an operator puts (never in code or state). Created in the primary
  # Region and replicated to the DR Region under the DR Region's own KMS key.
  app_secrets = {
    stripe_secret_key     = "Stripe live secret key (sk_live_...); the payments role calls Stripe with it."
    stripe_webhook_secret = "Stripe webhook signing secret (whsec_...); the api role verifies webhooks with it."
    admission_private_key = "Ed25519 admission signing key (PEM, from `boxoffice admission-keygen`)."
  }

  # The active Region runs every role at its count; the other keeps a warm API behind a closed
  # DNS gate and no workers (they would write to a read-only secondary and commit offsets
  # into the replicated consumer groups).
  desired_counts = {
    for region in ["primary", "dr"] : region => {
      for role, s in var.services : role => (
        var.active_region == region ? s.count : (role == "api" ? var.standby_api_count : 0)
      )
    }
  }
}

resource "random_password" "db_master" {
  length           = 40
  override_special = "-_.~" # URL-safe: the password also goes into database URLs
}

resource "aws_secretsmanager_secret" "db_master" {
  provider                = aws.primary
  name                    = "${var.name}/db-master"
  description             = "Master credentials of the Aurora global cluster (operations and migrations)."
  kms_key_id              = module.primary.kms_key_arns.secrets
  recovery_window_in_days = 30

  replica {
    region     = var.dr_region
    kms_key_id = module.dr.kms_key_arns.secrets
  }
}

resource "aws_secretsmanager_secret_version" "db_master" {
  provider  = aws.primary
  secret_id = aws_secretsmanager_secret.db_master.id
  secret_string = jsonencode({
    username = var.db_master_username
    password = random_password.db_master.result
  })
}

resource "aws_secretsmanager_secret" "app" {
  for_each                = local.app_secrets
  provider                = aws.primary
  name                    = "${var.name}/${replace(each.key, "_", "-")}"
  description             = each.value
  kms_key_id              = module.primary.kms_key_arns.secrets
  recovery_window_in_days = 30

  replica {
    region     = var.dr_region
    kms_key_id = module.dr.kms_key_arns.secrets
  }
}

# The image, built once, replicated to the DR Region's registry by ECR.
resource "aws_ecr_repository" "boxoffice" {
  provider             = aws.primary
  name                 = var.name
  image_tag_mutability = "IMMUTABLE"

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = module.primary.kms_key_arns.data
  }
}

resource "aws_ecr_replication_configuration" "images" {
  provider = aws.primary

  replication_configuration {
    rule {
      destination {
        region      = var.dr_region
        registry_id = local.account_id
      }
      repository_filter {
        filter      = var.name
        filter_type = "PREFIX_MATCH"
      }
    }
  }
}

resource "aws_rds_global_cluster" "this" {
  provider                  = aws.primary
  global_cluster_identifier = "${var.name}-global"
  engine                    = "aurora-postgresql"
  engine_version            = var.sizing.aurora_engine_version
  database_name             = var.db_name
  storage_encrypted         = true
  deletion_protection       = true
}

module "primary" {
  source    = "./modules/region"
  providers = { aws = aws.primary }

  name               = var.name
  region_key         = "primary"
  vpc_cidr           = var.vpc_cidrs.primary
  availability_zones = var.availability_zones.primary
  certificate_arn    = var.certificate_arns.primary
  serving            = var.active_region == "primary"
  desired_counts     = local.desired_counts.primary
  services           = var.services
  image              = "${aws_ecr_repository.boxoffice.repository_url}:${var.image_tag}"
  image_repository   = var.name
  app_secret_arns    = { for k, s in aws_secretsmanager_secret.app : k => s.arn }
  app_settings       = local.app_settings
  waf_rate_limit     = var.waf_rate_limit
  log_retention      = var.log_retention_days
  global_cluster_id  = aws_rds_global_cluster.this.id
  aurora_primary     = true
  db_name            = var.db_name
  db_master_user     = var.db_master_username
  db_master_pass     = random_password.db_master.result
  sizing             = merge(var.sizing, { aurora_instances = var.sizing.aurora_instances.primary })
  msk_broker_count   = var.msk_broker_count

  # Region epoch and witness (design §15). The peer is the DR Region's database-url secret,
  # replicated here under this Region's key: `region fence` run from here (failback) fences
  # the DR ledger through it.
  region_epoch                    = var.region_epochs.primary
  witness_database_url_secret_arn = local.witness_secret_arns.primary
  witness_cidrs                   = var.witness_cidrs
  witness_port                    = var.witness_port
  peer_region                     = var.dr_region
  peer_secrets_kms_key_arn        = module.dr.kms_key_arns.secrets
  peer_database_url_secret_arn    = local.peer_database_url_secret_arns.primary
}

module "dr" {
  source    = "./modules/region"
  providers = { aws = aws.dr }

  name               = var.name
  region_key         = "dr"
  vpc_cidr           = var.vpc_cidrs.dr
  availability_zones = var.availability_zones.dr
  certificate_arn    = var.certificate_arns.dr
  serving            = var.active_region == "dr"
  desired_counts     = local.desired_counts.dr
  services           = var.services
  # The replicated copy of the same repository and tag in the DR Region's registry.
  image            = "${local.account_id}.dkr.ecr.${var.dr_region}.amazonaws.com/${var.name}:${var.image_tag}"
  image_repository = var.name
  # A replica's ARN is the primary secret's ARN in the other Region.
  app_secret_arns = {
    for k, s in aws_secretsmanager_secret.app : k => replace(s.arn, ":${var.primary_region}:", ":${var.dr_region}:")
  }
  app_settings   = local.app_settings
  waf_rate_limit = var.waf_rate_limit
  log_retention  = var.log_retention_days
  # From the primary module's output, so the secondary is added only after the primary's
  # instances exist. No master credentials: a secondary takes the global cluster's.
  global_cluster_id = module.primary.global_cluster_id
  aurora_primary    = false
  db_name           = var.db_name
  db_master_user    = null
  db_master_pass    = null
  sizing            = merge(var.sizing, { aurora_instances = var.sizing.aurora_instances.dr })
  msk_broker_count  = var.msk_broker_count

  # The peer is the primary's database-url secret, replicated here under this Region's key:
  # `region fence` run from here fences the old primary's ledger through it when reachable,
  # and the replica stays readable while the primary Region is down.
  region_epoch                    = var.region_epochs.dr
  witness_database_url_secret_arn = local.witness_secret_arns.dr
  witness_cidrs                   = var.witness_cidrs
  witness_port                    = var.witness_port
  peer_region                     = var.primary_region
  peer_secrets_kms_key_arn        = module.primary.kms_key_arns.secrets
  peer_database_url_secret_arn    = local.peer_database_url_secret_arns.dr
}

locals {
  # Non-secret settings of every role (`BOXOFFICE_` + key in upper case).
  app_settings = {
    ENV                     = "production"
    HTTP_BIND               = "0.0.0.0:8080"
    HTTP_TRUSTED_PROXY_HOPS = "1" # the ALB appends the client to X-Forwarded-For
    STRIPE_API_BASE         = "https://api.stripe.com"
    USER_JWKS_URL           = var.user_jwks_url
    USER_JWT_ISSUER         = var.user_jwt_issuer
    USER_JWT_AUDIENCE       = var.user_jwt_audience
    ADMISSION_KID           = var.admission_kid
    # Where Stripe's webhooks may come from (production refuses an empty list).
    WEBHOOK_ALLOWED_NETWORKS = jsonencode(var.webhook_allowed_networks)

    # The older, two-fact hold until every service runs a build that reads the one-fact form.
    HOLD_FACT_REQUESTS_AUTHORIZATION = tostring(var.hold_fact_requests_authorization)
    # The older confirmation (OrderConfirmed, then CaptureRequested) likewise.
    CONFIRMATION_FACT_REQUESTS_CAPTURE = tostring(var.confirmation_fact_requests_capture)
  }

  # The copy of the witness secret each Region's tasks read: the given ARN with that Region
  # in it (the secret where it lives, its replica elsewhere), so no task depends on the
  # other Region to start.
  witness_secret_arns = {
    for key, region in { primary = var.primary_region, dr = var.dr_region } :
    key => replace(var.witness_database_url_secret_arn, "/^(arn:[^:]+:secretsmanager):[^:]+:/", "$1:${region}:")
  }

  # The other Region's database-url secret, as its replica in this Region (a replica's ARN is
  # the secret's ARN with the replica's Region).
  peer_database_url_secret_arns = {
    primary = replace(module.dr.database_url_secret_arn, ":${var.dr_region}:", ":${var.primary_region}:")
    dr      = replace(module.primary.database_url_secret_arn, ":${var.primary_region}:", ":${var.dr_region}:")
  }
}
