"""``rediss://``: a worker's Bus over TLS to a real redis-server that speaks only TLS, verified against its CA."""

import shutil
import subprocess
import time

import pytest

from bus.config import RedisConfig
from bus.errors import RlbusError
from bus.local_redis import free_port, redis_binary
from bus.messages import Task
from bus.streams import Bus

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture
def tls_redis(tmp_path):
    """A TLS-only redis-server (no plain port) with a self-signed certificate for 127.0.0.1: (port, ca file)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen([redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert,
                             "--tls-auth-clients", "no", "--save", "", "--dir", tmp_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "--tls", "--cacert", cert, "-p", str(port), "ping"],
                         capture_output=True).stdout.strip() != b"PONG":
        assert proc.poll() is None and time.monotonic() < deadline, "the TLS redis-server did not start"
        time.sleep(0.05)
    yield port, cert
    proc.terminate()
    proc.wait(timeout=10)


async def test_a_bus_speaks_tls_to_a_rediss_url_and_refuses_an_unknown_certificate(tls_redis, tmp_path,
                                                                                   run_name):
    port, ca = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"

    b = await Bus.connect(url, run_name, RedisConfig(url=url), "w1")
    try:
        stream = b.keys.tasks("e")
        await b.publish(stream, Task(task_id="e:0:0", env="e", example_index=0, example_id="0", group_size=2))
        (entry,) = await b.read_group([stream], "rollout")
        await b.commit([(stream, "rollout", entry.id)], [])
        assert (await b.redis.xpending(stream, "rollout"))["pending"] == 0
    finally:
        await b.close()
    other_ca = tmp_path / "other.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", tmp_path / "o.key",
                    "-out", other_ca, "-days", "1", "-subj", "/CN=other"], check=True, capture_output=True)
    wrong = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}&ssl_cert_reqs=required"
    with pytest.raises(RlbusError, match="cannot reach Redis at rediss://127.0.0.1"):
        await Bus.connect(wrong, run_name, RedisConfig(url=wrong, reconnect_timeout_s=0), "w1")
