"""The conformance kit itself: it must reject broken transports, and authors must not be able
to override or silence its tests.

The mutants (``mutants/kit_mutants.py``, cpu_gather with one bug each) are real plugins: a
dist-info directory on the path registers their entry points, in this process and in the
real server that loads them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxfer import CacheClient
from kvxfer.errors import LayoutError, TransportNotFound
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.testing import OverrideError, ServerProcess, TransportConformance
from kvxfer.testing.harness import CHUNK_SIZE, Kit
from kvxfer.testing.imports import private_imports
from kvxfer.testing.kvdata import KVSpec, View, make_kv
from kvxfer.transport import registry

MUTANTS = Path(__file__).parent / "mutants"
LAYOUT = LayoutKind.FLASH_ATTN
#: bhnc views whose rows are not back to back: layers interleaved in one buffer, padded pages.
CROSS, BY_HEAD, PADDED = View("BLHNC"), View("BHLNC"), View("BLNHC", page_pad=40)

#: mutant -> kit tests (with their parameters) that must fail against it.
MUST_FAIL: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "mutant_flip": [
        ("test_round_trip_is_bit_exact", {"layout": LAYOUT, "dtype": "float16"}),
        ("test_reference_retrieves_chunks_it_stored", {"layout": LAYOUT}),
    ],
    "mutant_through_float": [
        ("test_round_trip_is_bit_exact", {"layout": LAYOUT, "dtype": "bfloat16"}),
        ("test_round_trip_is_bit_exact", {"layout": LAYOUT, "dtype": "float32"}),
    ],
    "mutant_ignore_skip": [
        ("test_skip_first_n_tokens", {"skip": 16}),
        ("test_skip_first_n_tokens_with_a_missing_chunk", {}),
    ],
    "mutant_clobber": [
        ("test_partial_hits", {}),
        ("test_retrieve_of_unknown_keys_touches_nothing", {}),
        ("test_skip_first_n_tokens", {"skip": 48}),
    ],
    "mutant_contiguous": [
        ("test_round_trip_is_bit_exact", {"layout": CROSS, "dtype": "float8_e4m3fn"}),
        ("test_round_trip_is_bit_exact", {"layout": View("LBHNC", page_pad=32), "dtype": "float16"}),
        ("test_reference_retrieves_chunks_it_stored", {"layout": BY_HEAD}),
        ("test_retrieves_chunks_stored_by_the_reference", {"layout": PADDED}),
        ("test_bytes_outside_the_named_blocks_are_never_written", {"view": PADDED}),
    ],
    "mutant_first_layer": [
        ("test_layer_by_layer_round_trip", {"view": None}),
        ("test_layer_by_layer_round_trip", {"view": PADDED}),
    ],
    "mutant_leak": [
        ("test_contexts_leave_nothing_behind", {}),
    ],
    "mutant_early_layer": [
        ("test_layer_by_layer_round_trip", {"view": None}),
    ],
    "mutant_late_write": [
        ("test_a_finished_transfer_writes_nothing_after_it", {}),
    ],
    "mutant_late_retrieve": [
        ("test_a_finished_transfer_writes_nothing_after_it", {}),
    ],
    "mutant_late_store": [
        ("test_a_finished_transfer_writes_nothing_after_it", {}),
    ],
    "mutant_snapshot_at_register": [
        ("test_a_store_stores_what_the_cache_holds_when_it_is_submitted", {"view": None}),
        ("test_a_store_stores_what_the_cache_holds_when_it_is_submitted", {"view": PADDED}),
    ],
    "mutant_early_layer_store": [
        ("test_layer_by_layer_round_trip", {"view": None}),
        ("test_layer_by_layer_round_trip", {"view": PADDED}),
    ],
    "mutant_staged_by_slot": [
        ("test_chunks_in_reused_slots_load_their_own_bytes", {}),
    ],
    "mutant_folder_per_context": [
        ("test_contexts_leave_nothing_behind", {}),
    ],
    "mutant_wide_rows": [
        ("test_rows_of_any_width_and_blocks_of_any_size_round_trip",
         {"kind": LAYOUT, "block_size": 1, "heads": 1, "head_size": 1, "dtype": "float8_e4m3fn"}),
        ("test_rows_of_any_width_and_blocks_of_any_size_round_trip",
         {"kind": LayoutKind.MLA, "block_size": 1, "heads": 3, "head_size": 1, "dtype": "float32"}),
    ],
}
#: mutant_contiguous passes the kit on the older layouts and on contiguous views: before the kit
#: had vLLM's views, nothing in it caught a transport that assumes contiguity.
CONTIGUOUS_PASSES: list[tuple[str, dict[str, Any]]] = [
    ("test_round_trip_is_bit_exact", {"layout": LAYOUT, "dtype": "bfloat16"}),
    ("test_reference_retrieves_chunks_it_stored", {"layout": LayoutKind.FLASHINFER}),
    ("test_retrieves_chunks_stored_by_the_reference", {"layout": LayoutKind.MLA}),
    ("test_round_trip_is_bit_exact", {"layout": View("LBHNC"), "dtype": "bfloat16"}),
]


#: mutant -> what the kit's message says of its bug (the others are checked for failing only).
SAYS: dict[str, str] = {
    "mutant_first_layer": r"layer 1 holds layer 0's bytes \(does the copy of a range of layers honour "
                          r"RowCopy.first_layer",
}


@pytest.fixture(scope="module")
def mutants_server() -> Iterator[ServerProcess]:
    """A real server that loads cpu_gather and the mutants (found through their dist-info, as
    in-process discovery finds them while this module's tests run)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(MUTANTS), os.environ.get("PYTHONPATH")]))}
    names = ",".join(["cpu_gather", *MUST_FAIL, "contiguous_only"])
    sys.path.insert(0, str(MUTANTS))
    registry.refresh()
    try:
        with ServerProcess(l1_size="64MiB", chunk_size=CHUNK_SIZE, transports=names, env=env) as server:
            yield server
    finally:
        sys.path.remove(str(MUTANTS))
        registry.refresh()


def _run_kit_test(server: ServerProcess, transport: str, test: str, params: dict[str, Any]) -> None:
    kit = Kit(server.url, registry.get_transport(transport), "cpu", f"{transport}-{test}")
    try:
        getattr(TransportConformance(), test)(kit, **params)
    finally:
        kit.close()


@pytest.mark.parametrize("mutant", list(MUST_FAIL))
def test_kit_rejects_broken_transports(mutants_server: ServerProcess, mutant: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mutant fails the kit tests aimed at its bug, which cpu_gather passes on the same server."""
    from kvxfer.testing.conformance import lifecycle

    for test, params in MUST_FAIL[mutant]:
        _run_kit_test(mutants_server, "cpu_gather", test, params)
        with monkeypatch.context() as m, pytest.raises(AssertionError, match=SAYS.get(mutant)):
            # a mutant's leak stays: the leak check need not wait 10 s a stretch for it to go
            m.setattr(lifecycle, "SETTLE_S", 2.0)
            _run_kit_test(mutants_server, mutant, test, params)


def test_only_vllms_views_catch_a_transport_that_assumes_contiguity(mutants_server: ServerProcess) -> None:
    for test, params in CONTIGUOUS_PASSES:
        _run_kit_test(mutants_server, "mutant_contiguous", test, params)


def test_a_transport_that_moves_only_contiguous_layers_says_so(mutants_server: ServerProcess) -> None:
    """contiguous_only has mutant_contiguous's copies and claims no strided layers: the kit runs
    it on contiguous views and skips the rest with the reason; the core never registers a
    strided cache with it ("auto" passes it over)."""
    _run_kit_test(mutants_server, "contiguous_only", "test_round_trip_is_bit_exact",
                  {"layout": View("LBHNC", kernel_blocks=2), "dtype": "bfloat16"})
    with pytest.raises(pytest.skip.Exception, match=r"only contiguous layers \(Capabilities.strided_layers\)"):
        _run_kit_test(mutants_server, "contiguous_only", "test_round_trip_is_bit_exact",
                      {"layout": CROSS, "dtype": "bfloat16"})
    strided = make_kv(KVSpec(LayoutKind.BHNC, "bfloat16", view=PADDED))
    with CacheClient(mutants_server.url) as client:
        with pytest.raises(LayoutError, match=r"transport 'contiguous_only' moves only contiguous layers, and "
                                              r"layer 0 is a \[32, 2, 16, 32\] view with strides"):
            client.register(strided, model_name="strided", block_size=16, transport="contiguous_only")
        assert not client.status().contexts
    layout = KVLayout.infer(strided, 16)
    with pytest.raises(TransportNotFound, match=r"contiguous_only moves only contiguous layers"):
        registry.select("auto", torch.device("cpu"), among=["contiguous_only"], kv=(layout, strided))
    dense = make_kv(KVSpec(LayoutKind.BHNC, "bfloat16"))
    assert registry.select("auto", torch.device("cpu"), among=["contiguous_only"],
                           kv=(KVLayout.infer(dense, 16), dense)).name == "contiguous_only"


def test_kit_stops_a_run_whose_test_was_replaced(tmp_path: Path) -> None:
    """A kit test replaced after the class was defined: the child pytest refuses to run."""
    (tmp_path / "test_sneaky.py").write_text(
        "from kvxfer.testing import TransportConformance\n\n"
        "class TestSneaky(TransportConformance):\n"
        "    transport = 'cpu_gather'\n\n"
        "TestSneaky.test_empty_requests = lambda self, kit: None\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sneaky.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "kit tests were replaced: TestSneaky.test_empty_requests" in out, out


def test_overriding_a_kit_test_is_refused() -> None:
    with pytest.raises(OverrideError, match=r"overrides test_partial_hits of the kvxfer conformance kit"):
        class TestSilenced(TransportConformance):  # noqa: F841
            transport = "cpu_gather"

            def test_partial_hits(self, kit: Kit) -> None:
                assert True


def test_overriding_a_kit_fixture_or_removing_a_test_is_refused() -> None:
    with pytest.raises(OverrideError, match=r"kit"):
        class TestOwnKit(TransportConformance):  # noqa: F841
            kit = None
    with pytest.raises(OverrideError, match=r"test_empty_requests"):
        class TestRemoved(TransportConformance):  # noqa: F841
            test_empty_requests = None


def test_skipping_the_whole_kit_by_mark_is_refused() -> None:
    with pytest.raises(OverrideError, match=r"skip"):
        class TestSkipped(TransportConformance):  # noqa: F841
            transport = "cpu_gather"
            pytestmark = pytest.mark.skip(reason="later")


@pytest.mark.parametrize("how", ["decorator", "module", "store kit", "conftest"])
def test_a_kit_test_marked_to_skip_after_its_class_is_defined_stops_the_run(tmp_path: Path, how: str) -> None:
    """A mark the class body does not hold (a class decorator's, a module's ``pytestmark``, one a
    conftest adds) reaches the kit's tests only at collection: the run stops there with a usage
    error naming the class (such a class ran as all skipped, passing, even with
    ``--kvxfer-require-available``)."""
    kit, name = ("StoreConformance", "store = 'fs'") if how == "store kit" else \
        ("TransportConformance", "transport = 'cpu_gather'")
    mark = "@pytest.mark.skip(reason='later')\n" if how in ("decorator", "store kit") else ""
    if how == "conftest":  # a conftest's hook, which runs after the kit's own
        (tmp_path / "conftest.py").write_text(
            "import pytest\n\ndef pytest_collection_modifyitems(items):\n"
            "    for item in items:\n        item.add_marker(pytest.mark.skip(reason='later'))\n")
    (tmp_path / "test_silenced.py").write_text(
        f"import pytest\nfrom kvxfer.testing import {kit}\n\n"
        + ("pytestmark = pytest.mark.xfail(reason='later')\n\n" if how == "module" else "")
        + f"{mark}class TestSilenced({kit}):\n    {name}\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvxfer-require-available",
                           "test_silenced.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error: nothing ran
    assert "kit tests are marked to be skipped or to fail: TestSilenced" in proc.stderr, proc.stdout + proc.stderr


def test_own_tests_and_other_marks_are_allowed() -> None:
    class TestExtended(TransportConformance):
        transport = "cpu_gather"
        pytestmark = [pytest.mark.slow]

        def test_something_specific(self, kit: Kit) -> None:
            pass

    assert TestExtended.test_partial_hits is TransportConformance.test_partial_hits
    assert "test_something_specific" not in TransportConformance.kit_names
    assert {"kit", "kit_server", "kit_transport", "test_partial_hits"} <= TransportConformance.kit_names


def test_command_line_suite_and_gates(tmp_path: Path) -> None:
    """``--kvxfer-transport`` runs the packaged suite; a class naming a transport that is not
    installed fails with the installed names; a missing device skips with the reason; a probe
    that raises fails with what it raised; a device the transport does not serve fails with the
    setting that picked it."""
    (tmp_path / "test_gates.py").write_text(
        "from kvxfer.testing import TransportConformance\n\n"
        "class TestNotInstalled(TransportConformance):\n"
        "    transport = 'no_such_transport'\n\n"
        "class TestNoSuchDevice(TransportConformance):\n"
        "    transport = 'cpu_gather'\n"
        "    device = 'xla'\n\n"
        "class TestProbeRaises(TransportConformance):\n"
        "    transport = 'mutant_probe_raises'\n\n"
        "class TestDeviceNotServed(TransportConformance):\n"
        "    transport = 'mutant_cuda_only'\n"
    )
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--kvxfer-transport=cpu_gather",
         "-m", "kvxfer_conformance", "-k", "test_empty_requests", f"--junitxml={report}",
         "--pyargs", "kvxfer.testing.suite", "test_gates.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(MUTANTS), os.environ.get("PYTHONPATH")]))))
    out = proc.stdout + proc.stderr
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag: child.get("message", "") for child in case}
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        outcomes[cls] = next(((k, msg) for k, msg in kinds.items() if k in ("failure", "error", "skipped")),
                             ("passed", ""))
    assert outcomes["TestConformance"][0] == "passed", out
    kind, msg = outcomes["TestNotInstalled"]
    assert kind == "error" and "no transport named 'no_such_transport'" in msg and "cpu_gather" in msg, out
    kind, msg = outcomes["TestNoSuchDevice"]
    assert kind == "skipped" and "xla" in msg, out
    kind, msg = outcomes["TestProbeRaises"]
    assert kind == "error" and "probe() raised RuntimeError: driver library not found" in msg, out
    kind, msg = outcomes["TestDeviceNotServed"]
    assert kind == "error" and "does not serve device 'cpu'" in msg and "--kvxfer-device" in msg, out
    # a misspelt name on the command line: one usage error naming the installed ones, not an
    # error at the setup of every kit test
    for option, suite in (("--kvxfer-transport=cpu_gathr", "suite"), ("--kvxfer-store=fss", "store_suite")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", option,
                               "--pyargs", f"kvxfer.testing.{suite}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
        assert f"{option}: no " in proc.stderr and "installed: " in proc.stderr, proc.stdout + proc.stderr
        assert "cpu_gather" in proc.stderr or "fs" in proc.stderr, proc.stderr


def test_private_imports_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import kvxfer\nfrom kvxfer.transport import Transport\nfrom kvxfer import layout\n")
    (pkg / "b.py").write_text("import os\nfrom kvxfer.server.arena import Arena\nimport kvxfer.protocol.codec\n")
    assert private_imports(pkg) == [f"{pkg / 'a.py'}:3: kvxfer.layout", f"{pkg / 'b.py'}:2: kvxfer.server.arena",
                                    f"{pkg / 'b.py'}:3: kvxfer.protocol.codec"]
