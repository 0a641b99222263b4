"""Integrations with training frameworks; each imports its framework lazily."""
