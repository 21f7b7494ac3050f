"""The kvxfer command against a real server: plugins, status (table and --json), python -m.

The console script and ``python -m kvxfer`` run as real subprocesses; error paths and the plugin
table call ``kvxfer.cli.main`` in this process (same code, no interpreter start-up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.cli import main
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv

KVXFER = Path(sys.executable).with_name("kvxfer")


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvxfer", *args] if module else [str(KVXFER), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def registered(server):
    """A registered context with two stored chunks, kept for the module."""
    from kvxfer import CacheClient, chunk_hashes

    c = CacheClient(server.url)
    kv = c.register(flash_attn_kv(), model_name="cli-model", block_size=BLOCK_SIZE, transport="cpu_gather")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE)
    assert kv.submit_store(hashes, list(range(2 * BLOCKS_PER_CHUNK))).result(30).ok
    assert c.lookup("cli-model", hashes=hashes) == 2
    yield kv
    kv.close()
    c.close()


def test_console_script_is_installed() -> None:
    assert KVXFER.exists(), f"{KVXFER} missing: is the core installed (scripts/setup.sh)?"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import kvxfer
    from kvxfer.protocol.messages import PROTOCOL_VERSION

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kvxfer {kvxfer.__version__}, wire protocol {PROTOCOL_VERSION}\n"


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """``kvxfer plugins | head -1``: the reader is gone before the table is written."""
    proc = subprocess.Popen([str(KVXFER), "plugins"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has started
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_plugins_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "entry point group kvxfer.transports" in lines[0]
    header = next(line for line in lines if line.startswith("name"))
    assert header.split() == ["name", "version", "distribution", "api", "style", "production", "health"]
    [row] = [line for line in lines if line.startswith("cpu_gather ")]
    assert row.split()[1:] == ["0.1.0", "kvxfer-cpu-gather", "2", "client_driven", "yes", "available"]
    [row] = [line for line in lines if line.startswith("file_debug ")]
    assert row.split()[5:] == ["no", "available"]
    # the test-only plugin is installed only where tests/core/test_plugins.py puts it
    assert not [line for line in lines if line.startswith("test_")]


def test_console_script_plugins_json() -> None:
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    [cpu] = [p for p in report["transports"] if p["name"] == "cpu_gather"]
    assert cpu["health"] == "available" and cpu["distribution"] == "kvxfer-cpu-gather"
    assert cpu["production"] is True
    assert [p["production"] for p in report["transports"] if p["name"] == "file_debug"] == [False]
    # the transports' style and production flag are no store's: a store showed "production": false
    [fs] = [p for p in report["stores"] if p["name"] == "fs"]
    assert fs["health"] == "available" and fs["api_version"] == 1
    assert not {"style", "production"} & set(fs), fs


def test_status_table(server, registered) -> None:
    proc = run("status", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"at {server.url}, pid {server.pid}" in out and f"chunk size {CHUNK_SIZE}" in out
    # the registered client's session, not the one `kvxfer status` opened to ask
    assert out.splitlines()[0].endswith(", 1 session besides this one"), out
    assert "arena:" in out and "32.0 MiB used" in out and "lookups:" in out
    header = next(line for line in out.splitlines() if line.startswith("instance"))
    assert header.split() == ["instance", "model", "world", "rank", "transport", "layout", "layers", "block",
                              "hidden", "dtype", "mla", "blocks", "pid"]
    [row] = [line for line in out.splitlines() if line.startswith(f"{registered.instance_id} ")]
    assert row.split()[1:] == ["cli-model", "1", "0", "cpu_gather", "flash_attn", "2", str(BLOCK_SIZE), "16",
                               "bfloat16", "no", "32", str(os.getpid())]
    assert any(line.startswith("cpu_gather") and "client_driven" in line for line in out.splitlines())


def test_status_json(server, registered) -> None:
    proc = run("status", "--url", server.url, "--json", module=True)
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["url"] == server.url and st["pid"] == server.pid and st["chunk_size"] == CHUNK_SIZE
    assert st["sessions"] == 2  # the server's own count: the registered client's and this command's
    [ctx] = [c for c in st["contexts"] if c["instance_id"] == registered.instance_id]
    assert ctx["model_name"] == "cli-model" and ctx["layout"] == "flash_attn" and ctx["num_layers"] == 2
    assert st["arena"]["chunks"] >= 2 and st["lookup_hits"] >= 2
    assert {"leases", "leased_chunks", "reservations", "errors", "hook_errors", "sections"} <= set(st)


def test_status_without_a_server_says_how_to_start_one_at_once(tmp_path: Path, capsys) -> None:
    """No socket and no server holding its claim: nothing is on its way, so status and top say
    so without waiting their --timeout (an hour here)."""
    url = f"ipc://{tmp_path}/none.sock"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--url", url, "--timeout", "3600"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("kvxfer status: error:") and f"kvxfer serve --url {url}" in proc.stderr
    assert (f"no kvxfer server is listening at {url}, and none is starting: {tmp_path}/none.sock does not exist"
            in proc.stderr), proc.stderr
    url = f"ipc://{tmp_path}/nodir/none.sock"
    assert main(["top", "--url", url, "--timeout", "3600"]) == 2
    err = capsys.readouterr().err
    assert f"neither {tmp_path}/nodir/none.sock nor its directory exists" in err, err
    assert f"kvxfer serve --url {url}" in err
    assert "or, if one runs elsewhere, give its address (--url or $KVXFER_URL" in err, err  # a typo'd address
    # a misspelt socket name beside a real one: the message names the one that is there
    import socket

    with socket.socket(socket.AF_UNIX) as there:
        there.bind(str(tmp_path / "kvxfer.sock"))
        assert main(["status", "--url", f"ipc://{tmp_path}/kvxfer.soc", "--timeout", "3600"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/kvxfer.soc does not exist, but {tmp_path} holds kvxfer.sock (a misspelt name?)" in err, err
    assert "$XDG_RUNTIME_DIR" not in err, "an address given is no default"
    # among many sockets, the names closest to the one asked for (the first three the directory
    # listed left the right one out), and how many more there are
    others = [socket.socket(socket.AF_UNIX) for _ in range(5)]
    try:
        for i, s in enumerate(others):
            s.bind(str(tmp_path / f"a{i}.sock"))
        assert main(["status", "--url", f"ipc://{tmp_path}/kvxfer.soc", "--timeout", "3600"]) == 2
    finally:
        for s in others:
            s.close()
    err = capsys.readouterr().err
    assert f"{tmp_path} holds kvxfer.sock, a" in err and ".sock and 3 more (a misspelt name?)" in err, err


def test_status_at_the_default_address_says_where_that_comes_from(tmp_path: Path, monkeypatch, capsys) -> None:
    """The default socket's directory follows $XDG_RUNTIME_DIR, which a server started under
    sudo, by systemd or in a container may see otherwise: the message says so."""
    monkeypatch.delenv("KVXFER_URL", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert main(["status", "--timeout", "3600"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/kvxfer/kvxfer.sock" in err and "the default address, whose directory follows " \
        f"$XDG_RUNTIME_DIR, set to {tmp_path} here" in err, err


def test_status_at_a_socket_nobody_listens_on_says_it_is_stale(tmp_path: Path, capsys) -> None:
    """The socket file of a server killed before it could remove it: nothing accepts on it."""
    import socket

    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # closed without listening: the file stays, as a killed server's does
    assert main(["status", "--url", f"ipc://{path}", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "its socket file is left from a server that did not stop cleanly" in err, err
    assert f"start one with `kvxfer serve --url ipc://{path}` (it replaces the file)" in err


@pytest.mark.parametrize("command", ["status", "top"])
def test_status_at_a_socket_that_accepts_but_does_not_answer_says_wait(tmp_path: Path, capsys,
                                                                        command: str) -> None:
    """A process that listens and does not answer yet, as a ``kvxfer serve`` between binding its
    socket and its ready line (or a stopped one) does; here a plain listening Unix socket, the
    part of a server such a client meets. Nothing tells the user to start a second server."""
    import socket

    path = tmp_path / "starting.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()
        assert main([command, "--url", f"ipc://{path}", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvxfer {command}: error: a process listens at ipc://{path} but did not answer kvxfer's "
                          "handshake within 0.5 s: a `kvxfer serve` that is still starting"), err
    assert "--timeout S" in err and "start one" not in err and "kvxfer serve --url" not in err


@pytest.mark.parametrize("text, size", [("4GiB", 4 << 30), ("4G", 4 << 30), ("4gb", 4 * 1000**3), ("1.5 t", 3 << 39),
                                        ("1TB", 1000**4), ("2TiB", 2 << 40), ("512", 512)])
def test_sizes_as_people_write_them(text: str, size: int) -> None:
    """KiB and K are powers of 1024 (as docker's --shm-size reads them), KB powers of 1000, every
    unit up to T."""
    from kvxfer.units import parse_size

    assert parse_size(text) == size


def test_bad_arguments(capsys) -> None:
    assert main(["serve", "--l1-size", "lots"]) == 2
    err = capsys.readouterr().err
    assert "not a size: 'lots'" in err and "4G (4 x 1024^3 bytes), 4GB (4 x 1000^3)" in err, err
    with pytest.raises(SystemExit) as info:
        main(["nonsense"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # a misspelt option: the subcommand's usage, not kvxfer's
        main(["serve", "--l1size", "4GiB"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "kvxfer serve: error: unrecognized arguments: --l1size 4GiB" in err, err
    assert "usage: kvxfer serve" in err and "--l1-size" in err, err
    assert main(["serve", "--shm-dir", "", "--l1-size", "8MiB"]) == 2  # the arena went to the current directory
    assert "--shm-dir is empty" in capsys.readouterr().err


def test_every_option_says_what_it_does() -> None:
    """``kvxfer COMMAND --help`` explains each option; ``serve --help`` says the arena is
    allocated whole at start-up (a large one takes a while before the server answers)."""
    import argparse

    from kvxfer.cli import build_parser

    from kvxfer.bench import build_parser as bench_parser
    from kvxfer.bench_prefix import build_parser as prefix_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    # `kvxfer bench` hands its arguments to the benchmark's own parsers
    parsers = {**sub.choices, "bench": bench_parser(), "bench --prefix": prefix_parser()}
    silent = [f"{name} {'/'.join(action.option_strings)}" for name, parser in parsers.items()
              for action in parser._actions if action.option_strings and action.help is None]
    assert not silent, f"options without help: {silent}"
    serve_help = " ".join(sub.choices["serve"].format_help().split())
    assert "allocated in --shm-dir and faulted in at start-up" in serve_help


def test_serve_says_when_it_stopped() -> None:
    """SIGTERM ends ``kvxfer serve`` with exit code 0 and a last line that says so (its log
    otherwise ends with whatever it did last)."""
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="16MiB") as server:
        assert server.stop() == 0
        assert f"kvxfer server at {server.url} stopped" in server.log().splitlines()[-1]


def _imported(importtime: str) -> set[str]:
    """Every module ``python -X importtime`` reported importing (its stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["plugins", "--json"], ["status"], ["status", "--json"],
                                  ["top", "--once"]], ids=" ".join)
