"""The connector's settings, read from vLLM's ``kv_transfer_config``.

Every key lives in ``kv_connector_extra_config`` under the ``kvxfer.`` prefix; an unknown
``kvxfer.*`` key is an error (typos must not silently fall back to defaults)::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvxfer.transport": "auto",
                                                         "kvxfer.url": "ipc:///run/kvxfer/kvxfer.sock"}}'
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvxfer.client import MAX_TIMEOUT_S
from kvxfer.errors import ConfigError
from kvxfer.protocol.messages import unprintable_in
from kvxfer.urls import check_url, default_url

__all__ = ["ConnectorConfig", "KEYS"]

#: Every accepted key, with what it means (shown in errors and docs/vllm.md).
KEYS: Final[dict[str, str]] = {
    "kvxfer.url": "address of the kvxfer server (default: $KVXFER_URL or the private ipc:// socket)",
    "kvxfer.transport": "transport name (cuda_ipc, hpu, cpu_gather, ...) or 'auto' (default)",
    "kvxfer.chunk_size": "tokens per chunk; must equal the server's --chunk-size (default: the server's)",
    "kvxfer.timeout_s": "seconds to wait for any server request, from 0.01 (default 5)",
    "kvxfer.lease_s": "seconds a lookup keeps its hits from eviction until they are loaded (default 60)",
    "kvxfer.load_timeout_ms": "milliseconds a load may take before its blocks are reported as not loaded "
                              "(default 0: no deadline but kvxfer.timeout_s)",
    "kvxfer.on_server_error": "'fail' (default: raise) or 'recompute' (carry on without the cache)",
    "kvxfer.retry_s": "in 'recompute' mode, seconds between attempts to reach a lost server, 0.1 to 86400 "
                      "(default 5)",
    "kvxfer.model_name": "readable label of stored chunks (default: the model path and its KV dtype)",
    "kvxfer.fingerprint": "true (default): chunks are keyed by the label plus a fingerprint of what makes KV "
                          "bytes compatible (weights, dtypes, quantization, shapes, layout, parallelism); "
                          "false: by the label alone",
    "kvxfer.layout": "KV layout when ambiguous: bhnc, flash_attn, flashinfer or mla (default: inferred)",
    "kvxfer.layerwise": ("true: load and store layer by layer inside the forward pass (loads are synchronous: "
                         "attention of layer i waits only for layer i); false (default): loads finish "
                         "between steps, stores are submitted after the pass"),
    "kvxfer.prefetch": ("true (default unless kvxfer.layerwise): a lookup asks the server to start moving its hits "
                        "toward the GPU that will load them (cuda_ipc stages them), so the load that follows ends "
                        "sooner; false: not (a layer-by-layer load uses nothing prefetched: not with "
                        "kvxfer.layerwise)"),
    "kvxfer.curve_dir": "directory of CURVE keys from `kvxfer keys` (required for a tcp:// server)",
    "kvxfer.curve_name": "which client key pair in kvxfer.curve_dir (default 'client')",
}

#: Longest kvxfer.retry_s: a day (threading refuses waits past TIMEOUT_MAX, and the thread would die).
MAX_RETRY_S: Final = 86400.0
#: Longest kvxfer.lease_s: a day (a server grants at most its --max-lease anyway; a longer one is a typo).
MAX_LEASE_S: Final = 86400.0
#: A number written as a string, in ASCII as JSON writes numbers (float() also takes "1_0" and
#: other scripts' digits).
_NUMBER: Final = re.compile(r"\s*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\s*")
#: Names the connector makes of a label: ``<label>#<fingerprint>`` and ``<identity>/g<N>`` (one per
#: KV cache group); a label spelling either would share another engine's chunks.
_MADE_NAME: Final = re.compile(r".*(#|/g[0-9]+$).*", re.DOTALL)

KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
OnError = Literal["fail", "recompute"]


def _misnamed(key: str, value: Any) -> str | None:
    """What is wrong with ``key``, not one of kvxfer's keys, if it is meant for kvxfer: one of
    them in another case (``KVXFER.url``) or without its prefix (``url``), misspelt outside it,
    written with another separator (``KVXFER_URL``, ``kvxfer-transport``), or the settings nested
    under a "kvxfer" key; else None (another prefix's key, or an unknown ``kvxfer.`` one, which
    :meth:`ConnectorConfig.from_mapping` names with the others)."""
    low = key.lower()
    if low in KEYS:
        return f"kv_connector_extra_config key {key!r} is not kvxfer's; did you mean {low!r}?"
    bare = {k.removeprefix("kvxfer."): k for k in KEYS}  # (a misspelt key without its prefix: `timeout`)
    close = [f"kvxfer.{key}"] if f"kvxfer.{key}" in KEYS else \
        [bare[m] for m in difflib.get_close_matches(key, bare, n=1, cutoff=0.8)] or \
        difflib.get_close_matches(key, KEYS, n=1, cutoff=0.8) if not key.startswith("kvxfer.") else []
    if close:
        return f"kv_connector_extra_config key {key!r} is not kvxfer's; did you mean {close[0]!r}?"
    if low.startswith("kvxfer."):
        return None
    if low == "kvxfer" and isinstance(value, Mapping):
        named = [n for n in (f"kvxfer.{k.removeprefix('kvxfer.')}" for k in value if isinstance(k, str))
                 if n in KEYS][:3] or ["kvxfer.url"]
        example = ", ".join(f'"{n}": ...' for n in named)
        return (f"kv_connector_extra_config key {key!r} holds a mapping: kvxfer's keys are not nested, each is a "
                f"key of its own ({example}); kvxfer knows {', '.join(KEYS)}")
    flat = "kvxfer." + low[len("kvxfer"):].lstrip("._-") if low.startswith("kvxfer") else ""
    if flat in KEYS:
        return f"kv_connector_extra_config key {key!r} is not kvxfer's; did you mean {flat!r}?"
    if low == "kvxfer":
        return f"kv_connector_extra_config key {key!r} is not kvxfer's; kvxfer knows {', '.join(KEYS)}"
    return None


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Settings of one connector instance (scheduler or worker side)."""

    url: str
    transport: str
    #: None: take the server's.
    chunk_size: int | None
    timeout_s: float
    lease_s: float
    #: Seconds a load may take before it is abandoned (0: none).
    load_timeout_s: float
    on_server_error: OnError
    retry_s: float
    #: The label of stored chunks (the identity adds a fingerprint, see identity.py).
    model_name: str
    fingerprint: bool
    layout: str | None
    #: Load and store layer by layer inside the forward pass (``kvxfer.layerwise``).
    layerwise: bool
    #: Lookups ask the server to prefetch their hits (``kvxfer.prefetch``).
    prefetch: bool
    curve_dir: str | None
    curve_name: str
    kv_role: KvRole
    block_size: int
    world_size: int
    rank: int

    @property
    def loads(self) -> bool:
        """Whether this engine loads KV from the cache (kv_consumer or kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def stores(self) -> bool:
        """Whether this engine stores KV into the cache (kv_producer or kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        """Read the settings from a vLLM ``VllmConfig`` (only attributes, no vLLM import)."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        if ktc is None:
            raise ConfigError("vllm_config.kv_transfer_config is not set; pass --kv-transfer-config")
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        model_config = getattr(vllm_config, "model_config", None)
        cache_config = getattr(vllm_config, "cache_config", None)
        parallel = getattr(vllm_config, "parallel_config", None)
        block_size = getattr(cache_config, "block_size", None)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"vllm_config.cache_config.block_size must be a positive integer, got {block_size!r}")
        world_size = _engine_world_size(parallel)
        rank = int(getattr(parallel, "rank", 0) or 0)
        # vLLM's own settings of the connector (kv_load_failure_policy, kv_role, ...): one put in
        # the extra config by mistake is read by nobody, and vLLM keeps its default
        fields = getattr(type(ktc), "__dataclass_fields__", None) or getattr(ktc, "__dict__", {})
        misplaced = sorted(k for k in extra if isinstance(k, str) and k in fields and k != "kv_connector_extra_config")
        if misplaced:
            one = len(misplaced) == 1
            raise ConfigError(f"kv_connector_extra_config holds {', '.join(map(repr, misplaced))}, which "
                              f"{'is a setting' if one else 'are settings'} of vLLM's --kv-transfer-config itself: "
                              f"move {'it' if one else 'them'} one level up, beside kv_connector (in the extra config "
                              f"vLLM never reads {'it' if one else 'them'} and keeps its default)")
        return cls.from_mapping(
            extra,
            kv_role=getattr(ktc, "kv_role", None) or "kv_both",
            block_size=block_size,
            world_size=world_size,
            rank=rank % world_size,  # parallel_config.rank counts within this engine's TP x PP group
            default_model_name=_default_model_name(model_config, cache_config),
        )

    @classmethod
    def from_mapping(
        cls,
        extra: Mapping[str, Any],
        *,
        kv_role: str,
        block_size: int,
        world_size: int,
        rank: int,
        default_model_name: str,
    ) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``; raise :class:`ConfigError` naming the key."""
        for k in extra:  # a key of another prefix is not kvxfer's, unless it is one of kvxfer's misspelt
            if not isinstance(k, str):
                raise ConfigError(f"kv_connector_extra_config keys must be strings, got {k!r}"[:300])
            problem = _misnamed(k, extra[k]) if k not in KEYS else None
            if problem is not None:
                raise ConfigError(problem)
        unknown = sorted(k for k in extra if isinstance(k, str) and k.lower().startswith("kvxfer.") and k not in KEYS
                         and k.lower() not in KEYS)  # (a known key in another case is refused above)
        if unknown:
            guesses = {k: difflib.get_close_matches(k.lower(), KEYS, n=1, cutoff=0.8) for k in unknown}
            named = ", ".join(f"{k!r} (did you mean {g[0]!r}?)" if g else repr(k) for k, g in guesses.items())
            raise ConfigError(f"unknown kv_connector_extra_config key(s) {named}; kvxfer knows "
                              f"{', '.join(KEYS)} (docs/vllm.md, section 3, says what each does)")
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
        on_error = extra.get("kvxfer.on_server_error", "fail")
        if on_error not in ("fail", "recompute"):
            raise ConfigError(f"kvxfer.on_server_error must be 'fail' or 'recompute', got {on_error!r}")
        chunk_size = extra.get("kvxfer.chunk_size")
        if chunk_size is not None:
            chunk_size = _positive_int("kvxfer.chunk_size", chunk_size)
            if chunk_size % block_size:
                raise ConfigError(
                    f"kvxfer.chunk_size {chunk_size} is not a multiple of vLLM's block size {block_size}; set it "
                    f"to the server's --chunk-size (which must be a multiple of {block_size}), or leave it out"
                )
        layout = extra.get("kvxfer.layout")
        if layout is not None and layout not in ("bhnc", "flash_attn", "flashinfer", "mla"):
            raise ConfigError(f"kvxfer.layout must be bhnc, flash_attn, flashinfer or mla, got {layout!r}")
        transport = extra.get("kvxfer.transport", "auto")
        if not isinstance(transport, str) or not transport:
            raise ConfigError(f"kvxfer.transport must be a transport name or 'auto', got {transport!r}")
        model_name = extra.get("kvxfer.model_name", default_model_name)  # given empty is a mistake
        if not isinstance(model_name, str) or not model_name:
            raise ConfigError(f"kvxfer.model_name must be a non-empty string (left out: vLLM's model and its KV "
                              f"dtype), got {model_name!r}"[:300])
        problem = unprintable_in(model_name)  # the server's rule for names
        if problem is not None:
            raise ConfigError(f"kvxfer.model_name {problem}")
        if "kvxfer.model_name" in extra and _MADE_NAME.fullmatch(model_name):
            raise ConfigError(f"kvxfer.model_name {model_name[:200]!r} holds '#' or ends in '/g<N>', which the "
                              "connector puts after a label (the fingerprint of the engine's KV, a KV cache group's "
                              "number): such a label would name another engine's chunks; choose one without them")
        fingerprint = parse_bool("kvxfer.fingerprint", extra.get("kvxfer.fingerprint", True))
        layerwise = parse_bool("kvxfer.layerwise", extra.get("kvxfer.layerwise", False))
        prefetch = parse_bool("kvxfer.prefetch", extra.get("kvxfer.prefetch", not layerwise))
        if prefetch and layerwise:
            raise ConfigError("kvxfer.prefetch is true with kvxfer.layerwise: a layer-by-layer load copies each chunk "
                              "layer by layer and uses nothing a prefetch moved, whose copies would only run ahead "
                              "of it; set kvxfer.prefetch false (the default with kvxfer.layerwise)")
        url = extra.get("kvxfer.url")
        url = default_url() if url is None else url  # given empty is a mistake, not the default
        if not isinstance(url, str) or not url:
            raise ConfigError(f"kvxfer.url must be a non-empty string, ipc://PATH or tcp://HOST:PORT (left out: the "
                              f"default socket), got {url!r}"[:300])
        try:
            check_url(url)
        except ConfigError as exc:
            raise ConfigError(f"kvxfer.url: {exc}") from None
        # below 10 ms no request could be answered; a retry faster than 0.1 s spins on a server that is gone
        timeout_s = _positive_float("kvxfer.timeout_s", extra.get("kvxfer.timeout_s", 5.0), MAX_TIMEOUT_S, 0.01)
        load_timeout_s = _load_timeout(extra.get("kvxfer.load_timeout_ms", 0))
        if load_timeout_s >= timeout_s:
            raise ConfigError(f"kvxfer.load_timeout_ms ({load_timeout_s * 1000:g} ms) must be below kvxfer.timeout_s "
                              f"({timeout_s:g} s): a load still waiting for the server at kvxfer.timeout_s fails as a "
                              "server error (kvxfer.on_server_error), not as a late load; lower the one or raise "
                              "the other")
        return cls(
            url=url,
            transport=transport,
            chunk_size=chunk_size,
            timeout_s=timeout_s,
            # a lease of less than 10 ms lapses before any load could use it (1e-300 meant no lease)
            lease_s=_positive_float("kvxfer.lease_s", extra.get("kvxfer.lease_s", 60.0), MAX_LEASE_S, 0.01),
            load_timeout_s=load_timeout_s,
            on_server_error=on_error,
            retry_s=_positive_float("kvxfer.retry_s", extra.get("kvxfer.retry_s", 5.0), MAX_RETRY_S, 0.1),
            model_name=model_name,
            fingerprint=fingerprint,
            layout=layout,
            layerwise=layerwise,
            prefetch=prefetch,
            curve_dir=_curve_dir(extra.get("kvxfer.curve_dir"), url),
            curve_name=_curve_name(extra.get("kvxfer.curve_name", "client"),
                                   "kvxfer.curve_name" in extra and extra.get("kvxfer.curve_dir") is None),
            kv_role=kv_role,  # type: ignore[arg-type]  # validated against the Literal just above
            block_size=block_size,
            world_size=world_size,
            rank=rank,
        )


def _default_model_name(model_config: Any, cache_config: Any) -> str:
    """``<model>@<kv dtype>``: engines that store KV of another dtype must not share keys."""
    model = str(getattr(model_config, "model", "") or "")
    if not model:
        return ""
    kv_dtype = getattr(cache_config, "cache_dtype", None)
    if not kv_dtype or kv_dtype == "auto":
        kv_dtype = getattr(model_config, "dtype", None)
    return f"{model}@{str(kv_dtype).removeprefix('torch.')}" if kv_dtype else model


def _engine_world_size(parallel: Any) -> int:
    """The ranks of one engine: tensor x pipeline x prefill-context parallel sizes. vLLM's
    ``world_size`` counts the data-parallel replicas too under the external launcher, and a
    chunk would then count as present only once every replica's ranks had stored it."""
    tp, pp, pcp = (getattr(parallel, f"{kind}_parallel_size", None)
                   for kind in ("tensor", "pipeline", "prefill_context"))
    if isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0:
        return tp * pp * (pcp if isinstance(pcp, int) and pcp > 0 else 1)
    return int(getattr(parallel, "world_size", 1) or 1)


def _load_timeout(value: Any) -> float:
    """Numbers may come as strings (``--kv-transfer-config`` JSON written by hand), as for every key."""
    try:
        ms = _number(value)
    except (TypeError, ValueError, OverflowError):
        ms = math.nan
    if isinstance(value, bool) or not math.isfinite(ms) or ms < 0:
        raise ConfigError(f"kvxfer.load_timeout_ms must be a non-negative number of milliseconds (0: no deadline), "
                          f"got {value!r}")
    return ms / 1000.0


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,18}\s*", value):  # as written in JSON by hand: "256"
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}"[:300])
    return value


