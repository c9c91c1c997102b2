"""Tandem's HTTP layer: OpenAI-compatible FastAPI app, protocol models, metrics and the CLI."""

from __future__ import annotations

__version__ = "0.1.0"
