"""Fast RESP packing gives redis-py's bytes, and takes a message's entry already packed."""

from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from bus.resp import RespArgs, bulk, fast_packing

args = st.lists(
    st.one_of(st.binary(max_size=7000), st.text(max_size=50), st.integers(), st.floats(allow_nan=False)),
    max_size=12,
)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["XADD", "XINFO STREAM", b"HSET", b"CONFIG GET"]), args)
def test_fast_packing_matches_redis_py(command, rest):
    fast, plain = fast_packing(Connection)(), Connection()
    assert b"".join(fast.pack_command(command, *rest)) == b"".join(plain.pack_command(command, *rest))


@settings(max_examples=100, deadline=None)
@given(args, st.lists(st.binary(max_size=50), max_size=6), st.binary(max_size=9000), args)
def test_packed_arguments_stand_for_the_arguments_they_hold(before, small, last, after):
    fast, plain = fast_packing(Connection)(), Connection()
    packed = RespArgs(len(small) + 1, b"".join(map(bulk, small)) + b"$%d\r\n" % len(last), last)
    assert b"".join(fast.pack_command("EVALSHA", *before, packed, *after)) == \
        b"".join(plain.pack_command("EVALSHA", *before, *small, last, *after))
