"""Which of vLLM's KV cache groups the connector moves, and how.

A model whose layers attend differently (hybrid attention: sliding-window and full layers) has
several KV cache groups, each with its own spec, block size and block ids; vLLM overlays the
groups in one buffer, a block belonging to one group at a time. The connector treats each group
as a KV cache of its own: one registration per group, under the model's identity plus the group
(``<identity>/g<index>`` when there are several), so chunks of different groups never mix.

* A prefix hit is the number of leading chunks present in **every** group.
* A load writes each group's blocks; vLLM gives a sliding-window (or chunked-local) group only
  the blocks its window still needs and the null block (id 0) before them, so those chunks'
  blocks are skipped (only the window is loaded).
* Every group stores every full prompt chunk it holds when the step that computes it ends, so
  any later prefix can be served; vLLM may free a sliding-window group's blocks while the
  request still runs, so those stores finish before the next step's work starts
  (:attr:`GroupPlan.frees_early`).

Groups of other kinds (Mamba state, cross-attention) are refused at start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvxfer.errors import ConfigError
from kvxfer.protocol.messages import name_bytes

if TYPE_CHECKING:
    from kvxfer.client import CacheClient

__all__ = ["GroupPlan", "plan_groups", "check_name_lengths", "NULL_BLOCK"]

#: vLLM's null block: its BlockPool takes block 0 first and marks it ``is_null``; a group's block
#: table holds it where the group needs no KV (tokens that left a sliding window).
NULL_BLOCK: Final = 0

#: Spec classes (by name, vLLM stays unimported) of groups whose blocks vLLM frees mid-request.
_FREES_EARLY: Final = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec"})
#: Spec classes of groups that hold no paged attention KV kvxfer could move.
_UNSUPPORTED: Final = frozenset({"MambaSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec",
                                 "HiSparseHotSpec", "HiSparseResidentSpec", "CircularBufferSpec"})


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One KV cache group as the connector moves it."""

    #: vLLM's KV cache group id (its index in ``kv_cache_groups`` and in block id tuples).
    index: int
    #: The identity its chunks are stored under (the server's ``model_name``).
    name: str
    #: Tokens per block of this group (vLLM may give groups different block sizes).
    block_size: int
    #: Its layers, in layer order (empty: every layer vLLM registers).
    layer_names: tuple[str, ...]
    #: vLLM frees its blocks while the request runs: stores finish before the next step.
    frees_early: bool = False


def check_name_lengths(groups: Iterable[GroupPlan], client: CacheClient) -> None:
    """Raise :class:`ConfigError` if an identity is longer than the server at ``client`` takes
    (each would be refused at every registration and lookup)."""
    most = client.max_name_length
    for g in groups:
        n = name_bytes(g.name)
        if most and n > most:
            raise ConfigError(f"the identity {g.name[:40]!r}... of KV cache group {g.index} has {n} bytes but the "
                              f"kvxfer server at {client.url} takes names of at most {most} (--max-name-length): "
                              "shorten kvxfer.model_name, or restart the server with a larger --max-name-length")


def _spec_names(spec: Any) -> set[str]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    specs = list(inner.values()) if isinstance(inner, dict) and inner else [spec]
    return {cls.__name__ for s in specs for cls in type(s).__mro__}


def plan_groups(kv_cache_config: Any, identity: str, block_size: int) -> list[GroupPlan]:
    """The groups to move, from vLLM's ``KVCacheConfig`` (attributes only); without one (an
    engine that passes none), one group of ``block_size``. Raises :class:`ConfigError` for a
    group kvxfer cannot move."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return [GroupPlan(0, identity, block_size, ())]
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    ids = list(ids) if ids is not None else list(range(len(groups)))
    plans = []
    for i in ids:
        group = groups[i]
        spec = group.kv_cache_spec
        names = _spec_names(spec)
        if names & _UNSUPPORTED or "AttentionSpec" not in names:
            raise ConfigError(
                f"KV cache group {i} ({type(spec).__name__}, layers {list(group.layer_names)[:4]}...) holds no "
                f"paged attention KV that kvxfer can move; kvxfer supports full-attention, MLA, sliding-window "
                f"and chunked-local attention groups. Run this model without the kvxfer connector"
            )
        bs = getattr(spec, "block_size", None)
        if not isinstance(bs, int) or bs <= 0:
            raise ConfigError(f"KV cache group {i}: block size {bs!r} is not a positive integer")
        name = identity if len(ids) == 1 else f"{identity}/g{i}"
        plans.append(GroupPlan(i, name, bs, tuple(group.layer_names), bool(names & _FREES_EARLY)))
    return plans