def test_cli_does_not_import_torch(server, registered, args: list[str]) -> None:
    """``python -m kvxfer`` lists every installed plugin (loading and probing each) and reports
    a real server without importing torch (it takes about a second to import)."""
    if args[0] in ("status", "top"):
        args = [*args, "--url", server.url]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvxfer", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # (a broken plugin: on stdout)
    imported = _imported(proc.stderr)
    assert "kvxfer.cli" in imported  # what -X importtime reports is read right
    assert not sorted(m for m in imported if m.split(".")[0] == "torch"), "torch was imported"
    if args == ["plugins", "--json"]:
        listed = json.loads(proc.stdout)
        plugins = [*listed["transports"], *listed["stores"]]
        assert {"cpu_gather", "fs"} <= {p["name"] for p in plugins}
        loaded = {p["target"].split(".")[0].split(":")[0] for p in plugins}
        assert loaded <= {m.split(".")[0] for m in imported}  # every plugin's package was imported
        from kvxfer.store.registry import list_stores
        from kvxfer.transport.registry import list_plugins

        here = {p.name: (p.health, p.style, p.production) for p in list_plugins()}  # torch imported
        here.update({p.name: (p.health,) for p in list_stores()})
        assert {p["name"]: (p["health"], p["style"], p["production"]) for p in listed["transports"]} | \
            {p["name"]: (p["health"],) for p in listed["stores"]} == {
            name: here[name] for name in here if not name.startswith("test_")}
    else:
        assert {"--help": "usage: kvxfer", "plugins": "cpu_gather"}.get(args[0], "cli-model") in proc.stdout


