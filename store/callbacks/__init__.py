"""Webhooks: the URLs a tenant registers, the events a job sends, and their delivery."""
