"""Integrations with serving engines; each imports its engine lazily."""
