terraform {
  required_version = ">= 1.10"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.33"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.7"
    }
  }

  # State holds the generated passwords (database master, Redis AUTH, Kafka SCRAM): keep it in
  # an encrypted, versioned bucket. Bucket, key, region and kms_key_id come from
  # `terraform init -backend-config=...`.
  backend "s3" {
    encrypt      = true
    use_lockfile = true
  }
}

# Two aliased providers and no default one: every AWS resource has to say which Region it
# lives in (infra/tests checks this).
provider "aws" {
  alias  = "primary"
  region = var.primary_region

  default_tags {
    tags = { Project = var.name, Region = "primary", ManagedBy = "terraform" }
  }
}

provider "aws" {
  alias  = "dr"
  region = var.dr_region

  default_tags {
    tags = { Project = var.name, Region = "dr", ManagedBy = "terraform" }
  }
}
