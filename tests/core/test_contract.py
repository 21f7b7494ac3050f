"""The transport contract as a plugin meets it: declarations the registry refuses, the params
type read from ServerContext[R, P], submit-time tokens paired with their requests across threads,
release_params exactly once per request, and the one error boundary around plugin code.

Real components: a real server loading cpu_gather and the example's file_debug (server-driven),
real contexts of both; hooks are wrapped (the real hook still runs) only to observe them, and a
hook made to raise stands for a transport with a bug.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv

from kvxfer import CacheClient, ConfigError, TransportFailed, chunk_hashes
from kvxfer.errors import ServerInternalError
from kvxfer.layout import KVLayout, LayoutKind
from kvxfer.testing.kvdata import KVSpec, View, make_kv
from kvxfer.testing.server import ServerProcess
from kvxfer.transport import (
    API_VERSION,
    Capabilities,
    ClientDrivenContext,
    Probe,
    Registration,
    ServerContext,
    ServerDrivenContext,
    Style,
    Transfer,
    Transport,
)

# --------------------------------------------------------------------------- declarations


class _Params(msgspec.Struct, frozen=True):
    n: int = 0


class _Reg(Registration, frozen=True, kw_only=True):
    extra: str = ""


class _OtherReg(Registration, frozen=True, kw_only=True):
    other: str = ""


class _PidReg(_Reg, frozen=True, kw_only=True):  # a field of the core's declared again, a level down
    pid: int = 0


class _Server(ServerContext[_Reg, _Params]):
    def store(self, copies: list[Any], params: _Params) -> None:
        pass

    def retrieve(self, copies: list[Any], params: _Params) -> None:
        pass


class _ClientDriven(ClientDrivenContext):
    def gather(self, copies: list[Any], transfer: Transfer) -> None:
        pass

    def scatter(self, copies: list[Any], transfer: Transfer) -> None:
        pass


class _ServerDriven(ServerDrivenContext[_Params]):
    pass


class _HalfClientDriven(ClientDrivenContext):  # forgot scatter
    def gather(self, copies: list[Any], transfer: Transfer) -> None:
        pass


def _transport(**attrs: Any) -> Transport:
    base: dict[str, Any] = dict(name="t", api_version=API_VERSION, capabilities=Capabilities(frozenset({"cpu"})),
                                probe=lambda self: Probe(True))
    return type("T", (Transport,), {**base, **attrs})()


def test_server_context_type_arguments_are_read_once() -> None:
    assert _Server.params_type is _Params and _Server.registration_class is _Reg


def test_the_style_follows_from_the_context_class() -> None:
    assert _transport(context_type=_ClientDriven).style is Style.CLIENT_DRIVEN
    assert _transport(context_type=_ServerDriven, server_context_type=_Server,
                      registration_type=_Reg).style is Style.SERVER_DRIVEN


@pytest.mark.parametrize("attrs,wrong", [
    (dict(context_type=_ServerDriven), "declares server_context_type"),
    (dict(context_type=_ClientDriven, server_context_type=_Server, registration_type=_Reg),
     "has no server_context_type"),
    (dict(context_type=_ServerDriven, server_context_type=_Server, registration_type=_OtherReg),
     "_Server takes _Reg registrations, but registration_type is _OtherReg"),
    (dict(context_type=object), "context_type must subclass"),
    (dict(context_type=_ClientDriven, registration_type=dict), "registration_type must subclass Registration"),
    (dict(context_type=_HalfClientDriven), "context_type _HalfClientDriven does not implement scatter"),
    (dict(context_type=_ClientDriven, capabilities=None), "capabilities must be a kvxfer.transport.Capabilities"),
    (dict(context_type=_ClientDriven, name=7), "name must be the entry point's name"),
    (dict(context_type=_ClientDriven, registration_type=_PidReg),
     "registration_type _PidReg declares pid, which the core's Registration fills"),
], ids=["no-server-context", "client-driven-with-server", "registration-mismatch", "no-style", "bad-registration",
        "abstract-context", "no-capabilities", "bad-name", "core-field"])
def test_inconsistent_declarations_are_named(attrs: dict[str, Any], wrong: str) -> None:
    errors = _transport(**attrs).contract_errors()
    assert any(wrong in e for e in errors), errors


def test_consistent_declarations_pass() -> None:
    assert _transport(context_type=_ClientDriven).contract_errors() == []
    assert _transport(context_type=_ServerDriven, server_context_type=_Server, registration_type=_Reg,
                      ).contract_errors() == []


def test_capabilities_refuse_what_they_do_not_claim() -> None:
    """What a transport leaves out of its capabilities, the core never registers with it."""
    cpu = frozenset({"cpu"})
    layers = make_kv(KVSpec(LayoutKind.FLASH_ATTN, "float16"))
    layout = KVLayout.infer(layers, BLOCK_SIZE)
    assert Capabilities(cpu).refusal(layout, layers) is None
    assert Capabilities(cpu, strided_layers=False).refusal(layout, layers) is None  # contiguous
    assert Capabilities(cpu, layouts=frozenset({LayoutKind.BHNC, LayoutKind.MLA})).refusal(layout, layers) == \
        "does not move flash_attn KV caches (it claims bhnc, mla)"
    assert Capabilities(cpu, dtypes=frozenset({"bfloat16"})).refusal(layout, layers) == \
        "does not move float16 KV caches (it claims bfloat16)"
    views = make_kv(KVSpec(LayoutKind.BHNC, "float16", view=View("BLHNC")))
    why = Capabilities(cpu, strided_layers=False).refusal(KVLayout.infer(views, BLOCK_SIZE), views)
    assert why is not None and why.startswith("moves only contiguous layers, and layer 0 is a [32, 2, 16, 32] view "
                                              "with strides [2048, 512, 32, 1]")
    dense = make_kv(KVSpec(LayoutKind.BHNC, "float16"))
    assert Capabilities(cpu, strided_layers=False).refusal(KVLayout.infer(dense, BLOCK_SIZE), dense) is None


# --------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def both_server() -> Iterator[ServerProcess]:
    """cpu_gather (client-driven) and the example's file_debug (server-driven)."""
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather,file_debug") as srv:
        yield srv


