variable "name" {
  description = "Name prefix of every resource."
  type        = string
  default     = "boxoffice"
}

variable "primary_region" {
  description = "Region that takes writes in normal operation (design §14)."
  type        = string
  default     = "eu-west-1"
}

variable "dr_region" {
  description = "Warm standby Region (design §15): Aurora secondary, MSK replication target, low-count services."
  type        = string
  default     = "eu-central-1"

  validation {
    condition     = var.dr_region != var.primary_region
    error_message = "The DR Region must differ from the primary Region."
  }
}

variable "availability_zones" {
  description = "The three AZs used in each Region (named, so the set never changes when AWS adds one)."
  type        = object({ primary = list(string), dr = list(string) })
  default     = {
    primary = ["eu-west-1a", "eu-west-1b", "eu-west-1c"]
    dr      = ["eu-central-1a", "eu-central-1b", "eu-central-1c"]
  }
}

variable "vpc_cidrs" {
  description = "VPC CIDR per Region (non-overlapping, so the VPCs can be peered later)."
  type        = object({ primary = string, dr = string })
  default     = { primary = "10.40.0.0/16", dr = "10.41.0.0/16" }
}

variable "active_region" {
  description = "Which Region serves buyers: \"primary\" or \"dr\". Switch to \"dr\" only after the runbook's fencing, promotion and synthetic tests (design §15); it opens the DR Region's DNS gate, scales its workers up and closes the primary's gate."
  type        = string
  default     = "primary"

  validation {
    condition     = contains(["primary", "dr"], var.active_region)
    error_message = "active_region is \"primary\" or \"dr\"."
  }
}

variable "image_tag" {
  description = "Tag of the boxoffice image in the ECR repository (immutable tags; replicated to the DR Region)."
  type        = string
}

variable "services" {
  description = "Per role: tasks in the active Region, Fargate CPU units and memory (MiB). Keys are `boxoffice serve --roles` names."
  type        = map(object({ count = number, cpu = number, memory = number }))
  default     = {
    api      = { count = 6, cpu = 1024, memory = 2048 }
    relay    = { count = 2, cpu = 512, memory = 1024 }
    saga     = { count = 3, cpu = 512, memory = 1024 }
    payments = { count = 3, cpu = 512, memory = 1024 }
    tickets  = { count = 2, cpu = 512, memory = 1024 }
    expiry   = { count = 2, cpu = 256, memory = 512 }
  }
}

variable "standby_api_count" {
  description = "API tasks kept running in the Region that is not active (warm; its DNS gate stays closed). Its workers run zero tasks."
  type        = number
  default     = 2
}

variable "api_domain_name" {
  description = "Public name of the API, e.g. api.tickets.example.com."
  type        = string
}

variable "hosted_zone_id" {
  description = "Route 53 hosted zone that holds api_domain_name."
  type        = string
}

variable "certificate_arns" {
  description = "ACM certificate ARN for api_domain_name in each Region (ACM is regional)."
  type        = object({ primary = string, dr = string })
}

variable "user_jwks_url" {
  description = "HTTPS URL of the identity provider's JWKS (production verifies buyer tokens only with it)."
  type        = string

  validation {
    condition     = startswith(var.user_jwks_url, "https://")
    error_message = "user_jwks_url must be https."
  }
}

variable "user_jwt_issuer" {
  description = "Identity provider issuer (`iss`) of buyer tokens."
  type        = string
}

variable "user_jwt_audience" {
  description = "Audience (`aud`) of buyer tokens for this API."
  type        = string
}

variable "webhook_allowed_networks" {
  description = "CIDR networks Stripe's webhooks may come from: Stripe's published webhook addresses as /32s (\"0.0.0.0/0\" and \"::/0\" accept any, on purpose). Production refuses an empty list."
  type        = list(string)

  validation {
    condition     = length(var.webhook_allowed_networks) > 0
    error_message = "webhook_allowed_networks must list at least one network."
  }
}

variable "admission_kid" {
  description = "Key id of the admission signing key held in the admission-private-key secret."
  type        = string
}

variable "witness_database_url_secret_arn" {
  description = "ARN of the secret holding the URL of the region witness database (BOXOFFICE_WITNESS_DATABASE_URL of every task). The witness lives outside both Regions (a third location), so it is referenced here, not built. Each Region's tasks read the copy in their own Region (this ARN with that Region in it): replicate the secret into both Regions, under each Region's `secrets` key (output secrets_kms_key_arns) or the AWS managed key, so that losing one Region never keeps the other's tasks from starting."
  type        = string

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+$", var.witness_database_url_secret_arn))
    error_message = "witness_database_url_secret_arn must be the full ARN of a Secrets Manager secret."
  }
}

