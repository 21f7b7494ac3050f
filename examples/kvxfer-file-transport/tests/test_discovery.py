"""Discovery: the example is found like any installed plugin, and broken plugins are listed
with their error without hiding the healthy ones. Real package metadata: the example's own
installed distribution, and a dist-info directory of broken plugins put on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvxfer.transport import API_VERSION

BROKEN_ENTRY_POINTS = """\
[kvxfer.transports]
fails_on_import = kit_broken_a:Transport
wrong_api = kit_broken_b:WrongApi
not_a_transport = kit_broken_b:NotATransport
"""

BROKEN_B = """\
from kvxfer.transport import API_VERSION
from kvxfer_file_transport import FileTransport


class WrongApi(FileTransport):
    name = "wrong_api"
    api_version = API_VERSION + 98


class NotATransport:
    name = "not_a_transport"
"""


def _plugins(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "kvxfer", "plugins", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_kvxfer_plugins_lists_the_example() -> None:
    proc = _plugins("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["api_version"] == 2 and report["entry_point_group"] == "kvxfer.transports"
    info = {t["name"]: t for t in report["transports"]}["file_debug"]
    assert info["distribution"] == "kvxfer-file-transport"
    assert info["version"] == "0.1.0"
    assert info["api_version"] == 2
    assert info["style"] == "server_driven"
    assert info["health"] == "available", info
    assert info["target"] == "kvxfer_file_transport:FileTransport"


def test_broken_plugins_are_listed_with_their_error(tmp_path: Path) -> None:
    dist = tmp_path / "kit_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(BROKEN_ENTRY_POINTS)
    (tmp_path / "kit_broken_a.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    (tmp_path / "kit_broken_b.py").write_text(BROKEN_B)

    proc = _plugins("--json", pythonpath=tmp_path)
    assert proc.returncode == 1, proc.stderr  # broken plugins: a CI check can tell
    info = {t["name"]: t for t in json.loads(proc.stdout)["transports"]}
    assert info["file_debug"]["health"] == "available"
    assert info["cpu_gather"]["health"] == "available"
    for name in ("fails_on_import", "wrong_api", "not_a_transport"):
        assert info[name]["health"] == "broken", info[name]
        assert info[name]["distribution"] == "kit-broken" and info[name]["api_version"] is None
    assert "libfoo.so" in info["fails_on_import"]["detail"]
    assert f"api_version {API_VERSION + 98}" in info["wrong_api"]["detail"]
    assert "not a kvxfer Transport" in info["not_a_transport"]["detail"]

    table = _plugins(pythonpath=tmp_path)
    assert table.returncode == 1, table.stderr
    lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()}
    assert lines["wrong_api"].split()[-1] == "broken"
    assert lines["file_debug"].split()[-1] == "available"


def test_imports_only_the_public_api() -> None:
    import kvxfer_file_transport

    from kvxfer.testing.imports import private_imports

    assert private_imports(Path(kvxfer_file_transport.__file__).parent) == []
