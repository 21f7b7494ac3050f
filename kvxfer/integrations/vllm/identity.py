"""The identity chunks are stored under: everything that makes two engines' KV bytes compatible.

Both connector sides derive it from vLLM's config alone (the scheduler looks chunks up under it,
each worker registers its KV cache under it), so they agree without talking:

* the model and its revision — the **weights fingerprint** (:func:`weights_fingerprint`): for a
  model directory, or a Hub model found in the local Hugging Face cache, a BLAKE2b hash of
  ``config.json`` and of each weight file's name and size and of samples of its bytes (content,
  not paths or times: two copies of one model agree, a fine-tune or another seed does not): of a
  ``.safetensors`` file, each tensor's name, dtype, shape and offsets, and the first and last
  4 KiB of its data (of at most 8,192 tensors per file, evenly spread; a fine-tune changes every
  element of what it trains, so those bytes too), of another file its first and last MiB and
  64 KiB every 1/64 of it between. A change that misses every sample goes unseen (rows of an
  embedding trained alone, say): name such a fine-tune apart with ``kvxfer.model_name``. For a
  Hub model whose weights are in neither vLLM's ``--download-dir`` nor the local cache, its id
  and the revision given (a branch name is not resolved);
* the model config's overrides at run time (``hf_overrides``: a ``rope_theta`` or an
  ``rms_norm_eps`` given to vLLM changes every KV byte, while ``config.json`` on disk stays), and
  a config read from elsewhere (``--hf-config-path``: its ``config.json``'s fingerprint);
* weights not read from the model's files: ``--load-format dummy`` (random weights) or a loader
  that reads them from elsewhere (tensorizer, a streamer): the format (which weights it read
  is not known here: name those apart with ``kvxfer.model_name``);
* the dtype, the KV cache dtype and the quantization method;
* the number of layers (all stages), KV heads per rank, head size, block size, the resolved
  ``KVCacheLayout`` and each KV cache group's spec (type, block size, heads, head size, dtype,
  sliding window);
* tensor- and pipeline-parallel sizes (the rank is part of every key already).

The identity is ``<label>#<16 hex digits>``, the label being ``kvxfer.model_name`` (a readable
name for ``kvxfer status``; default ``<model>@<kv dtype>``). With ``kvxfer.fingerprint`` off it is
the label alone, and sharing chunks is the operator's responsibility (the server still refuses
to mix chunk formats under one identity).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Final

from kvxfer.mq.throttled_log import ThrottledLog

__all__ = ["AdapterFingerprints", "kv_facts", "kv_identity", "weights_fingerprint"]

log = logging.getLogger("kvxfer.integrations.vllm")

#: Files whose content decides a model's weights.
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
#: Bytes hashed at each end of a weight file, and at each of _STRIDES points between.
_SAMPLE: Final = 1 << 20
_STRIDE_SAMPLE: Final = 64 << 10
_STRIDES: Final = 64
#: Bytes hashed at each end of each sampled tensor of a safetensors file, and the most tensors
#: sampled per file (two reads each: a mixture-of-experts file may hold tens of thousands).
_TENSOR_SAMPLE: Final = 4 << 10
_MAX_TENSORS: Final = 8192
#: Largest safetensors header read (the format's own readers refuse 100 MB).
_MAX_HEADER: Final = 100_000_000


def _hash_file(h: Any, path: Path, rel: str) -> None:
    size = path.stat().st_size
    h.update(f"{rel}\0{size}\0".encode())
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and _hash_tensors(h, f, size):
            return
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            for k in range(1, _STRIDES):
                f.seek(size * k // _STRIDES)
                h.update(f.read(_STRIDE_SAMPLE))
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))


def _file_digest(path: Path, rel: str) -> str:
    """:func:`_hash_file` of one file alone, as hex digits."""
    h = hashlib.blake2b(digest_size=16)
    _hash_file(h, path, rel)
    return h.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    """The weight files under the directory ``path``, in a stable order."""
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def _hash_tensors(h: Any, f: Any, size: int) -> bool:
    """A safetensors file by its tensors (see the module docstring); False, having hashed nothing,
    if its header does not read as one (the file is then sampled as any other)."""
    try:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
            return False
        header = json.loads(f.read(n))
        tensors = sorted(((v["data_offsets"][0], v["data_offsets"][1], k, v["dtype"], v["shape"])
                          for k, v in header.items() if k != "__metadata__"), key=lambda t: (t[0], t[2]))
        base = 8 + n
        if any(not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= size - base)
               for b, e, *_ in tensors):
            return False
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return False
    h.update(b"safetensors\0")
    every = -(-len(tensors) // _MAX_TENSORS)
    for i, (begin, end, name, dtype, shape) in enumerate(tensors):
        h.update(f"{name}\0{dtype}\0{shape}\0{begin}\0{end}\0".encode())
        if i % every:
            continue
        f.seek(base + begin)
        h.update(f.read(min(_TENSOR_SAMPLE, end - begin)))
        if end - begin > _TENSOR_SAMPLE:
            f.seek(base + max(begin + _TENSOR_SAMPLE, end - _TENSOR_SAMPLE))
            h.update(f.read(end - max(begin + _TENSOR_SAMPLE, end - _TENSOR_SAMPLE)))
    return True


def _local_fingerprint(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    if path.is_file():  # a single-file model (e.g. GGUF)
        _hash_file(h, path, path.name)
        return h.hexdigest()
    config = path / "config.json"
    if config.is_file():
        _hash_file(h, config, "config.json")
    files = _weight_files(path)
    for p in files:
        _hash_file(h, p, p.relative_to(path).as_posix())
    return h.hexdigest()


def weights_fingerprint(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """What identifies ``model``'s weights (see the module docstring). Reads 8 KiB per sampled
    tensor of a safetensors file (64 MiB at most), at most 6 MiB of another; never downloads
    anything. A Hub model is looked for in ``download_dir`` (vLLM's ``--download-dir``), then in
    the default cache; a snapshot there without weight files (vLLM keeps a model's
    ``config.json`` in the default cache when its weights went to ``--download-dir``) does not
    name the weights, and the id and revision do."""
    path = Path(model).expanduser()
    if path.exists():
        return "local:" + _local_fingerprint(path)
    hub = f"hub:{model}@{revision or 'main'}"
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 (optional)
    except ImportError:
        return hub
    for cache_dir in ([download_dir] if download_dir else []) + [None]:
        try:
            snapshot = Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True,
                                              cache_dir=cache_dir))
        except Exception:  # noqa: BLE001  (not cached, no hub library, an unusual repo id)
            continue
        if snapshot.is_file() or _weight_files(snapshot):
            return "local:" + _local_fingerprint(snapshot)
    return hub


#: Seconds between two looks at a LoRA adapter's files (names, sizes, times): a change is seen
#: within it, and in between a request's salt costs a dictionary lookup.
ADAPTER_RECHECK_S: Final = 2.0
#: Adapters whose fingerprints are kept (the least recently used beyond it are read again).
MAX_ADAPTERS: Final = 1024
#: A file modified less than this many seconds before a look may change again within its
#: timestamp's grain (ticks of 1-4 ms on many kernels): the next look compares contents.
_RACY_S: Final = 2.0


def _adapter_files(path: Path) -> tuple[tuple[str, int, int, int], ...] | None:
    """What tells that an adapter's files changed: each weight file's and ``adapter_config.json``'s
    name, size, modification time and inode; None for a path that is no file or directory here."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name == "adapter_config.json"))
    else:
        return None
    out = []
    for f in files:
        st = f.stat()
        out.append((f.as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _adapter_fingerprint(path: str, where: Path) -> str:
    fingerprint = weights_fingerprint(path)
    config = where / "adapter_config.json"
    if config.is_file():
        fingerprint += ":" + _file_digest(config, config.name)
    return fingerprint


@dataclasses.dataclass
class _Adapter:
    looked_at: float
    files: Any
    fingerprint: str | None
    racy: bool


class AdapterFingerprints:
    """What identifies each LoRA adapter a request names (:meth:`get`): its weights, as
    :func:`weights_fingerprint` samples them, and its ``adapter_config.json``, read the first
    time a request names its path (when vLLM loads it).

    Which version of an adapter's files vLLM's workers hold is not known here: they read them
    again only when they reload the adapter (``load_inplace``, or after evicting it past
    ``--max-cpu-loras``). So once an adapter's files are seen changed (looked at every
    ``recheck_s`` at most), its requests' KV is neither looked up nor stored until the engine
    restarts, and a warning says so: give each version of an adapter a path of its own. The
    same holds for an adapter whose files cannot be read, or a local path that is gone. A Hub id
    (no such path here) is fingerprinted once, as vLLM downloads it once (any thread)."""

    def __init__(self, recheck_s: float = ADAPTER_RECHECK_S, capacity: int = MAX_ADAPTERS) -> None:
        self.recheck_s = recheck_s
        self.capacity = capacity
        self._lock = threading.Lock()
        #: path -> what was seen of it, least recently used first.
        self._known: collections.OrderedDict[str, _Adapter] = collections.OrderedDict()
        self._throttled = ThrottledLog(log)

    def get(self, path: str) -> str | None:
        """The fingerprint of the adapter at ``path``, or None: move no KV for its requests."""
        now = time.monotonic()
        with self._lock:
            known = self._known.get(path)
            if known is not None:
                self._known.move_to_end(path)
                # (None: no KV moved until restart; no files: a Hub id, fingerprinted once)
                if known.fingerprint is None or known.files is None or now - known.looked_at < self.recheck_s:
                    return known.fingerprint
        seen = self._look(path, known)
        with self._lock:
            self._known[path] = seen
            self._known.move_to_end(path)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)
        return seen.fingerprint

    def _look(self, path: str, known: _Adapter | None) -> _Adapter:
        now, wall = time.monotonic(), time.time_ns()
        try:
            where = Path(path).expanduser()
            files = _adapter_files(where)
            if files is None and (known is not None or where.is_absolute() or path.startswith((".", "~"))):
                raise OSError(f"no adapter at {path}")  # (a local path: a Hub id has no slash first)
            if known is not None and files == known.files and not known.racy:
                return _Adapter(now, files, known.fingerprint, False)
            fingerprint = _adapter_fingerprint(path, where)
            if files is not None and files != _adapter_files(where):
                raise OSError("its files changed while they were read")
            if known is not None and fingerprint != known.fingerprint:
                self._throttled.warning("adapter", f"kvxfer: the LoRA adapter at {path!r} changed on disk since this "
                                                   "engine first read it; which version vLLM holds is not known, so "
                                                   "its requests' KV is neither looked up nor stored until the engine "
                                                   "restarts: give each version of an adapter a path of its own")
                return _Adapter(now, files, None, False)
        except (OSError, RuntimeError, ValueError) as exc:  # (unreadable, gone, a stale NFS handle, ~nosuchuser)
            self._throttled.warning("adapter", f"kvxfer: cannot read the LoRA adapter at {path!r} ({exc}); its "
                                               "requests' KV is neither looked up nor stored")
            return _Adapter(now, None, None, False)
        racy = files is not None and any(wall - mtime < _RACY_S * 1e9 for _, _, mtime, _ in files)
        return _Adapter(now, files, fingerprint, racy)


def _group_facts(group: Any, stages: int) -> dict[str, Any]:
    """A KV cache group's spec as the scheduler and every worker see it alike: vLLM gives the
    scheduler the first layer's spec where a worker's group holds one spec per layer
    (``UniformTypeKVCacheSpecs``), and with ``stages`` pipeline stages each only its own layers
    (then the group's layer count is left out: the model's is in :func:`kv_facts`; a
    speculative decoder's draft layers, which groups hold too, are named by its config)."""
    spec = getattr(group, "kv_cache_spec", None)
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        spec = next(iter(inner.values()))
    facts: dict[str, Any] = {"spec": type(spec).__name__}
    for name in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window",
                 "attention_chunk_size", "page_size_padded", "kv_quant_mode", "cache_dtype_str"):
        value = getattr(spec, name, None)
        if value is not None:
            facts[name] = str(value)
    if stages == 1:
        facts["layers"] = len(getattr(group, "layer_names", ()) or ())
    return facts


def _speculative(vllm_config: Any) -> str:
    """The speculative decoder, whose draft layers' KV is in the KV cache groups: its method,
    draft model and tokens per step ("" without one)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    return "|".join(str(getattr(spec, name, None)) for name in ("method", "model", "num_speculative_tokens"))


def _overrides(model: Any) -> str:
    """``model_config.hf_overrides`` as a stable string: a dict (nested too) as sorted JSON, a
    function by its module and qualified name (what it returns cannot be read without a config)."""
    overrides = getattr(model, "hf_overrides", None)
    if not overrides:
        return ""
    if callable(overrides):
        return f"fn:{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides, sort_keys=True, default=str)


#: Load formats that read the weights from the model's own files (those the fingerprint samples).
_FROM_MODEL_FILES: Final = frozenset({"auto", "hf", "pt", "safetensors", "npcache", "fastsafetensors", "gguf",
                                      "bitsandbytes", "mistral", "instanttensor"})


def _loaded(vllm_config: Any) -> str:
    """How the weights were loaded when not from the model's own files: random weights
    (``--load-format dummy``, benchmarks) or weights from elsewhere (tensorizer, a streamer, a
    sharded state); "" otherwise. The format alone: the loader's extra settings may differ by
    rank (tensorizer rewrites its URI per rank in place, after the scheduler read it) or by host
    (addresses, credentials), which would split one engine's identity."""
    load = getattr(vllm_config, "load_config", None)
    fmt = getattr(load, "load_format", None)
    fmt = str(getattr(fmt, "value", fmt) or "auto")
    return "" if fmt in _FROM_MODEL_FILES else fmt


def _config_file(model: Any) -> str:
    """The model config vLLM read when it is not the model's own (``--hf-config-path``): a
    fingerprint of that directory's ``config.json`` (or of the file named), else the name as
    given; "" without one."""
    given = getattr(model, "hf_config_path", None)
    if not given:
        return ""
    path = Path(str(given)).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if path.is_file():
        return "local:" + _file_digest(path, "config.json")
    return f"named:{given}"


def kv_facts(vllm_config: Any, kv_cache_config: Any = None) -> dict[str, Any]:
    """The facts :func:`kv_identity` hashes, from vLLM's config (attributes only)."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)

    def call(obj: Any, name: str, *args: Any) -> Any:
        fn = getattr(obj, name, None)
        try:
            return fn(*args) if callable(fn) else None
        except Exception:  # noqa: BLE001  (a partial config, e.g. in tests)
            return None

    name = str(getattr(model, "model", "") or "")
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cache, "kv_cache_layout", None)
    return {
        "weights": weights_fingerprint(name, getattr(model, "revision", None),
                                       getattr(getattr(vllm_config, "load_config", None), "download_dir", None))
        if name else "",
        "hf_overrides": _overrides(model),
        **({"loaded": loaded} if (loaded := _loaded(vllm_config)) else {}),  # (absent: identities as before)
        **({"hf_config": cfg} if (cfg := _config_file(model)) else {}),
        "dtype": str(getattr(model, "dtype", "")),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "")),
        "quantization": str(getattr(model, "quantization", None)),
        "layers": call(model, "get_total_num_hidden_layers"),
        "kv_heads": call(model, "get_num_kv_heads", parallel),
        "head_size": call(model, "get_head_size"),
        "use_mla": bool(getattr(model, "use_mla", False)),
        "block_size": getattr(cache, "block_size", None),
        "kv_cache_layout": str(layout),
        "groups": [_group_facts(g, getattr(parallel, "pipeline_parallel_size", 1) or 1)
                   for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()],
        "speculative": _speculative(vllm_config),
        "tensor_parallel_size": getattr(parallel, "tensor_parallel_size", 1),
        "pipeline_parallel_size": getattr(parallel, "pipeline_parallel_size", 1),
        "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1),
    }


def kv_identity(label: str, vllm_config: Any, kv_cache_config: Any = None, fingerprint: bool = True) -> str:
    """``<label>#<fingerprint of kv_facts>``, or ``label`` with ``fingerprint=False``."""
    if not fingerprint:
        return label
    facts = json.dumps(kv_facts(vllm_config, kv_cache_config), sort_keys=True, default=str)
    return f"{label}#{hashlib.blake2b(facts.encode(), digest_size=8).hexdigest()}"
