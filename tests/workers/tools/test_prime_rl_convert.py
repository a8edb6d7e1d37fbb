"""prime-rl configs → rlbus, against every config in prime-rl's own history (``tests/data/prime_rl_configs``):
each orchestrator-bearing one converts with every field carried (its value in the written TOML equal to the
source's) or left behind with a reason, none dropped silently."""

import json
import tomllib
from pathlib import Path

import pytest

from bus.errors import ConfigError
from tests.paths import REPO
from workers.config import RlbusConfig
from workers.tools.config_tool import render
from workers.tools.migration import get
from workers.tools.prime_rl_convert import Conversion, convert
from workers.tools.prime_rl_layout import combine, read, role

CORPUS = REPO / "tests" / "data" / "prime_rl_configs"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())


def leaves(data: dict, prefix: str = "") -> list[str]:
    """Every leaf path of a TOML table, array items indexed (``a.b[0].c``); an empty table is a leaf."""
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += leaves(value, path + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out += leaves(item, f"{path}[{i}].")
        else:
            out.append(path)
    return out


def check_accounted(source: dict, conversion: Conversion) -> None:
    """Every leaf of the source is carried or left behind (itself or a table above it), each loss with a reason,
    and each carried value is what the written TOML holds at its rlbus key."""
    named = [c.source for c in conversion.carried] + [field for field, _ in conversion.left]
    for leaf in leaves(source):
        assert any(leaf == n or leaf.startswith((n + ".", n + "[")) or n.startswith(leaf + "[") for n in named), \
            f"{leaf} dropped silently"
    assert all(reason for _, reason in conversion.left)
    written = tomllib.loads(render(conversion, [Path("x.toml")]))
    for carried in conversion.carried:
        if carried.key is None:
            continue
        value = get(written, carried.key)
        if isinstance(carried.value, list) and carried.key == "inference.vllm_args":
            assert any(value[i:i + len(carried.value)] == carried.value for i in range(len(value))), carried
        else:
            assert value == carried.value, carried


def corpus_entry(entry: dict) -> tuple[dict, Conversion] | None:
    """The combined source and its conversion, or None for a file that holds no orchestrator config."""
    path = CORPUS / entry["file"]
    data = read(path)
    if role(path, data) not in ("rl", "orchestrator"):
        return None
    given = {CORPUS / f: kind for kind, f in entry.get("with", {}).items()}
    source = combine([(path, data), *[(f, read(f)) for f in given]], given)
    return source, convert(source)


def with_runnable_envs(data: dict) -> dict:
    """The converted config with each train env an rlbus one (its group size, ratio and sampling kept), no eval
    envs: what the user's edit of the environments leaves."""
    keep = ("group_size", "ratio", "sampling", "max_retries")
    envs = [{"id": "reverse_text", "name": f"env{i}", **{k: v for k, v in env.items() if k in keep}}
            for i, env in enumerate(data.get("env") or [{}])]
    return {**data, "env": envs, "eval": {k: v for k, v in data.get("eval", {}).items() if k != "env"}}


def test_every_orchestrator_config_in_prime_rls_history_converts_faithfully_or_names_every_loss():
    bearing = faithful = loads = 0
    for entry in MANIFEST:
        converted = corpus_entry(entry)
        if converted is None:
            continue
        bearing += 1
        source, conversion = converted
        check_accounted(source, conversion)
        faithful += conversion.faithful
        RlbusConfig.model_validate(with_runnable_envs(conversion.data))  # nothing but the envs stops it
        loads += 1
    # The note of the corpus (docs/migrating.md): files, orchestrator-bearing ones, faithful conversions.
    assert (len(MANIFEST), bearing, faithful, loads) == (1465, 1174, 111, 1174)


def test_a_file_that_holds_no_orchestrator_config_says_so():
    path = next(CORPUS / e["file"] for e in MANIFEST if e["source"].endswith("/sft.toml"))
    with pytest.raises(ConfigError, match="no orchestrator config among .*sft.toml \\(a prime-rl sft config\\)"):
        combine([(path, read(path))])


def corpus_file(source: str, date_prefix: str = "") -> dict:
    return next(e for e in MANIFEST if e["source"] == source and e["date"].startswith(date_prefix))


def test_the_2025_layout_maps_its_old_names():
    entry = corpus_file("configs/reverse_text/orch.toml", "2025-08")
    source, conversion = corpus_entry(entry)
    data = conversion.data
    assert data["env"][0]["id"] == source["orchestrator"]["environment"]["id"] == "vf-reverse-text"
    assert data["group_size"] == source["orchestrator"]["rollouts_per_prompt"] == 16
    assert data["run"]["max_steps"] == 30 and data["packer"]["seq_len"] == 128
    assert "orchestrator.mask_truncated_completions" in {c.source for c in conversion.carried}
    assert dict(conversion.left) == {"orchestrator.micro_batch_size": "rlbus packs micro-batches of packer.seq_len "
                                     "tokens; trainer.forward_batch sets how many go through one forward pass"}


def test_the_2025_eval_list_layout_becomes_one_eval_env_per_id():
    entry = next(e for e in MANIFEST if "environment_ids" in str(read(CORPUS / e["file"]).get("orchestrator", {})
                                                                 .get("eval", read(CORPUS / e["file"]).get("eval"))))
    source, conversion = corpus_entry(entry)
    evals = source.get("orchestrator", source)["eval"]
    assert [e["id"] for e in conversion.data["eval"]["env"]] == evals["environment_ids"]
    sizes = evals.get("rollouts_per_example", evals.get("rollouts_per_prompt"))
    assert [e["group_size"] for e in conversion.data["eval"]["env"]] == sizes


def test_split_files_given_together_carry_the_trainers_learning_rate():
    entry = next(e for e in MANIFEST if len(e.get("with", {})) == 2 and "optim" in read(CORPUS / e["with"]["trainer"]))
    source, conversion = corpus_entry(entry)
    assert conversion.data["trainer"]["lr"] == source["trainer"]["optim"]["lr"]
    assert "trainer.lr" not in conversion.defaults


def test_a_current_source_converts_its_verifiers_env_one_to_one():
    source = {"orchestrator": {"train": {"source": [{"name": "rt", "group_size": 4, "env": {
        "taskset": {"id": "reverse-text", "split": "train"}, "agent": {"harness": {"id": "null"}}}}]}}}
    conversion = convert(source)
    assert conversion.data["env"] == [{"name": "rt", "group_size": 4, "taskset": {"id": "reverse-text", "split":
                                       "train"}, "agent": {"harness": {"id": "null"}}, "ratio": 1.0}]
    assert conversion.faithful and "env[0].ratio" in conversion.defaults


def test_a_seat_of_another_name_carries_in_every_verifiers_env_form():
    seat = {"player": {"max_turns": 2, "harness": {"id": "null"}}}
    block = {"taskset": {"id": "openenv", "base_url": "http://127.0.0.1:9"}, **seat}
    for source in ({"orchestrator": {"train": {"env": [block]}, "eval": {"env": [block]}}},
                   {"orchestrator": {"env": block}}):
        conversion = convert(source)
        assert conversion.faithful, conversion.left
        envs = conversion.data["env"] + conversion.data.get("eval", {}).get("env", [])
        assert all(env["player"] == seat["player"] for env in envs)
    left = convert({"orchestrator": {"train": {"env": [{"id": "reverse_text", "player": {"max_turns": 2}}]}}}).left
    assert [path for path, _ in left] == ["orchestrator.train.env[0].player.max_turns"]


def test_differing_defaults_are_written_with_a_comment():
    conversion = convert({"orchestrator": {"seq_len": 512, "train": {"env": [{"id": "reverse_text"}]}},
                          "wandb": {"name": "x"}})
    text = render(conversion, [Path("rl.toml")])
    data = tomllib.loads(text)
    assert (data["group_size"], data["sampling"]["max_completion_tokens"], data["trainer"]["lr"]) == (1, 512, 1e-6)
    assert data["model"]["path"] == "Qwen/Qwen3-0.6B"
    assert data["wandb"] == {"name": "x", "project": "prime-rl", "mode": "online"}
    assert "group_size = 1  # prime-rl's default rollouts per example; rlbus's is 8" in text
    assert 'mode = "online"  # prime-rl logs to W&B online by default' in text


def test_a_value_rlbus_has_no_equivalent_of_is_left_behind_with_the_reason():
    conversion = convert({"orchestrator": {"algo": {"type": "max_rl"}, "weight_broadcast": {"type": "nixl"}}})
    assert dict(conversion.left) == {
        "orchestrator.algo.type": "algo.type='max_rl': rlbus's modes are rl (GRPO-style), opd and sft",
        "orchestrator.weight_broadcast.type": "weight_broadcast.type='nixl': rlbus publishes weights as safetensors "
                                              "files or over NCCL"}


def test_two_values_for_one_rlbus_key_keep_the_first_and_name_the_second():
    conversion = convert({"max_steps": 10, "orchestrator": {"max_steps": 20}})
    assert conversion.data["run"]["max_steps"] == 10
    assert conversion.left == [("orchestrator.max_steps", "run.max_steps is already 10 from max_steps")]


def test_an_empty_ckpt_table_is_a_checkpoint_at_the_end():
    conversion = convert({"max_steps": 20, "ckpt": {}, "orchestrator": {"ckpt": {}}})
    assert conversion.data["ckpt"] == {"interval": 20} and conversion.faithful
    conversion = convert({"ckpt": {}})
    assert conversion.left == [("ckpt", "its checkpoint at the end: rlbus checkpoints every ckpt.interval steps only, "
                                        "and the run has no max_steps to set it to")]
