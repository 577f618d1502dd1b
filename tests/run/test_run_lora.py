"""A LoRA run (``--config smoke_lora``, ``trainer.lora``): the generator in another process takes the
adapters, every trained step is on-policy (the drift guard proves the served adapters are the
trainer's), ``metrics.jsonl`` says what was published (``weight_sync_bytes``: the adapters only) and
where the KL reference comes from, the checkpoints hold the adapters, the run's end exports the
adapter (or the merged model), and a killed run resumes to the same adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from run_helpers import quiet_train, run_config

from gymbridge.safe_io import load_state

pytestmark = pytest.mark.integration

SMALL = {
    "steps": 3,
    "bridge.prompts_per_step": 2,
    "bridge.group_size": 3,
    "rollout.max_tokens": 16,
    "warmup.steps": 0,
    "shaping.kind": "token_rate",  # the random model's groups have reward variance: every step trains
    "trainer.kl_coef": 0.05,
    "checkpoint.every": 2,
    "output.export": "none",
}


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_lora_run_publishes_adapters_only_stays_on_policy_and_resumes(
    transport: str, tmp_path: Path
) -> None:
    run = tmp_path / "lora"
    merge = transport == "shared_memory"
    settings = {
        **SMALL,
        "generator.placement": "process",
        "generator.weight_transport": transport,
        "output.export": "final",
        "output.export_merge": merge,
    }
    cfg = run_config(run, settings, configs=("smoke_lora",))
    _, text = quiet_train(cfg)
    if merge:  # the merged model, the adapter beside it
        assert "as a Hugging Face model (LoRA merged" in text
        assert (run / "export" / "config.json").is_file()
        assert (run / "export" / "adapter" / "adapter_config.json").is_file()
    else:
        assert "as a LoRA adapter (peft)" in text
        assert (run / "export" / "adapter_model.safetensors").is_file()
        assert not (run / "export" / "config.json").exists()
    assert "LoRA on 14 modules" in text and "KL reference: the base model with the adapters off" in text
    trained = [r for r in records(run) if r["skipped"] is None]
    assert len(trained) >= 2
    assert all(abs(r["ratio_mean"] - 1.0) < 1e-3 for r in trained)  # the child serves the trainer's adapters
    assert {r["kl_reference"] for r in records(run)} == {"base_adapters_off"}
    assert {r["lora_rank"] for r in records(run)} == {8}
    # what trains, nothing else (fp32 adapters and the head: smoke_lora's full_modules)
    assert all(r["weight_sync_bytes"] == 4 * r["trainable_params"] == 4 * (16_384 + 32_768) for r in trained)

    tensors, meta = load_state(run / "checkpoints" / "step-000002.ckpt")
    weights = [k for k in tensors if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k or k == "model.lm_head.weight" for k in weights)
    assert meta["lora"]["r"] == 8


def test_a_lora_run_killed_mid_way_resumes_to_the_same_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed in step 3 (checkpoint at 2), resumed: the same four steps, gradient norms and adapters
    (to 1e-6) as a run that never stopped (both start from the same adapters: ``init_seed``)."""
    from gymbridge.trainer import grpo

    settings = {**SMALL, "steps": 4, "rollout.native": True}  # the native path samples reproducibly
    quiet_train(run_config(tmp_path / "whole", settings, configs=("smoke_lora",)))
    cut = tmp_path / "cut"
    real = grpo.GRPOTrainer.step
    calls = iter(range(1, 100))

    def crash(self: Any, batch: Any) -> Any:
        if next(calls) == 3:
            raise RuntimeError("killed in step 3")
        return real(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(grpo.GRPOTrainer, "step", crash)
        with pytest.raises(RuntimeError, match="killed in step 3"):
            quiet_train(run_config(cut, settings, configs=("smoke_lora",)))
    _, text = quiet_train(run_config(cut, settings, configs=("smoke_lora",)), resume="must")
    assert "resumed: step 2/4" in text
    assert [r["step"] for r in records(cut)] == [1, 2, 3, 4]
    whole, resumed = records(tmp_path / "whole"), records(cut)
    assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in whole], abs=1e-6)
    a, _ = load_state(tmp_path / "whole" / "checkpoints" / "step-000004.ckpt")
    b, _ = load_state(cut / "checkpoints" / "step-000004.ckpt")
    weights = sorted(k for k in a if k.startswith("model."))
    assert weights == sorted(k for k in b if k.startswith("model.")) and weights
    assert all(bool((a[k] - b[k]).abs().max() <= 1e-6) for k in weights)


def test_a_full_weight_run_reports_its_bytes_too(tmp_path: Path) -> None:
    run = tmp_path / "full"
    quiet_train(run_config(run, {**SMALL, "steps": 2, "trainer.kl_coef": 0.0}))
    trained = [r for r in records(run) if r["skipped"] is None]
    assert trained and all(r["weight_sync_bytes"] == 4 * r["trainable_params"] for r in trained)
    assert {r["kl_reference"] for r in records(run)} == {None} and {r["lora_rank"] for r in records(run)} == {
        0
    }


def test_a_vllm_model_server_is_started_with_lora_for_a_lora_trainer() -> None:
    from gymbridge.run.services import _serve_flags

    vllm = ("--model", "/m", "--backend", "vllm")
    assert _serve_flags(vllm, 0) == vllm
    assert _serve_flags(vllm, 8)[-3:] == ("--enable-lora", "--max-lora-rank", "8")
    assert _serve_flags(vllm, 12)[-1] == "16"  # vLLM's next allowed maximum rank
    assert _serve_flags(("--model", "/m", "--backend", "hf"), 8) == ("--model", "/m", "--backend", "hf")
    assert _serve_flags("--tiny", 8) == "--tiny"  # an HF server injects the adapters from init_group
