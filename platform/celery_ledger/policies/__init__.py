"""Policies: small, pure pieces of the platform's behaviour (one per module)."""