def test_package_root_does_not_import_torch() -> None:
    """``import kvxfer`` and its eager names leave torch alone; the data path's load on first use."""
    code = ("import sys, kvxfer; kvxfer.CacheClient, kvxfer.chunk_hashes, kvxfer.KvxferError, kvxfer.hookimpl, "
            "kvxfer.__version__; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_lazy_names_still_resolve() -> None:
    import kvxfer

    assert kvxfer.KVLayout.__name__ == "KVLayout" and kvxfer.TransferContext.__name__ == "TransferContext"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvxfer.nope  # noqa: B018  (the access is the test)


@pytest.mark.parametrize("url", ["http://x", "ipc://", "tcp://", "tcp://host", "tcp://127.0.0.1:99999",
                                 "tcp://127.0.0.1:0", "redis://127.0.0.1:6379", f"ipc:///tmp/{'a' * 256}/k.sock"])
def test_a_bad_kvxfer_url_is_named_not_a_traceback(url: str) -> None:
    """$KVXFER_URL (and --url) once reached ZeroMQ unchecked: a traceback of ZMQError."""
    out = subprocess.run([str(KVXFER), "status", "--timeout", "1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVXFER_URL": url})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "not a kvxfer server address" in out.stderr
    assert "$KVXFER_URL" in out.stderr


def test_a_relative_xdg_runtime_dir_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The XDG spec: a relative XDG_RUNTIME_DIR is ignored (it made the default url relative,
    refused as such without naming the variable)."""
    from kvxfer.urls import default_url

    monkeypatch.delenv("KVXFER_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")
    assert default_url() == f"ipc:///tmp/kvxfer-{os.getuid()}/kvxfer.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert default_url() == f"ipc://{tmp_path}/run/kvxfer/kvxfer.sock"


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_a_bad_client_timeout_is_named(timeout: str, capsys) -> None:
    assert main(["status", "--url", "ipc:///nonexistent/kvxfer.sock", "--timeout", timeout]) == 2
    assert f"--timeout must be a positive number of seconds of at most 3.1536e+07, got {float(timeout)!r}" \
        in capsys.readouterr().err


def test_the_vllm_connector_checks_its_url() -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    for bad in ("http://x", "tcp://host", 5):
        with pytest.raises(ConfigError, match="kvxfer.url"):
            ConnectorConfig.from_mapping({"kvxfer.url": bad}, **args)
    for pasted in ("ipc:///tmp/x/k.sock ", " ipc:///tmp/x/k.sock", "tcp://10.0.0.5:5555\t"):  # waited 5 s, then
        with pytest.raises(ConfigError, match="kvxfer.url: .*begins or ends with white space"):  # named a path
            ConnectorConfig.from_mapping({"kvxfer.url": pasted}, **args)  # whose trailing space no one sees
    assert ConnectorConfig.from_mapping({"kvxfer.url": "tcp://10.0.0.5:5555"}, **args).url == "tcp://10.0.0.5:5555"


def test_the_vllm_connector_prefetches_unless_it_loads_layer_by_layer() -> None:
    """A layer-by-layer load copies each chunk's layers apart and takes nothing a prefetch
    staged (its copies carry no stamp): the prefetch's copies would only run ahead of it."""
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    assert ConnectorConfig.from_mapping({}, **args).prefetch
    assert not ConnectorConfig.from_mapping({"kvxfer.layerwise": True}, **args).prefetch
    assert not ConnectorConfig.from_mapping({"kvxfer.prefetch": "false"}, **args).prefetch
    with pytest.raises(ConfigError, match="kvxfer.prefetch is true with kvxfer.layerwise.*set kvxfer.prefetch false"):
        ConnectorConfig.from_mapping({"kvxfer.layerwise": True, "kvxfer.prefetch": True}, **args)


def test_the_vllm_connector_reads_booleans_alike_and_names_a_misspelt_key() -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    assert not ConnectorConfig.from_mapping({"kvxfer.fingerprint": "false"}, **args).fingerprint
    assert ConnectorConfig.from_mapping({"kvxfer.fingerprint": True}, **args).fingerprint
    with pytest.raises(ConfigError, match="'kvxfr.url' is not kvxfer's; did you mean 'kvxfer.url'"):
        ConnectorConfig.from_mapping({"kvxfr.url": "ipc:///tmp/x/k.sock"}, **args)
    with pytest.raises(ConfigError, match="'url' is not kvxfer's; did you mean 'kvxfer.url'"):  # the prefix left out
        ConnectorConfig.from_mapping({"url": "ipc:///tmp/x/k.sock"}, **args)
    assert ConnectorConfig.from_mapping({"other_connector.option": 1}, **args)  # another's key: not ours to judge
    # keys meant for kvxfer, written another way, were ignored: the connector used the default socket
    with pytest.raises(ConfigError, match="key 'kvxfer' holds a mapping: kvxfer's keys are not nested, each is a key "
                                          "of its own \\(\"kvxfer.url\": ...\\)"):
        ConnectorConfig.from_mapping({"kvxfer": {"url": "ipc:///tmp/x/k.sock"}}, **args)
    for key, meant in (("KVXFER_URL", "kvxfer.url"), ("kvxfer_transport", "kvxfer.transport"),
                       ("kvxfer-lease_s", "kvxfer.lease_s")):
        with pytest.raises(ConfigError, match=f"'{key}' is not kvxfer's; did you mean '{meant}'"):
            ConnectorConfig.from_mapping({key: "x"}, **args)
    with pytest.raises(ConfigError, match="key 'kvxfer' holds a mapping: .*\\(\"kvxfer.transport\": ..., "
                                          "\"kvxfer.lease_s\": ...\\)"):  # named as kvxfer reads them, or left out
        ConnectorConfig.from_mapping({"kvxfer": {"kvxfer.transport": 1, "nonsense": 2, "lease_s": 3}}, **args)
    with pytest.raises(ConfigError, match="'KVXFER' is not kvxfer's; kvxfer knows kvxfer.url, "):
        ConnectorConfig.from_mapping({"KVXFER": "ipc:///tmp/x/k.sock"}, **args)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key\\(s\\) 'KVXFER.lease' \\(did you "
                                          "mean 'kvxfer.lease_s'\\?\\)"):  # another case, no known key
        ConnectorConfig.from_mapping({"KVXFER.lease": 1}, **args)
    for theirs in ("kvxferish", "kvxfer_proxy.endpoint"):  # another connector's: not ours to judge
        assert ConnectorConfig.from_mapping({theirs: 1}, **args)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key\\(s\\) 'kvxfer.lease' \\(did you "
                                          "mean 'kvxfer.lease_s'\\?\\), 'kvxfer.nonsense', 'kvxfer.timeout' \\(did "
                                          "you mean 'kvxfer.timeout_s'\\?\\)"):
        ConnectorConfig.from_mapping({"kvxfer.timeout": 7, "kvxfer.lease": 9, "kvxfer.nonsense": 1}, **args)
    with pytest.raises(ConfigError) as info:  # the names, not every key's help (vLLM prints it once a process)
        ConnectorConfig.from_mapping({"kvxfer.ulr": "ipc:///tmp/x/k.sock"}, **args)
    assert "kvxfer.url, kvxfer.transport" in str(info.value) and len(str(info.value)) < 800, str(info.value)


def test_the_vllm_connector_reads_numbers_written_as_strings_alike() -> None:
    """JSON written by hand on vLLM's command line may quote numbers: every numeric key takes them."""
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    c = ConnectorConfig.from_mapping({"kvxfer.chunk_size": "256", "kvxfer.load_timeout_ms": "2000",
                                      "kvxfer.timeout_s": "7", "kvxfer.lease_s": "30", "kvxfer.retry_s": "2.5"}, **args)
    assert (c.chunk_size, c.load_timeout_s, c.timeout_s, c.lease_s, c.retry_s) == (256, 2.0, 7.0, 30.0, 2.5)
    for key, bad in (("kvxfer.chunk_size", "256.5"), ("kvxfer.chunk_size", "-16"), ("kvxfer.chunk_size", True),
                     ("kvxfer.chunk_size", "\u00b2"), ("kvxfer.chunk_size", "9" * 5000),
                     ("kvxfer.load_timeout_ms", "soon"), ("kvxfer.load_timeout_ms", "-1"),
                     ("kvxfer.load_timeout_ms", "nan"), ("kvxfer.load_timeout_ms", 10**400),
                     ("kvxfer.timeout_s", 10**400)):
        with pytest.raises(ConfigError, match=key):
            ConnectorConfig.from_mapping({key: bad}, **args)
    # a load deadline past the server timeout would never be the one that ends a load
    with pytest.raises(ConfigError, match=r"kvxfer.load_timeout_ms \(10000 ms\) must be below kvxfer.timeout_s \(5 s\)"):
        ConnectorConfig.from_mapping({"kvxfer.load_timeout_ms": 10000}, **args)
    assert ConnectorConfig.from_mapping({"kvxfer.load_timeout_ms": 10000, "kvxfer.timeout_s": 11},
                                        **args).load_timeout_s == 10.0


def test_the_vllm_connector_refuses_names_and_leases_it_would_misread() -> None:
    """Values that were taken silently: an empty or false ``model_name`` meant the default one,
    a list as ``curve_dir`` became its text, a ``curve_name`` with a path in it read keys from
    outside the key directory, and a lease of 1e-300 s meant no lease at all."""
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    for key, bad, says in (("kvxfer.model_name", "", "must be a non-empty string"),
                           ("kvxfer.model_name", False, "must be a non-empty string"),
                           ("kvxfer.model_name", 0, "must be a non-empty string"),
                           ("kvxfer.curve_dir", ["a"], "must be the path of a directory"),
                           ("kvxfer.curve_dir", "", "must be the path of a directory"),
                           ("kvxfer.curve_name", "../x", "kvxfer.curve_name: client name '../x'"),
                           ("kvxfer.curve_name", 7, "must be a client key pair's name"),
                           ("kvxfer.lease_s", 1e-300, "kvxfer.lease_s must be a number of seconds from 0.01 up to 86400, got")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            ConnectorConfig.from_mapping({key: bad, "kvxfer.url": "tcp://h:5555"}, **args)
    c = ConnectorConfig.from_mapping({"kvxfer.curve_dir": "/k", "kvxfer.curve_name": "w1", "kvxfer.lease_s": 0.01,
                                      "kvxfer.url": "tcp://h:5555"}, **args)
    assert (c.model_name, c.curve_dir, c.curve_name, c.lease_s) == ("m", "/k", "w1", 0.01)


def test_the_vllm_connector_refuses_settings_that_would_be_ignored_or_misread() -> None:
    """Settings that were taken and did nothing or something else: CURVE keys for an ipc://
    server (which takes none: the operator believed the socket's traffic authenticated), a key
    pair's name with no key directory, ``~`` in the directory left unexpanded, a lease of 1e300 s,
    numbers that ``float()`` reads and JSON does not write ("1_0" for 10, other scripts' digits),
    kvxfer's keys without their prefix and misspelt (``timeout``, ``layer_wise``), labels that
    spell a name the connector makes (``X#<fingerprint>``, ``X/g1``), and a password in a server
    address, echoed in the error into vLLM's log."""
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.config import ConnectorConfig

    args = dict(kv_role="kv_both", block_size=16, world_size=1, rank=0, default_model_name="m")
    for given, says in (({"kvxfer.curve_dir": "/k"}, "CURVE keys are used only with a tcp:// server"),
                        ({"kvxfer.curve_dir": "/k", "kvxfer.url": "ipc:///tmp/s.sock"}, "only with a tcp://"),
                        ({"kvxfer.curve_name": "w1", "kvxfer.url": "tcp://h:1"}, "without kvxfer.curve_dir"),
                        ({"kvxfer.lease_s": 1e300}, "kvxfer.lease_s must be a number of seconds from 0.01 up to 86400"),
                        ({"kvxfer.lease_s": 10**300}, "up to 86400"),
                        ({"kvxfer.timeout_s": "1_0"}, "kvxfer.timeout_s must be"),
                        ({"kvxfer.retry_s": "\u0661\u0662"}, "kvxfer.retry_s must be"),
                        ({"kvxfer.load_timeout_ms": "1_00"}, "kvxfer.load_timeout_ms must be"),
                        ({"timeout": 10}, "did you mean 'kvxfer.timeout_s'"),
                        ({"lease": 10}, "did you mean 'kvxfer.lease_s'"),
                        ({"layer_wise": True}, "did you mean 'kvxfer.layerwise'"),
                        ({"load_timeout": 100}, "did you mean 'kvxfer.load_timeout_ms'"),
                        ({"kvxfer.model_name": "m#59fa774d069dd93d"}, "holds '#' or ends in '/g<N>'"),
                        ({"kvxfer.model_name": "m/g1"}, "holds '#' or ends in '/g<N>'"),
                        ({"kvxfer.url": "tcp://user:secretpw@h:1"}, "'tcp://***@h:1'"),
                        ({"kvxfer.url": "tcp://user:secret/pw@h:1"}, "'tcp://***@h:1'"),
                        ({"kvxfer.url": "user:secretpw@h:1"}, "'***@h:1'"),
                        ({"kvxfer.url": "user:secretpw@h:1/x://y"}, "'***@h:1/x://y'"),
                        ({"kvxfer.url": "ipc://user:secretpw@host"}, "ipc:///***@host")):
        with pytest.raises(ConfigError, match=re.escape(says)) as raised:
            ConnectorConfig.from_mapping(given, **args)
        assert "secret" not in str(raised.value)
    home = os.path.expanduser("~")
    ok = {"kvxfer.url": "tcp://h:1", "kvxfer.curve_dir": "~/keys", "kvxfer.timeout_s": " 10 ",
          "kvxfer.load_timeout_ms": "2.5e3", "kvxfer.lease_s": 86400, "kvxfer.model_name": "org/g1-base",
          "role": "another reader's key", "layer": 1}  # (short keys of others, not near misses of kvxfer's)
    c = ConnectorConfig.from_mapping(ok, **args)
    assert (c.curve_dir, c.timeout_s, c.load_timeout_s, c.lease_s, c.model_name) == \
        (f"{home}/keys", 10.0, 2.5, 86400.0, "org/g1-base")


@pytest.mark.parametrize("argv", [
    ("bench", "--transport", "nope", "--layers", "2", "--iters", "1"),
    ("bench", "--prefix", "--transport", "nope", "--layers", "2", "--iters", "1"),
    ("demo", "--transport", "nope", "--layers", "2", "--l1-size", "64MiB"),
    ("demo", "--nodes", "2", "--transport", "nope", "--layers", "2", "--l1-size", "64MiB"),
])
def test_an_unknown_transport_is_refused_in_one_line_before_any_server_starts(argv: tuple[str, ...]) -> None:
    proc = run(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"kvxfer {argv[0]}: error:" in proc.stderr and "'nope'" in proc.stderr and "cpu_gather" in proc.stderr
    assert "starting a kvxfer server" not in proc.stdout and "L2: a private" not in proc.stdout


@pytest.mark.parametrize(("argv", "says"), [
    (("bench", "--iters", "0"), "argument --iters: must be at least 1, got 0"),
    (("bench", "--inflight", "0"), "argument --inflight: must be at least 1, got 0"),
    (("bench", "--prefix", "--prefix-chunks", "0"), "argument --prefix-chunks: must be at least 1, got 0"),
    (("bench", "--device", "nodevice"), "argument --device: 'nodevice' is not usable here"),
    (("bench", "--json", "/proc/x.json"), "argument --json: cannot write into /proc"),
    (("demo", "--prompts", "0"), "argument --prompts: must be at least 1, got 0"),
])
def test_the_benchmarks_and_the_demo_refuse_values_they_cannot_run_with(argv: tuple[str, ...], says: str) -> None:
    proc = run(*argv)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_relative_shm_dir_and_spaces_in_the_transport_list_serve_as_meant(tmp_path: Path, monkeypatch) -> None:
    """The arena's path goes to clients, who map it from their own working directory: a relative
    --shm-dir is made absolute. "cpu_gather, hpu" names two transports."""
    import shutil
    import tempfile

    from kvxfer.client import CacheClient
    from kvxfer.testing.server import ServerProcess

    shm = Path(tempfile.mkdtemp(prefix="kvxfer-rel-", dir="/dev/shm"))
    try:
        with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather, hpu",
                           extra_args=["--shm-dir", os.path.relpath(shm)]) as server:
            assert "transports cpu_gather, hpu" in server.log()
            monkeypatch.chdir(tmp_path)  # a client elsewhere
            with CacheClient(server.url) as client:
                ctx = client.register(flash_attn_kv(), model_name="rel", block_size=BLOCK_SIZE, transport="cpu_gather")
                assert Path(client.status().arena.path).is_absolute()
                keys = [bytes([7]) * 16]
                assert ctx.submit_store(keys, list(range(BLOCKS_PER_CHUNK))).result(timeout=30).stored == [0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_missing_client_key_is_named_with_the_command_that_adds_it(tmp_path: Path) -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.security import load_client_keys, make_keys

    make_keys(tmp_path / "keys")
    with pytest.raises(ConfigError, match=f"add them with `kvxfer keys {tmp_path / 'keys'} --client bob`"):
        load_client_keys(tmp_path / "keys", "bob")


def test_the_demo_refuses_options_its_mode_would_ignore() -> None:
    two = run("demo", "--nodes", "2", "--url", "ipc:///tmp/kvxfer-none/kvxfer.sock")
    assert two.returncode == 2 and "--url: the two-host demo starts its own servers" in two.stderr
    one = run("demo", "--l2", "valkey")
    assert one.returncode == 2 and "--l2: only the two-host demo" in one.stderr


def test_a_benchmark_loads_on_its_own_server_the_transport_it_measures() -> None:
    """file_debug is not among a server's default transports: the server a benchmark starts
    loads the one it measures all the same."""
    proc = run("bench", "--prefix", "--transport", "file_debug", "--layers", "2", "--heads", "1",
               "--prefix-chunks", "1", "--iters", "1", "--blocks", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "file_debug" in proc.stdout


def test_a_second_server_at_a_served_socket_is_refused_before_it_makes_its_arena(server) -> None:
    """The check comes before the arena: here an arena larger than this host could ever make
    would fail otherwise, and a large one that fits would take seconds to fault in first."""
    proc = run("serve", "--url", server.url, "--l1-size", "64TiB")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"a server is already listening at {server.url}" in proc.stderr


def test_urls_that_name_no_socket_say_what_they_name(tmp_path: Path, capsys) -> None:
    """A directory given for the socket, an ordinary file, a relative ipc:// path: each error
    says what the url names instead of blaming something else."""
    (tmp_path / "run").mkdir(mode=0o700)
    assert main(["status", "--url", f"ipc://{tmp_path}/run", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"names the directory {tmp_path}/run, not a socket" in err and "kvxfer.sock" in err, err
    (tmp_path / "run" / "notes.txt").write_text("x")
    assert main(["status", "--url", f"ipc://{tmp_path}/run/notes.txt", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "is no server's socket" in err and "not of you" not in err, err
    assert main(["status", "--url", "ipc://tmp/kvxfer-0/kvxfer.sock", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "three slashes: ipc:///tmp/kvxfer-0/kvxfer.sock" in err, err
    assert f"in this directory, ipc://{os.getcwd()}/tmp/kvxfer-0/kvxfer.sock" in err, err


@pytest.mark.parametrize(("argv", "says"), [
    (("--l1-size", "10"), "--l1-size must be at least 4 KiB (a size takes a unit: 64MiB, 4GiB), got 10 bytes"),
    (("--chunk-size", "0"), "--chunk-size must be a positive number of tokens of at most 1048576, got 0"),
    (("--url", "ipc://relative.sock"), "an ipc:// url takes an absolute path"),
    # options that would do nothing: keys an ipc:// server never uses (the SIGHUP that kvxfer keys
    # --client then says to send ended it), a metrics address with no metrics served
    (("--url", "ipc:///tmp/kvxfer-cli-test/s.sock", "--curve-dir", "/tmp/keys"),
     "--curve-dir /tmp/keys: CURVE keys admit clients of a tcp:// server"),
    (("--metrics-host", "::"), "--metrics-host ::: no metrics are served without --metrics-port N"),
    (("--max-kv-cache-size", "foo"), "--max-kv-cache-size: not a size: 'foo' (examples: 4GiB"),
])
def test_serve_refuses_values_that_cannot_be_meant_by_their_flags_names(argv: tuple[str, ...], says: str) -> None:
    proc = run("serve", *argv)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


HUGE = "9" * 400


@pytest.mark.parametrize(("argv", "says"), [
    (("serve", "--l1-size", HUGE), "is more than any host holds"),
    (("serve", "--l1-size", "64MiB", f"--max-connections={HUGE}"), "--max-connections must be a positive number of at"),
    (("serve", "--l1-size", "64MiB", "--chunk-size", str(1 << 64)), "--chunk-size must be a positive number of tokens"),
    (("serve", "--url", "inproc://kv"), "an inproc:// server is reachable only from its own process"),
    (("status", "--timeout", "2e305"), "--timeout must be a positive number of seconds of at most"),
    (("status", "--url", "tcp://h:\u00b2"), "a tcp:// url is tcp://HOST:PORT"),
    (("status", "--url", "tcp://a b:5555"), "a tcp:// url is tcp://HOST:PORT"),
    (("status", "--url", "ipc:///tmp/a\nb"), "it holds a control character"),
    (("bench", "--layers", "99999999999999999999", "--heads", "1", "--head-size", "8", "--blocks", "64", "--iters",
      "1", "--chunks-per-request", "1"), "kvxfer takes at most 4096 layers"),
    (("bench", "--layers", "1", "--heads", "1", "--head-size", "8", "--blocks", "1000000000000", "--iters",
      "1", "--chunks-per-request", "1"), "the KV cache would take"),
    (("bench", "--prefix", "--layers", "1", "--heads", "1", "--head-size", "8", "--iters", "1", "--blocks",
      "1000000000000"), "the KV cache would take"),
])
def test_values_past_what_a_host_holds_are_one_line_errors(argv: tuple[str, ...], says: str) -> None:
    """Numbers too large for the host, or for the wire (a 64-bit integer), and addresses no
    client can reach: each a one-line error at once, never a traceback or a hang."""
    proc = run(*argv, module=True)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_serve_names_a_shm_dir_that_is_a_file_as_such(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    proc = run("serve", "--url", f"ipc://{tmp_path}/s/kvxfer.sock", "--l1-size", "8MiB", "--shm-dir", str(f))
    assert proc.returncode == 2 and f"shared-memory directory {f} is not a directory" in proc.stderr, proc.stderr


def test_a_shm_dir_that_is_not_tmpfs_is_served_with_a_warning(tmp_path: Path) -> None:
    from kvxfer.arena import filesystem_type
    from kvxfer.testing.server import ServerProcess

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    kind = filesystem_type(shm)
    if kind in (None, "tmpfs", "hugetlbfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind or 'an unknown file system'} here: no disk-backed directory to try")
    with ServerProcess(l1_size="8MiB", chunk_size=64, extra_args=["--shm-dir", str(shm)]) as server:
        assert f"{shm} is on a {kind} file system, not tmpfs" in server.log()


def test_a_large_arena_is_announced_before_it_is_made(monkeypatch, caplog) -> None:
    """Pre-faulting takes seconds per GiB on some hosts: the log says what the server is doing
    meanwhile (in-process, with the threshold lowered: a real 1 GiB arena would take that long)."""
    import logging

    from kvxfer import arena

    monkeypatch.setattr(arena, "ANNOUNCE_BYTES", 4 << 20)
    with caplog.at_level(logging.INFO, logger="kvxfer.arena"):
        arena.Arena.create(2 << 20).close()
        assert not caplog.records
        arena.Arena.create(4 << 20).close()
    assert [r.getMessage() for r in caplog.records] == [
        "making the L1 arena: 4.0 MiB in /dev/shm, reserved and pre-faulted before the server is ready "
        "(seconds per GiB on some hosts)"]


def test_a_server_process_that_fails_to_start_says_why_in_a_line_and_keeps_the_whole_log() -> None:
    from kvxfer.testing.server import ServerProcess, ServerStartFailed

    server = ServerProcess(l1_size="1KiB")
    with pytest.raises(ServerStartFailed) as info:
        server.start()
    message = str(info.value)
    assert "exited with 2" in message and "--l1-size" in message, message
    assert info.value.log == server.log() and "kvxfer serve: error:" in info.value.log, info.value.log
    assert server.proc is not None and server.proc.returncode == 2 and server._log.closed


def test_server_process_waits_longer_for_a_larger_arena() -> None:
    from kvxfer.testing.server import ServerProcess

    assert ServerProcess(l1_size="256MiB").start_timeout == 31.25
    assert ServerProcess(l1_size="12GiB").start_timeout == 90.0
    assert ServerProcess(l1_size="12GiB", start_timeout=5).start_timeout == 5
    assert ServerProcess(l1_size="lots").start_timeout == 30.0  # the server itself refuses it


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])  # localhost may resolve to ::1 first
def test_a_tcp_server_on_a_port_in_use_is_refused_in_one_line_before_its_arena(tmp_path: Path, host: str) -> None:
    import socket

    from kvxfer.security import make_keys

    make_keys(tmp_path / "keys")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        url = f"tcp://{host}:{taken.getsockname()[1]}"
        proc = run("serve", "--url", url, "--curve-dir", str(tmp_path / "keys"), "--l1-size", "64TiB")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot listen at {url}: its port is in use" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("mistake", ["unknown transport", "metrics port in use", "tcp without keys"])
def test_serve_refuses_a_mistake_before_its_arena(tmp_path: Path, mistake: str) -> None:
    """Faulting in an arena takes seconds per GiB: a mistake that can be seen at once must be
    reported before it (a 64 TiB arena, which this host cannot hold, shows the order: its error
    would come first otherwise)."""
    import socket

    url = f"ipc://{tmp_path}/run/kvxfer.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args, said = {
            "unknown transport": (["--url", url, "--transports", "nope"], "nope"),
            "metrics port in use": (["--url", url, "--metrics-port", port], f"cannot serve metrics on 127.0.0.1:{port}"),
            "tcp without keys": (["--url", f"tcp://127.0.0.1:{port}"], "tcp:// needs CURVE keys"),
        }[mistake]
        proc = run("serve", *args, "--l1-size", "64TiB")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "64.0 TiB" not in proc.stderr and "--shm-dir" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "kvxfer.sock").exists()


def test_serve_at_a_url_naming_a_directory_says_to_name_the_socket_in_it(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    proc = run("serve", "--url", f"ipc://{tmp_path}/run", "--l1-size", "64TiB")
    assert proc.returncode == 2, proc.stderr
    assert f"names the directory {tmp_path}/run: name the socket to make in it" in proc.stderr, proc.stderr


def test_a_transport_named_twice_is_loaded_once(tmp_path: Path) -> None:
    """``--transports cpu_gather,cpu_gather`` loaded the plugin twice: its second registration
    as a hook plugin failed with an ERROR and a traceback about hook specs."""
    from kvxfer import CacheClient
    from kvxfer.testing.server import ServerProcess

    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather,cpu_gather") as srv, \
            CacheClient(srv.url, timeout=30) as client:
        assert [t.name for t in client.status().transports] == ["cpu_gather"]
        assert "Traceback" not in srv.log() and "ERROR" not in srv.log(), srv.log()


def test_status_at_an_inproc_url_says_it_is_reachable_only_in_its_process() -> None:
    """It said to start one with `kvxfer serve --url inproc://x`, which serve refuses."""
    proc = run("status", "--url", "inproc://x", "--timeout", "1")
    assert proc.returncode == 2 and "answers only clients of its own process" in proc.stderr, proc.stderr
    assert "kvxfer serve --url inproc" not in proc.stderr
