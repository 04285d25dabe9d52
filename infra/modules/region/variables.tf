variable "name" {
  description = "Name prefix of every resource."
  type        = string
}

variable "region_key" {
  description = "\"primary\" or \"dr\": which of the two Regions this instance is (names and tags)."
  type        = string

  validation {
    condition     = contains(["primary", "dr"], var.region_key)
    error_message = "region_key is \"primary\" or \"dr\"."
  }
}

variable "availability_zones" {
  description = "The three AZs of this Region, named (not looked up, so a new AZ never moves a subnet)."
  type        = list(string)

  validation {
    condition     = length(distinct(var.availability_zones)) == 3
    error_message = "Exactly three distinct AZs."
  }
}

variable "vpc_cidr" {
  description = "CIDR of the Region's VPC (a /16: three public and three private /20s)."
  type        = string
}

variable "certificate_arn" {
  description = "ACM certificate of the API's name in this Region."
  type        = string
}

variable "serving" {
  description = "Whether this Region's DNS gate (/_region/active) answers 200, letting Route 53 send buyers here."
  type        = bool
}

variable "services" {
  description = "Per role: Fargate CPU units and memory (MiB); keys are `boxoffice serve --roles` names."
  type        = map(object({ count = number, cpu = number, memory = number }))
}

variable "desired_counts" {
  description = "Tasks per role in this Region now (zero workers in a standby Region)."
  type        = map(number)
}

variable "image" {
  description = "Image URI of boxoffice in this Region's registry."
  type        = string
}

variable "image_repository" {
  description = "Name of the ECR repository the image comes from (the execution roles may pull only from it)."
  type        = string
}

variable "app_secret_arns" {
  description = "ARNs, in this Region, of the operator-filled secrets: stripe_secret_key, stripe_webhook_secret, admission_private_key."
  type        = map(string)
}

variable "app_settings" {
  description = "Non-secret settings of every role, as BOXOFFICE_<KEY> environment variables."
  type        = map(string)
}

variable "waf_rate_limit" {
  description = "Requests per client IP per 5 minutes before the WAF blocks."
  type        = number
}

variable "log_retention" {
  description = "CloudWatch Logs retention, days."
  type        = number
}

variable "global_cluster_id" {
  description = "Aurora global cluster this Region's cluster joins."
  type        = string
}

variable "aurora_primary" {
  description = "true: this cluster is the global cluster's primary (it has the master credentials); false: a secondary (no credentials of its own)."
  type        = bool
}

variable "db_name" {
  description = "Database name (set on the primary only)."
  type        = string
}

variable "db_master_user" {
  description = "Master user name; null on a secondary."
  type        = string
  default     = null
}

variable "db_master_pass" {
  description = "Master password (from random_password, kept in Secrets Manager); null on a secondary."
  type        = string
  default     = null
  sensitive   = true
}

variable "sizing" {
  description = "Versions, classes and counts of this Region's data services."
  type        = object({
    aurora_engine_version = string
    aurora_instance_class = string
    aurora_instances      = number
    kafka_version         = string
    msk_instance_type     = string
    msk_volume_size       = number
    redis_node_type       = string
  })
}

variable "msk_broker_count" {
  description = "MSK brokers: a multiple of the three AZs."
  type        = number

  validation {
    condition     = var.msk_broker_count >= 3 && var.msk_broker_count % 3 == 0
    error_message = "msk_broker_count must be a positive multiple of 3 (one per AZ)."
  }
}

variable "region_epoch" {
  description = "BOXOFFICE_REGION_EPOCH of this Region's services: the region epoch they write at (>= 1). After a promotion, the epoch `boxoffice region promote` printed."
  type        = number

  validation {
    condition     = var.region_epoch >= 1 && floor(var.region_epoch) == var.region_epoch
    error_message = "region_epoch is a whole number >= 1."
  }
}

variable "witness_database_url_secret_arn" {
  description = "ARN, in this Region, of the secret holding the region witness's URL (BOXOFFICE_WITNESS_DATABASE_URL): the witness itself lives outside both Regions."
  type        = string
}

variable "witness_cidrs" {
  description = "CIDR blocks of the region witness database; the API and worker tasks may reach them on witness_port."
  type        = list(string)
}

variable "witness_port" {
  description = "TCP port of the region witness database."
  type        = number
}

variable "peer_region" {
  description = "AWS name of the other Region: this Region's database-url secret is replicated there, as that Region's BOXOFFICE_REGION_PEER_DATABASE_URL."
  type        = string
}

variable "peer_secrets_kms_key_arn" {
  description = "The other Region's `secrets` key, which encrypts the replica of this Region's database-url secret there."
  type        = string
}

variable "peer_database_url_secret_arn" {
  description = "ARN, in this Region, of the replica of the other Region's database-url secret (BOXOFFICE_REGION_PEER_DATABASE_URL: `region fence` run from here fences that Region's ledger through it)."
  type        = string
}