@pytest.fixture
def cl(both_server: ServerProcess) -> Iterator[CacheClient]:
    c = CacheClient(both_server.url, timeout=15)
    yield c
    c.close()


class Observed:
    """Wraps a context's hooks (the real ones still run) and records what each request saw."""

    def __init__(self, ctx: Any) -> None:
        self.lock = threading.Lock()
        self.tokens: list[tuple[int, int]] = []
        self.seen: dict[bytes, Any] = {}  # first key of a request -> the token its hooks got
        self.released: list[Any] = []
        submit, self._n = ctx.on_submit, 0

        def on_submit(kind: str) -> Any:
            submit(kind)
            with self.lock:
                self._n += 1
                token = (threading.get_ident(), self._n)
                self.tokens.append(token)
            return token

        ctx.on_submit = on_submit
        for name in ("gather", "scatter", "prepare"):
            real = getattr(ctx, name, None)
            if real is not None:
                setattr(ctx, name, self._seeing(real))
        release = getattr(ctx, "release_params", None)
        if release is not None:
            def release_params(transfer: Transfer, params: Any) -> None:
                with self.lock:
                    self.released.append(transfer.token)
                release(transfer, params)

            ctx.release_params = release_params

    def _seeing(self, real: Any) -> Any:
        def hook(*args: Any) -> Any:
            transfer = args[-1]
            with self.lock:
                self.seen.setdefault(transfer.keys[0], transfer.token)
            return real(*args)

        return hook


def _submit_from_threads(ctx: Any, n_threads: int) -> tuple[dict[bytes, int], list[Any]]:
    """Each thread stores its own chunk; returns first key -> submitting thread, and the futures."""
    owner: dict[bytes, int] = {}
    futures: list[Any] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        key = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"thread-{i}-{id(ctx)}")
        barrier.wait(30)
        fut = ctx.submit_store(key, list(range(i * BLOCKS_PER_CHUNK, (i + 1) * BLOCKS_PER_CHUNK)))
        with lock:
            owner[key[0]] = threading.get_ident()
            futures.append(fut)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return owner, futures


@pytest.mark.parametrize("transport", ["cpu_gather", "file_debug"])
def test_each_request_gets_the_token_its_own_submit_made(cl: CacheClient, transport: str) -> None:
    """Tokens are made on the submitting threads, and every hook of a request sees its own,
    whichever threads submit at once (cuda_ipc's and hpu's stream events rely on this)."""
    ctx = cl.register(flash_attn_kv(num_blocks=32), model_name=f"tokens-{transport}", block_size=BLOCK_SIZE,
                      transport=transport)
    obs = Observed(ctx)
    owner, futures = _submit_from_threads(ctx, 6)
    assert all(f.result(30).stored == [0] for f in futures)
    assert len(obs.tokens) == 6 and set(obs.seen.values()) == set(obs.tokens)
    for key, thread in owner.items():
        assert obs.seen[key][0] == thread, "a request's hooks got another submit's token"
    if transport == "file_debug":
        assert sorted(obs.released, key=lambda t: t[1]) == sorted(obs.tokens, key=lambda t: t[1]), \
            "release_params runs once per request, with its token"
    ctx.close()


