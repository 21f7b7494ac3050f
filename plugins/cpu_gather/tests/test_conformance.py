"""cpu_gather runs the whole conformance kit: on CPU tensors here, on CUDA tensors where a GPU
is present (the copy to host then goes through the device's own copy). Its own tests follow:
a scalar-only registration, and copies unlike the core's refused before the C copy sees them."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec
import pytest

from kvxfer.protocol import codec
from kvxfer.testing import TransportConformance
from kvxfer.testing.harness import Kit
from kvxfer.testing.imports import private_imports
from kvxfer.testing.kvdata import as_bytes, equal_bytes
from kvxfer_cpu_gather import CpuGatherRegistration


class TestCpuGather(TransportConformance):
    transport = "cpu_gather"
    device = "cpu"

    def test_registration_carries_only_scalars(self, kit: Kit) -> None:
        """Identity and layout numbers only (the run offsets are a short list of ints): no
        handles, paths or tensors."""
        scalar = (int, float, str, bool)
        for f in msgspec.structs.fields(CpuGatherRegistration):
            t = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Annotated else f.type  # (bounds)
            assert t in scalar or t == list[int], f"CpuGatherRegistration.{f.name} is {f.type}, not a scalar"
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        wire = msgspec.msgpack.decode(codec.encode(ctx.registration()))  # type: ignore[attr-defined]
        assert isinstance(wire, dict) and all(
            isinstance(v, scalar) or (isinstance(v, list) and all(type(i) is int for i in v)) for v in wire.values()), wire
        assert wire["device"] == "cpu" and wire["layout"] == spec.kind.value and wire["dtype"] == spec.dtype

    def test_copies_run_on_the_configured_threads_and_leave_the_callers_setting(
            self, kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
        """The copies run on the context's worker with KVXFER_CPU_GATHER_THREADS intra-op
        threads (torch's setting is per thread); the caller's own setting stays as it was."""
        import torch

        monkeypatch.setenv("KVXFER_CPU_GATHER_THREADS", "3")
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        seen: list[int] = []
        gather = ctx.gather

        def recording(copies, transfer):  # type: ignore[no-untyped-def]
            out = gather(copies, transfer)
            seen.append(torch.get_num_threads())
            return out

        ctx.gather = recording
        mine = torch.get_num_threads()
        assert kit.store(ctx, kit.keys(1), kit.blocks(spec, 1)).stored == [0]
        assert seen == [3] and torch.get_num_threads() == mine

    def test_copies_keep_their_threads_where_torch_set_num_threads_is_a_no_op(
            self, kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
        """vLLM's CPU worker replaces torch.set_num_threads with a no-op: the copies (stores and
        loads) still run on KVXFER_CPU_GATHER_THREADS threads, and a thread that first uses
        torch after them still starts with the process's default count."""
        import threading

        import torch

        def first_use() -> int:  # a fresh thread's count: the process's default
            out: list[int] = []
            t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
            t.start()
            t.join()
            return out[0]

        default = first_use()
        copies = 2 if default == 1 else 1
        monkeypatch.setenv("KVXFER_CPU_GATHER_THREADS", str(copies))
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        seen: list[int] = []

        def recorded(copy):  # type: ignore[no-untyped-def]
            def recording(copies, transfer):  # type: ignore[no-untyped-def]
                out = copy(copies, transfer)
                seen.append(torch.get_num_threads())
                return out
            return recording

        for name in ("gather", "scatter"):
            monkeypatch.setattr(ctx, name, recorded(getattr(ctx, name)))
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        assert kit.store(ctx, keys, blocks).stored == [0]
        assert kit.retrieve(ctx, keys, blocks).loaded == [0]
        assert seen == [copies, copies]
        assert first_use() == default

    def test_a_bad_thread_count_is_refused_at_registration(self, kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvxfer import ConfigError

        spec = kit.spec()
        for bad in ("many", "1_6", "\u0664", " 2"):  # int() reads the last three as 16, 4 and 2
            monkeypatch.setenv("KVXFER_CPU_GATHER_THREADS", bad)
            with pytest.raises(ConfigError, match="KVXFER_CPU_GATHER_THREADS must be an integer in"):
                kit.register(kit.kv(spec), spec)

    def test_a_copy_that_does_not_fit_is_refused_before_the_c_copy_sees_it(self, kit: Kit) -> None:
        """The host copies hand raw addresses to the C row copy: a copy unlike those the core
        makes (a slot or rows not on the host, a slot of other rank, overlapping slot rows,
        layers beyond the context's, rows of another dtype) is a ValueError, and nothing moves
        (tests/core/test_rowcopy.py covers HostRows itself)."""
        import torch

        from kvxfer.transport import RowCopy

        spec = kit.spec()
        layers = kit.kv(spec)
        ctx = kit.register(layers, spec)
        n = len(layers)
        elems, dt = ctx.layout.row_elems, getattr(torch, spec.dtype)  # a row, in elements of the layout's dtype
        rows = torch.tensor([0, 1], dtype=torch.int64)
        good = torch.ones(n, 2, elems, dtype=dt)
        before = as_bytes(layers)
        bad = {
            "rows on the meta device": RowCopy(rows.to("meta"), good),
            "a slot on the meta device": RowCopy(rows, good.to("meta")),
            "a 4-D slot with an empty last dimension": RowCopy(rows, torch.ones(n, 2, elems, 0, dtype=dt)),
            "slot rows that overlap": RowCopy(rows, torch.ones(n, 1, elems, dtype=dt).expand(n, 2, elems)),
            "layers that overlap": RowCopy(rows, torch.ones(1, 2, elems, dtype=dt).expand(n, 2, elems)),
            "layers beyond the context's": RowCopy(rows, good, first_layer=1),
            "int32 rows": RowCopy(rows.to(torch.int32), good),
            "fewer rows than the slot's": RowCopy(rows[:1], good),
            "rows of another length": RowCopy(rows, torch.ones(n, 2, elems + 8, dtype=dt)),
        }
        for what, copy in bad.items():
            for move in (ctx.gather, ctx.scatter):
                with pytest.raises(ValueError, match="does not fit"):
                    move([copy], None)  # type: ignore[arg-type]
                assert torch.equal(good, torch.ones_like(good)), what
        assert equal_bytes(as_bytes(layers), before)
        row_ids = torch.tensor([0, 1 << 40], dtype=torch.int64)
        with pytest.raises(IndexError, match="out of range"):
            ctx.gather([RowCopy(row_ids, good)], None)  # type: ignore[arg-type]


class TestCpuGatherOnCuda(TransportConformance):
    """Skipped without a GPU; runs on the GPU machine."""

    transport = "cpu_gather"
    device = "cuda"


def test_imports_only_the_public_api() -> None:
    import kvxfer_cpu_gather

    assert private_imports(Path(kvxfer_cpu_gather.__file__).parent) == []
