"""kvxfer.accelerators: what probes ask without importing torch agrees with torch itself."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from kvxfer.accelerators import cuda_devices

_CHILD = """
import json, sys
from kvxfer.accelerators import cuda_devices, torch_build
b = torch_build()
n, note = cuda_devices()
print(json.dumps({"build": [b.version, b.cuda, b.hip, b.xpu], "cuda": n, "note": note,
                  "torch_imported": "torch" in sys.modules}))
"""


def test_torch_build_and_cuda_devices_match_torch_without_importing_it() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    child = json.loads(out.stdout)
    assert not child["torch_imported"]
    v = torch.version
    assert child["build"] == [torch.__version__, v.cuda, getattr(v, "hip", None), getattr(v, "xpu", None)]
    assert child["cuda"] == (torch.cuda.device_count() if torch.cuda.is_available() and v.cuda else 0)
    assert cuda_devices() == (child["cuda"], child["note"])  # the same answer once torch is imported


def test_no_cuda_says_why_and_what_to_do() -> None:
    n, note = cuda_devices()
    if n:
        assert f"CUDA {torch.version.cuda}" in note
        return
    assert note.startswith(f"torch {torch.__version__}")
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert note.endswith("was built without CUDA (install a CUDA build of torch)")