def test_release_params_runs_once_when_prepare_fails_and_the_future_names_the_step(cl: CacheClient) -> None:
    ctx = cl.register(flash_attn_kv(), model_name="prepare-fails", block_size=BLOCK_SIZE, transport="file_debug")
    obs = Observed(ctx)

    def broken(transfer: Transfer) -> None:
        raise KeyError("staging buffer 7")

    ctx.prepare = broken
    key = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="prepare-fails")
    with pytest.raises(TransportFailed, match=r"'file_debug' failed in prepare: KeyError: 'staging buffer 7'") as info:
        ctx.submit_store(key, list(range(BLOCKS_PER_CHUNK))).result(30)
    assert isinstance(info.value.__cause__, KeyError)
    assert (info.value.transport, info.value.step) == ("file_debug", "prepare")
    assert obs.released == obs.tokens and len(obs.tokens) == 1
    assert cl.lookup("prepare-fails", hashes=key) == 0
    ctx.close()


def test_a_copy_that_raises_fails_with_transport_failed_and_stores_nothing(cl: CacheClient) -> None:
    ctx = cl.register(flash_attn_kv(), model_name="gather-raises", block_size=BLOCK_SIZE, transport="cpu_gather")

    def broken(copies: list[Any], transfer: Transfer) -> None:
        raise RuntimeError("DMA engine fault")

    ctx.gather = broken
    key = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="gather-raises")
    with pytest.raises(TransportFailed, match=r"'cpu_gather' failed in gather: RuntimeError: DMA engine fault"):
        ctx.submit_store(key, list(range(BLOCKS_PER_CHUNK))).result(30)
    assert cl.lookup("gather-raises", hashes=key) == 0 and cl.status().reservations == 0
    ctx.close()


def test_a_config_error_from_a_hook_keeps_its_type(cl: CacheClient) -> None:
    """A plugin's ConfigError is the user's to fix: it reaches the caller as it is."""
    ctx = cl.register(flash_attn_kv(), model_name="config-error", block_size=BLOCK_SIZE, transport="cpu_gather")

    def refuse(kind: str) -> None:
        raise ConfigError("blocks: these are pinned by another engine")

    ctx.on_submit = refuse
    key = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="config-error")
    with pytest.raises(ConfigError, match="pinned by another engine"):
        ctx.submit_store(key, list(range(BLOCKS_PER_CHUNK)))
    ctx.close()


def test_server_side_plugin_errors_name_the_transport_and_step(cl: CacheClient) -> None:
    """A file_debug retrieve whose spool file name is taken by a directory: the server's write of
    the file raises IsADirectoryError inside the plugin, which the boundary names (and the server
    serves on)."""
    ctx = cl.register(flash_attn_kv(), model_name="server-fails", block_size=BLOCK_SIZE, transport="file_debug")
    key = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="server-fails")
    assert ctx.submit_store(key, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]  # slot 0, freed again
    (Path(ctx.spool_dir) / "spool-0").mkdir()  # the file the retrieve's slot will get (the first free one)
    with pytest.raises(ServerInternalError, match=r"transport 'file_debug' failed in retrieve: IsADirectoryError"):
        ctx.submit_retrieve(key, list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK))).result(30)
    assert cl.ping() > 0
    ctx.close()


@pytest.mark.parametrize("when", ["after", "before", "public"])
def test_a_context_class_that_takes_a_name_of_the_cores_is_refused(cl: CacheClient, monkeypatch: pytest.MonkeyPatch,
                                                                  when: str) -> None:
    """A transport's context that sets a private attribute of the core's own context (its
    ``_lock`` after ``super().__init__()``, so that both share or lose one lock; ``_views`` before
    it, replaced by the core's at once), or a public one the contract names (``transport_name``,
    which the registration sends), is refused at register, naming the attribute: the example
    transport did the first."""
    from kvxfer_cpu_gather.transport import CpuGatherContext, CpuGatherTransport

    class Clashing(CpuGatherContext):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if when == "before":
                self._views = []
                self.layers = args[2]  # the KV tensors the core sets too, the same object: no clash
            super().__init__(*args, **kwargs)
            if when == "after":
                self._lock = threading.Lock()
            if when == "public":
                self.transport_name = "host rows (fast)"
            self.layers = self.layers  # the same object the core set: no clash

    monkeypatch.setattr(CpuGatherTransport, "context_type", Clashing)
    name = {"after": "_lock", "before": "_views", "public": "transport_name"}[when]
    with pytest.raises(ConfigError, match=f"transport 'cpu_gather': its context class sets {name}, which kvxfer's own"):
        cl.register(flash_attn_kv(num_layers=2, num_blocks=8), model_name=f"clash-{when}", block_size=BLOCK_SIZE,
                    transport="cpu_gather")
    assert not [c for c in cl.status().contexts if c.model_name == f"clash-{when}"]

