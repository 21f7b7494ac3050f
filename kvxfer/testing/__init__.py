"""kvxfer.testing: the conformance kit for transport authors, and test helpers."""

from kvxfer.testing.server import ServerProcess

__all__ = ["ServerProcess"]