variable "witness_cidrs" {
  description = "CIDR blocks of the region witness database: every task renews its region lease there (PostgreSQL, witness_port), so the API and worker security groups get an egress rule to each. Keep them as narrow as the witness's addresses allow."
  type        = list(string)

  validation {
    condition     = length(var.witness_cidrs) > 0 && alltrue([for c in var.witness_cidrs : can(cidrhost(c, 0))])
    error_message = "witness_cidrs must be a non-empty list of CIDR blocks."
  }
}

variable "witness_port" {
  description = "TCP port of the region witness database."
  type        = number
  default     = 5432
}

variable "region_epochs" {
  description = "BOXOFFICE_REGION_EPOCH of each Region's services: the region epoch they write at. primary = 1, the epoch `boxoffice region init` names at the witness; dr = 2, the epoch its first promotion gives it (`region fence` moves the witness to the next epoch). After every promotion set the promoted Region's entry to the epoch `boxoffice region promote` printed (a failback to primary: 3), then apply. A Region's services at an epoch the witness does not name get no lease and never write: the standby's warm API at its next epoch starts writing once fence and promotion name it, and a fenced Region's services restarting with their old epoch stay fenced."
  type        = object({ primary = number, dr = number })
  default     = { primary = 1, dr = 2 }

  validation {
    condition = alltrue([
      for e in [var.region_epochs.primary, var.region_epochs.dr] : e >= 1 && floor(e) == e
    ]) && var.region_epochs.primary != var.region_epochs.dr
    error_message = "region_epochs are whole numbers >= 1, and the two Regions never share one (an epoch belongs to one Region)."
  }
}

variable "db_name" {
  description = "Database created in the Aurora global cluster."
  type        = string
  default     = "boxoffice"
}

variable "db_master_username" {
  description = "Master user of the Aurora global cluster (operations and migrations only; the services log in with their own role)."
  type        = string
  default     = "boxoffice_admin"
}

variable "sizing" {
  description = "Versions, classes and counts of the data services. The DR Region gets the same classes: once promoted it carries the whole load."
  type        = object({
    aurora_engine_version = string                               # must support Aurora global databases
    aurora_instance_class = string
    aurora_instances      = object({ primary = number, dr = number }) # primary: a writer and two readers across AZs
    kafka_version         = string
    msk_instance_type     = string
    msk_volume_size       = number # GiB per broker (design §12: events/s x bytes x retention x RF)
    redis_node_type       = string
  })
  default = {
    aurora_engine_version = "16.6"
    aurora_instance_class = "db.r7g.xlarge"
    aurora_instances      = { primary = 3, dr = 2 }
    kafka_version         = "3.6.0"
    msk_instance_type     = "kafka.m7g.large"
    msk_volume_size       = 1000
    redis_node_type       = "cache.r7g.large"
  }
}

variable "msk_broker_count" {
  description = "Brokers per MSK cluster: a multiple of the three AZs (one per AZ at least)."
  type        = number
  default     = 3

  validation {
    condition     = var.msk_broker_count >= 3 && var.msk_broker_count % 3 == 0
    error_message = "msk_broker_count must be a positive multiple of 3 (one per AZ)."
  }
}

variable "replicated_topics" {
  description = "Topic regexes MSK Replicator copies to the DR cluster."
  type        = list(string)
  default     = ["ticketing\\..*"]
}

variable "replicated_consumer_groups" {
  description = "Consumer-group regexes whose offsets MSK Replicator copies to the DR cluster."
  type        = list(string)
  default     = ["ticketing-.*"]
}

variable "waf_rate_limit" {
  description = "Requests per client IP per 5 minutes before WAF blocks (the API's own buckets act first; this stops floods before the ALB)."
  type        = number
  default     = 3000
}

variable "log_retention_days" {
  description = "CloudWatch Logs retention of service, WAF, MSK and flow logs."
  type        = number
  default     = 365
}

variable "hold_fact_requests_authorization" {
  description = "Whether a hold's HoldCreated is its order's authorization request (one fact per order; BOXOFFICE_HOLD_FACT_REQUESTS_AUTHORIZATION). false writes the older form, which every build's payment worker acts on: keep it while any service may run a build whose payment worker ignores HoldCreated (ECS replaces every role at once and may roll one back alone), then apply true."
  type        = bool
  default     = false
}

variable "confirmation_fact_requests_capture" {
  description = "Whether a confirmation's OrderConfirmed is its order's capture request (one fact per confirmation; BOXOFFICE_CONFIRMATION_FACT_REQUESTS_CAPTURE). false writes the older form, a CaptureRequested beside it, which every build's payment worker acts on: keep it while any service may run a build whose payment worker ignores OrderConfirmed (ECS replaces every role at once and may roll one back alone), then apply true."
  type        = bool
  default     = false
}
