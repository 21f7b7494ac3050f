"""A vLLM KV connector that does nothing: the floor under any connector's cost.

``benchmarks/vllm_ttft.py`` runs an engine with it beside vLLM alone and vLLM with kvxfer: what
it costs is vLLM's own connector machinery (the connector's metadata and output on every step,
the per-layer hooks of attention), which no connector can go under. Found by vLLM through
``kv_connector_module_path="vllm_null_connector"`` (this directory is on the engine's path).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

__all__ = ["NullConnector"]


class NullConnector(KVConnectorBase_V1):
    """Loads nothing, stores nothing; every method returns at once."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
