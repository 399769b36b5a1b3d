"""Helpers shared by tests (never fixtures: those live in conftest files)."""
