"""Fast RESP packing gives redis-py's bytes."""

from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from bus.resp import fast_packing

args = st.lists(
    st.one_of(st.binary(max_size=7000), st.text(max_size=50), st.integers(), st.floats(allow_nan=False)),
    max_size=12,
)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["XADD", "XINFO STREAM", b"HSET", b"CONFIG GET"]), args)
def test_fast_packing_matches_redis_py(command, rest):
    fast, plain = fast_packing(Connection)(), Connection()
    assert b"".join(fast.pack_command(command, *rest)) == b"".join(plain.pack_command(command, *rest))
