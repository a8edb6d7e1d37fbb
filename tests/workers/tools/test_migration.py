"""The migration table's walk: leaves with their array indices, where the descent stops, which row a field gets."""

from workers.tools.migration import Target, flatten, get, lookup, lost, parents, stops

TABLE = {"a.b": Target("x.b"), "a": lost("a is gone"), "a.c": Target("x.c"), "t": Target("x.t", whole=True),
         "e[].id": Target("env[].id")}


def walk(data: dict) -> list:
    above = parents(TABLE)
    return flatten(data, lambda path, _: stops(TABLE.get(path), path in above))


def test_leaves_carry_their_array_indices_and_a_whole_table_is_one_leaf():
    data = {"t": {"k": 1}, "e": [{"id": "p"}, {"id": "q"}], "empty": {}}
    assert walk(data) == [("t", [], {"k": 1}), ("e[].id", [0], "p"), ("e[].id", [1], "q"), ("empty", [], {})]


def test_a_lost_table_with_rows_below_is_walked_field_by_field():
    assert walk({"a": {"b": 1, "z": 2}}) == [("a.b", [], 1), ("a.z", [], 2)]
    assert lookup("a.b", TABLE).key == "x.b"
    assert lookup("a.z", TABLE).note == "a is gone"  # a field with no row of its own takes its lost parent's
    assert lookup("nowhere.z", TABLE) is None


def test_get_reads_an_indexed_key():
    assert get({"env": [{}, {"sampling": {"t": 0.5}}]}, "env[1].sampling.t") == 0.5
