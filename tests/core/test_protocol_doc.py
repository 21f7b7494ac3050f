"""docs/protocol.md documents every request and every field of every Struct on the wire, with the
right types, handler kinds and Struct names: the page cannot drift from kvxfer/protocol."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from kvxfer.errors import RemoteError
from kvxfer.protocol import REQUESTS
from kvxfer.protocol import messages as m

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def type_name(t: mi.Type) -> str:
    """How the page writes a field's type."""
    simple = {mi.IntType: "int", mi.FloatType: "float", mi.StrType: "str", mi.BoolType: "bool",
              mi.BytesType: "bytes", mi.RawType: "raw"}
    for cls, name in simple.items():
        if isinstance(t, cls):
            return name
    if isinstance(t, mi.ListType):
        return f"list[{type_name(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return f"map[{type_name(t.key_type)}, {type_name(t.value_type)}]"
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    raise AssertionError(f"no documented spelling for {t!r}")


def wire_structs() -> dict[str, type[msgspec.Struct]]:
    """Every Struct that can be on the wire: payloads, replies, what they nest, Registration."""
    found: dict[str, type[msgspec.Struct]] = {}

    def walk(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls.__name__ not in found:
                found[t.cls.__name__] = t.cls
                for f in t.fields:
                    walk(f.type)
        for attr in ("item_type", "key_type", "value_type"):
            if hasattr(t, attr):
                walk(getattr(t, attr))

    for spec in REQUESTS.values():
        walk(mi.type_info(spec.payload))
        walk(mi.type_info(spec.reply))
    walk(mi.type_info(m.Registration))
    walk(mi.type_info(m.ErrorReply))
    return found


def sections(text: str, level: str) -> dict[str, str]:
    """``{name: body}`` of headings like ``### `name` `` (level ``###``)."""
    parts = re.split(rf"^{level} `(\w+)`[^\n]*$", text, flags=re.M)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        assert name not in out, f"{name} documented twice"
        out[name] = body
    return out


def table_rows(body: str) -> dict[str, str]:
    """``{field: type}`` from the first table of a Struct section."""
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_every_request_is_documented_with_its_structs_and_kind(doc: str) -> None:
    requests = sections(doc, "###")
    assert set(requests) == set(REQUESTS), "requests in docs/protocol.md differ from REQUESTS"
    for name, spec in REQUESTS.items():
        first = requests[name].strip().splitlines()[0]
        want = f"Payload `{spec.payload.__name__}` → reply `{spec.reply.__name__}`; handler: {spec.kind.value}"
        assert first.startswith(want), f"{name}: expected {want!r}, found {first!r}"
    # the summary table agrees too
    for name, spec in REQUESTS.items():
        row = f"| `{name}` | {spec.kind.value} | `{spec.payload.__name__}` | `{spec.reply.__name__}` |"
        assert row in doc, f"summary table row for {name} is missing or wrong"


def test_every_field_of_every_wire_struct_is_documented_with_its_type(doc: str) -> None:
    structs = sections(doc, "####")
    for name, cls in wire_structs().items():
        assert name in structs, f"Struct {name} is not documented"
        fields = {f.name: type_name(f.type) for f in mi.type_info(cls).fields}
        rows = table_rows(structs[name])
        if not fields:
            assert "No fields." in structs[name], f"{name} has no fields: say so"
            continue
        assert rows == fields, f"{name}: documented {rows}, code has {fields}"


def test_no_stale_structs_are_documented(doc: str) -> None:
    assert set(sections(doc, "####")) <= set(wire_structs())


def test_every_error_code_is_documented(doc: str) -> None:
    import kvxfer.errors as errors

    codes = {cls.code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, RemoteError) and cls is not RemoteError}
    for code in codes:
        assert f"| `{code}` |" in doc, f"error code {code} is not documented"
    assert f"protocol version **{m.PROTOCOL_VERSION}**" in doc
