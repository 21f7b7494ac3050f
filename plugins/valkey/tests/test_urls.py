"""--l2-url for Valkey: hosts, users, TLS options, what is refused and how fast."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import valkey
from valkey.connection import SSLConnection

from kvxfer.errors import ConfigError, StoreUnavailable
from kvxfer.store import StoreOptions, get_store, redact_url
from kvxfer.store.base import url_secrets
from kvxfer_valkey import ValkeyServer, ValkeyStore
from kvxfer_valkey.local import free_port
from kvxfer_valkey.store import parse_valkey_urls


def test_hosts_users_and_tls_options_pass_through() -> None:
    hosts, kw = parse_valkey_urls("valkeys://kvx:p%40ss@h1:6380,h2:6381?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required")
    assert hosts == [("h1", 6380), ("h2", 6381)]
    assert kw["username"] == "kvx" and kw["password"] == "p@ss"
    assert kw["ssl"] is True and kw["ssl_ca_certs"] == "/etc/ca.pem" and kw["ssl_cert_reqs"] == "required"
    assert valkey.Valkey(host=hosts[0][0], port=hosts[0][1], **kw).connection_pool.connection_class is SSLConnection
    hosts, kw = parse_valkey_urls("valkey://127.0.0.1")
    assert hosts == [("127.0.0.1", 6379)] and "password" not in kw


@pytest.mark.parametrize("url, match", [("", "empty URL"), ("http://h:1", "'http://h:1' is not a valkey:// or valkeys:// URL"),
                                        ("valkey://", "no host"),
                                        # options the client would fail every connection with later, as if down
                                        ("valkey://h:1?foo=bar", "unknown option.*'foo'.*it takes db, "),
                                        ("valkey://h:1?protocol=3", "unknown option.*'protocol'"),
                                        ("valkey://h:1,h2:2?socket_timeout=nan", "unknown option.*'socket_timeout'"),
                                        # the backend's reads do no health checks: it would do nothing
                                        ("valkey://h:1?health_check_interval=5", "unknown option.*'health_check_interval'"),
                                        ("valkey://h:1?db=-1", "database number must be 0 or more"),
                                        # the client refused them as an unexpected argument: blamed on the plugin
                                        ("valkey://h:1?ssl_ca_certs=/etc/ca.pem", "'ssl_ca_certs' need a valkeys://"),
                                        ("valkey://h:1,h2:2?ssl_cert_reqs=none&ssl_password=x",
                                         "'ssl_cert_reqs', 'ssl_password' need a valkeys://")])
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_valkey_urls(url)


def test_passwords_never_shown() -> None:
    shown = redact_url("valkeys://kvx:s3cret@h1:6380,valkey://:other@h2:1?x=1")
    assert "s3cret" not in shown and "other" not in shown and "kvx:***@h1:6380" in shown
    # the clients take a password as a query option too, and a later host may be a URL of its own
    shown = redact_url("valkey://[fe80::1]:7000,valkey://u:pw2@h3:7002?password=hunter2&ssl_password=kp&ssl_ca_certs=/ca")
    assert "hunter2" not in shown and "kp" not in shown and "pw2" not in shown, shown
    assert shown == "valkey://[fe80::1]:7000,valkey://u:***@h3:7002?password=***&ssl_password=***&ssl_ca_certs=/ca", shown
    # a comma in user info (RFC 3986 allows it) makes where the password ends, and the hosts
    # begin, a guess: hidden whole by redaction, refused (unshown) by the parser; %2C is the way
    for url in ("valkey://admin:9,SECRET@127.0.0.1:6399", "valkey://h1:1,u:SECRET@h2:2"):
        assert "SECRET" not in redact_url(url), redact_url(url)
        with pytest.raises(ConfigError, match="user info of --l2-url holds a comma") as info:
            parse_valkey_urls(url)
        assert "SECRET" not in str(info.value)
    assert parse_valkey_urls("valkey://admin:a%2Cb@h1:1,h2:2?db=2") == \
        ([("h1", 1), ("h2", 2)], {"username": "admin", "password": "a,b", "db": 2})
    # an option's value may hold commas too: no host is made of it, nothing after it is shown
    for url in ("valkeys://h:6380?ssl_ciphers=A,B&password=SECRET", "valkey://h:1?password=ab,SECRET"):
        assert "SECRET" not in redact_url(url), redact_url(url)
        assert len(parse_valkey_urls(url)[0]) == 1
    assert redact_url("//u:SECRET@h:1") == "//u:***@h:1"  # no scheme at all
    assert redact_url("valkey:/\t/u:SECRET@h:1") == "valkey://u:***@h:1"  # the blanks parsers drop
    # nor do the errors for URLs the client cannot read show one
    for bad in ("u:SECRET@h:1", "valkyy://u:SECRET@h:1", "valkey://u:SECRET/x@h:1", "valkey://u:SECRET@h:port"):
        with pytest.raises(ConfigError) as info:
            parse_valkey_urls(bad)
        assert "SECRET" not in str(info.value), str(info.value)
    hosts, kw = parse_valkey_urls("valkey://h:1?password=hunter2")
    assert kw["password"] == "hunter2", "the option hidden is one the clients take"
    assert get_store("valkey").redact("valkey://h:1") == "valkey://h:1"


def test_the_secrets_redaction_hides_are_known_as_written_and_decoded() -> None:
    """The tier takes these out of any error text it logs or shows (a node may echo them)."""
    url = "valkeys://kvx:s3%2Ccret@h1:6380,valkey://:other@h2:1?password=hun+ter2&ssl_password=kp&ssl_ca_certs=/ca"
    assert url_secrets(url) == ["s3%2Ccret", "hun ter2", "hun+ter2", "s3,cret", "other", "kp"]
    assert url_secrets("valkey://h:1?db=2") == [] and url_secrets("valkey://u@h:1") == []
    assert url_secrets("valkey://u:@h:1") == []  # an empty password is no secret to hide


def test_nothing_listening_fails_fast_with_the_address() -> None:
    port = free_port()
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"no Valkey node answered at 127.0.0.1:{port}"):
        ValkeyStore().open(f"valkey://127.0.0.1:{port}", StoreOptions(timeout_s=0.5))
    assert time.monotonic() - t < 5


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as n:
        yield n


def test_several_hosts_need_a_cluster(node: ValkeyServer) -> None:
    with pytest.raises(ConfigError, match="not in cluster mode"):
        ValkeyStore().open(f"{node.url},127.0.0.1:{free_port()}", StoreOptions())


def test_a_database_the_node_does_not_have_is_a_configuration_error(node: ValkeyServer) -> None:
    """The node refuses the connection's SELECT: a URL to fix, not an outage to wait out (the
    server would start with L2 down and retry it for ever)."""
    with pytest.raises(ConfigError, match="refused the database of --l2-url: DB index is out of range"):
        ValkeyStore().open(f"{node.url}/99999", StoreOptions(timeout_s=0.5))
    ValkeyStore().open(f"{node.url}/3", StoreOptions(timeout_s=0.5)).close()


def test_tls_to_a_plain_node_is_refused_not_hung(node: ValkeyServer, tmp_path: Path) -> None:
    t = time.monotonic()
    with pytest.raises(StoreUnavailable):
        ValkeyStore().open(node.url.replace("valkey://", "valkeys://") + "?ssl_cert_reqs=none",
                           StoreOptions(timeout_s=0.5))
    assert time.monotonic() - t < 5
