"""What a call passes before it is a request: credentials, tenancy, size and rate limits, validation, prompts."""
