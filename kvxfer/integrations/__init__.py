"""Integrations of kvxfer with inference engines (``kvxfer.integrations.vllm``)."""
