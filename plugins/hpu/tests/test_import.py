"""Importing kvxfer_hpu, loading it as a plugin and probing it never import Gaudi software."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CHILD = textwrap.dedent("""
    import json, sys
    import kvxfer_hpu
    from kvxfer.transport import get_transport, list_plugins
    from kvxfer_hpu import ops_for
    t = get_transport("hpu")
    probe = t.probe()
    hpu = ops_for("hpu").probe()
    list_plugins()
    print(json.dumps({
        "imported": sorted(m for m in sys.modules if m.split(".")[0] == "habana_frameworks"),
        "device_types": list(probe.device_types),
        "reason": probe.reason,
        "hpu": list(hpu),
    }))
""")


def _run(extra_path: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_gaudi_software_probe_says_it_is_not_installed() -> None:
    if _hpu_installed():
        pytest.skip("habana_frameworks is installed here")
    res = _run(None)
    assert res["imported"] == []
    assert "hpu" not in res["device_types"] and "cpu" in res["device_types"]
    reason = str(res["reason"])  # the line `kvxfer plugins` shows: what is missing, what is served instead
    assert reason.startswith("no Intel Gaudi: habana_frameworks (the Intel Gaudi PyTorch bridge) is not installed; "
                             "serves cpu ("), reason


def test_installed_gaudi_software_is_not_imported(tmp_path: Path) -> None:
    """A habana_frameworks package that records being imported (and then fails, as it would on
    a machine without Gaudi): kvxfer_hpu must find it without importing it."""
    pkg = tmp_path / "habana_frameworks"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('habana_frameworks must not be imported')\n")
    res = _run(tmp_path)
    assert not marker.exists(), "kvxfer_hpu imported habana_frameworks"
    assert res["imported"] == []
    assert res["hpu"][0] is False
    assert "installed but not imported" in str(res["hpu"][1])


def _hpu_installed() -> bool:
    from kvxfer_hpu import HpuOps

    return HpuOps.installed()


def test_plugin_imports_only_the_public_api() -> None:
    """kvxfer_hpu uses only what ``kvxfer`` and ``kvxfer.transport`` export."""
    import kvxfer_hpu
    from kvxfer.testing.imports import private_imports

    assert private_imports(Path(kvxfer_hpu.__file__).parent) == []
