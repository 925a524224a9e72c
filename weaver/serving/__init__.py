"""Serving backends: our trees, drafter and acceptance rules inside a serving engine (SGLang)."""