def _curve_dir(value: Any, url: str) -> str | None:
    """``kvxfer.curve_dir``: a directory's path (``~`` expanded), or left out (None); only for a
    ``tcp://`` server (an ``ipc://`` one checks its peers by their uid, and takes no keys)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(f"kvxfer.curve_dir must be the path of a directory of keys from `kvxfer keys`, got "
                          f"{value!r}"[:300])
    if not url.startswith("tcp://"):
        raise ConfigError(f"kvxfer.curve_dir is set but kvxfer.url is {url[:200]!r}: CURVE keys are used only with a "
                          "tcp:// server (a local ipc:// server admits the engine's own user by its uid); leave "
                          "kvxfer.curve_dir out, or give the tcp:// address")
    return os.path.expanduser(value)


def _curve_name(value: Any, without_dir: bool = False) -> str:
    """``kvxfer.curve_name``: a client key pair's name, as ``kvxfer keys --client NAME`` takes it
    (given ``without_dir``, i.e. without ``kvxfer.curve_dir``, it would never be read: refused)."""
    from kvxfer.security import check_client_name

    if not isinstance(value, str):
        raise ConfigError(f"kvxfer.curve_name must be a client key pair's name, got {value!r}"[:300])
    try:
        name = check_client_name(value)
    except ConfigError as exc:
        raise ConfigError(f"kvxfer.curve_name: {exc}") from None
    if without_dir:
        raise ConfigError("kvxfer.curve_name is set without kvxfer.curve_dir, the directory of keys it names a pair "
                          "in: set kvxfer.curve_dir too (a tcp:// server), or leave kvxfer.curve_name out")
    return name


def _number(value: Any) -> float:
    """``value`` as a float: a number, or a string of one in ASCII (JSON written by hand)."""
    if isinstance(value, str) and not _NUMBER.fullmatch(value):
        raise ValueError(value)
    return float(value)


def _positive_float(key: str, value: Any, most: float = math.inf, least: float = 0.0) -> float:
    """Seconds in (0, ``most``], or in [``least``, ``most``] with ``least``."""
    upto = f" up to {most:g}" if most < math.inf else ""
    what = f"a number of seconds from {least:g}{upto}" if least else f"a positive number of seconds{upto}"
    try:
        out = _number(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key} must be {what}, got {value!r}"[:300]) from None
    if isinstance(value, bool) or not math.isfinite(out) or not 0 < out <= most or out < least:
        raise ConfigError(f"{key} must be {what}, got {value!r}"[:300])
    return out
