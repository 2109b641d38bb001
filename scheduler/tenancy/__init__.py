"""Tenants: authentication of callers and their quotas. Builds on db and settings."""
