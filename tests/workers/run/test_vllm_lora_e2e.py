"""`rlbus run @ configs/lora.toml` with the LoRA stage on vLLM (the SFT stage on the built-in server): the adapter
versions are loaded into vLLM at runtime and the stage learns as it does on the built-in server.
Runs in the vLLM venv (``bash .ci/vllm.sh``)."""

import time

import pytest

from tests.workers.run.test_lora_e2e import LORA, LORA_GAIN
from tests.workers.run.test_session_e2e import start_run, stdout_of, summary, wait_exit

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_a_lora_stage_learns_on_vllm(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    started = time.monotonic()
    proc = start_run(out, tiny_model_dir, "--stage.1.run.max_steps", "75", "--stage.1.inference.backend", "vllm",
                     config=LORA)
    assert wait_exit(proc, out, 840) == 0, stdout_of(out)[-4000:]
    sft, lora = summary(out)["stages"]
    held_out = lambda stage, step: stage["eval"][str(step)]["eval/held_out/reward"]  # noqa: E731
    assert held_out(lora, 75) >= held_out(sft, 100) + LORA_GAIN, (sft["eval"], lora["eval"])
    assert lora["groups"]["stale"] <= 0.05 * lora["groups"]["produced"], lora["groups"]
    loaded = (out / "lora" / "logs").glob("inference*.log")
    assert any("vllm_adapter_loaded" in p.read_text() for p in loaded)
    print(f"vllm lora e2e: sft {held_out(sft, 100):.3f} -> lora {held_out(lora, 75):.3f} "
          f"in {time.monotonic() - started:.0f}s")
