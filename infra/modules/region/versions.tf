# The caller picks the Region: `providers = { aws = aws.primary }` or `{ aws = aws.dr }`.
# Nothing in this module names a provider or a Region of its own.
terraform {
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
}