def test_registration_extra_that_returns_a_field_of_the_cores_is_refused_naming_it(
        cl: CacheClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``registration_extra()`` returning a field the core fills (``pid``) is a ConfigError
    naming it at register (it was a TypeError about keyword arguments, reported as the transport
    failing)."""
    from kvxfer_cpu_gather.transport import CpuGatherContext, CpuGatherTransport

    class Extra(CpuGatherContext):
        def registration_extra(self) -> dict[str, Any]:
            return {**super().registration_extra(), "pid": 12345}

    monkeypatch.setattr(CpuGatherTransport, "context_type", Extra)
    with pytest.raises(ConfigError, match="transport 'cpu_gather': registration_extra.. returns pid, which the core"):
        cl.register(flash_attn_kv(num_layers=2, num_blocks=8), model_name="extra-pid", block_size=BLOCK_SIZE,
                    transport="cpu_gather")
    assert not [c for c in cl.status().contexts if c.model_name == "extra-pid"]


def _store_held_in_its_gather(cl: CacheClient, monkeypatch: pytest.MonkeyPatch, model: str) -> tuple[Any, Any, Any]:
    """A cpu_gather context of ``model`` with one store whose gather has started and waits for
    the returned event: (context, the store's future, the event)."""
    from kvxfer_cpu_gather.transport import CpuGatherContext

    gate, started = threading.Event(), threading.Event()
    real = CpuGatherContext.gather

    def gated(self: Any, copies: Any, transfer: Any) -> Any:
        started.set()
        gate.wait(30)
        return real(self, copies, transfer)

    monkeypatch.setattr(CpuGatherContext, "gather", gated)
    ctx = cl.register(flash_attn_kv(num_layers=2, num_blocks=8), model_name=model, block_size=BLOCK_SIZE,
                      transport="cpu_gather")
    fut = ctx.submit_store(chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=model), list(range(BLOCKS_PER_CHUNK)))
    assert started.wait(30)
    return ctx, fut, gate


def test_a_close_while_another_is_under_way_waits_for_it(cl: CacheClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second close of a context (another thread's, or CacheClient.close()'s) returns only once
    the first has finished, its copies included: CacheClient.close() says goodbye after its
    contexts' closes, and a goodbye keeps nothing of the session, so a copy must not outlive it
    (before, the second close returned at once and the goodbye freed the slots of a copy still
    running, into which another client's chunk then went)."""
    import time

    ctx, fut, gate = _store_held_in_its_gather(cl, monkeypatch, "second-close")
    first = threading.Thread(target=ctx.close)
    first.start()
    time.sleep(0.2)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (ctx.close(), second_done.set()))
    second.start()
    assert not second_done.wait(0.5), "a second close returned while the first still waited for a copy"
    gate.set()
    first.join(30)
    second.join(30)
    assert second_done.is_set() and fut.result(30).stored == [0]


def test_the_core_names_every_private_attribute_it_sets(cl: CacheClient) -> None:
    """check_core_names compares against the names the core declares (a plugin's own private
    attribute, set by its hooks during the core's __init__, is not mistaken for one of the
    core's): the declarations must name every attribute the core's __init__ sets."""
    from kvxfer.transport import InstanceIdentity, registry

    layers = flash_attn_kv(num_layers=2, num_blocks=8)
    layout = KVLayout.infer(layers, BLOCK_SIZE)
    transport = registry.get_transport("cpu_gather")
    for cls in (_ClientDriven, _ServerDriven):
        ctx = cls(transport, cl, layers, layout, InstanceIdentity.fresh("core-names", 1, 0))
        try:
            private = {k for k in vars(ctx) if k.startswith("_") and not k.startswith("_ContextCore__")}
            assert private == cls._core_names, (cls.__name__, sorted(private ^ cls._core_names))
            public = {k for k in vars(ctx) if not k.startswith("_")}
            assert public == cls._core_public, (cls.__name__, sorted(public ^ cls._core_public))
        finally:
            ctx.close()


def test_a_plugins_own_private_attribute_set_by_its_hook_during_init_is_not_a_clash(
        cl: CacheClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A context that sets its own private attribute before ``super().__init__()`` and changes
    it in ``on_arena`` (which the core calls from its __init__) registers."""
    from kvxfer_cpu_gather.transport import CpuGatherContext, CpuGatherTransport

    class Pinning(CpuGatherContext):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._pin_handle: object = None
            super().__init__(*args, **kwargs)

        def on_arena(self, arena: Any) -> Any:
            self._pin_handle = object()
            return super().on_arena(arena)

    monkeypatch.setattr(CpuGatherTransport, "context_type", Pinning)
    ctx = cl.register(flash_attn_kv(num_layers=2, num_blocks=8), model_name="own-private", block_size=BLOCK_SIZE,
                      transport="cpu_gather")
    ctx.close()


def test_an_exit_on_an_engines_main_thread_passes_through_plugin_code() -> None:
    """vLLM's workers exit on SIGTERM by sys.exit from a signal handler, and the user's Ctrl-C
    raises KeyboardInterrupt: both arrive on the main thread, where plugin code runs too
    (on_submit, a context's construction, release); they pass through it. Off the main thread
    they are the plugin's own failure (a kvxfer server, whose handlers raise nothing, treats them
    so on its main thread too)."""
    from kvxfer.transport._context import plugin_step

    for exc in (SystemExit(0), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with plugin_step("t", "on_submit"):
                raise exc
        caught: list[TransportFailed] = []

        def off_main(exc: BaseException = exc) -> None:
            try:
                with plugin_step("t", "gather"):
                    raise exc
            except TransportFailed as failed:
                caught.append(failed)

        t = threading.Thread(target=off_main)
        t.start()
        t.join(30)
        assert [f.step for f in caught] == ["gather"]


def test_a_close_called_again_from_below_the_first_returns(cl: CacheClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close called again on the thread of the first one, from below it (a signal handler
    that closes, or a finalizer, running while the first waits for a copy), returns at once
    instead of waiting for the close it interrupted, which could never end."""
    import signal
    import time

    ctx, fut, gate = _store_held_in_its_gather(cl, monkeypatch, "close-again")
    handled: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: (ctx.close(), handled.append(time.monotonic())))
    rescued: list[bool] = []

    def rescue() -> None:  # ends a test that would hang: what the first close would never do
        if not ctx._close_ended.wait(10):
            rescued.append(True)
            ctx._close_ended.set()

    threading.Timer(0.5, gate.set).start()
    threading.Thread(target=rescue, daemon=True).start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # arrives while this thread is in the first close
        ctx.close()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert handled and not rescued, "the handler's close waited for the close it interrupted"
    assert fut.result(30).stored == [0]


def test_an_exit_on_the_main_thread_in_an_inline_prepare_is_not_a_futures_error(cl: CacheClient) -> None:
    """With prepare_inline, a request is prepared on the submitting thread, the engine's main
    thread: a signal handler's sys.exit arriving in prepare goes on out of submit_store (its
    future is cancelled), instead of failing the future with a SystemExit (the exit was lost)."""
    from kvxfer.transport import InstanceIdentity, registry

    class Inline(_ServerDriven):
        prepare_inline = True

        def prepare(self, transfer: Any) -> Any:
            raise SystemExit(143)

    layers = flash_attn_kv(num_layers=2, num_blocks=8)
    ctx = Inline(registry.get_transport("cpu_gather"), cl, layers, KVLayout.infer(layers, BLOCK_SIZE),
                 InstanceIdentity.fresh("inline-exit", 1, 0))
    try:
        with pytest.raises(SystemExit):
            ctx.submit_store(chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="inline-exit"),
                             list(range(BLOCKS_PER_CHUNK)))
    finally:
        ctx.close()


def test_kvxfer_transport_exports_every_name_of_the_contract() -> None:
    """plugin-authoring.md: import the contract's names from ``kvxfer.transport`` (the futures
    ``submit_*`` return were missing there)."""
    import kvxfer.transport
    import kvxfer.transport.contract

    missing = set(kvxfer.transport.contract.__all__) - set(kvxfer.transport.__all__)
    assert not missing, sorted(missing)
    assert all(getattr(kvxfer.transport, n) is getattr(kvxfer.transport.contract, n)
               for n in kvxfer.transport.contract.__all__)
