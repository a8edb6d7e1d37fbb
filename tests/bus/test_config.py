"""The [redis] section's URL handling: what may be shown of a URL, and the password children get."""

from bus.config import redact, split_password


def test_a_password_in_the_query_is_redacted_too():
    assert redact("redis://host:6379/0?password=hunter2") == "redis://host:6379/0?password=***"
    assert redact("rediss://host/0?ssl_cert_reqs=none&password=hunter2") == (
        "rediss://host/0?ssl_cert_reqs=none&password=***")
    assert redact("redis://:hunter2@host/0") == "redis://:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


def test_a_percent_encoded_password_reaches_the_children_decoded():
    assert split_password("redis://:p%40ss%3Aw%2Frd@host:6379/0") == ("redis://host:6379/0", "p@ss:w/rd")
    assert split_password("redis://host:6379/0?password=p%40ss") == ("redis://host:6379/0", "p@ss")
    assert split_password("redis://host:6379/0?db=1&password=x") == ("redis://host:6379/0?db=1", "x")
