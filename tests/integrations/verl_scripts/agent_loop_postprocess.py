"""Runs inside .venv-verl (verl 0.9.1): ``GymAgentLoop`` -> verl's real ``AgentLoopWorker`` post-processing.

A two-image multi-turn rollout: ``color_pick`` (``reveal: tool``) served on loopback, a scripted
server manager (verl's ``server_manager.generate`` signature, verl's ``TokenOutput``) that calls
``look`` twice and then names the colour. The loop's ``AgentLoopOutput`` goes through
``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess`` into a ``DataProto``; the processor
is bound by verl's own ``hf_processor`` (its class named ``Qwen2VLProcessor``, as the stock one is:
the stock video processor needs torchvision). Prints one JSON object of measurements for the
pytest side (``tests/integrations/test_verl_agent_loop.py``) to check. ``--case unbound`` gives
the loop a processor verl could not bind M-RoPE to and prints the error it raised; ``--case
env_down`` points it at a closed port and prints what the recorded failure became in the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from types import SimpleNamespace
from typing import Any
from unittest import mock


def _processor(tokenizer: Any, config: Any, class_name: str) -> Any:
    from verl.utils.tokenizer.tokenizer import hf_processor

    from gymbridge.models.tiny_vlm import TinyImageProcessor, tiny_hf_processor

    base = type(tiny_hf_processor(tokenizer))
    stand_in = type(class_name, (base,), {})(
        TinyImageProcessor.build(), tokenizer, chat_template=tokenizer.chat_template
    )
    with (
        mock.patch("transformers.AutoProcessor.from_pretrained", return_value=stand_in),
        mock.patch("transformers.AutoConfig.from_pretrained", return_value=config),
    ):
        return hf_processor("tiny-qwen2-vl")  # verl's loader: binds get_rope_index by class name


class ScriptedServerManager:
    """verl's ``server_manager.generate`` over fixed answers; records what each call was given."""

    def __init__(self, tokenizer: Any, answers: list[str]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.calls: list[dict[str, Any]] = []

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        **_: Any,
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        text = self.answers[min(len(self.calls), len(self.answers) - 1)]
        ids = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        call = {"prompt_len": len(prompt_ids), "images": len(image_data or []), "request_id": request_id}
        self.calls.append({**call, "max_tokens": sampling_params.get("max_tokens")})
        return TokenOutput(token_ids=ids, log_probs=[-0.25] * len(ids))


def _config(prompt_length: int, response_length: int) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": prompt_length, "response_length": response_length},
                "model": {"custom_chat_template": None},
            },
            "data": {"apply_chat_template_kwargs": {}, "mm_processor_kwargs": {}},
        }
    )


async def run(case: str) -> dict[str, Any]:
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from gymbridge.integrations._common import ServerThread
    from gymbridge.integrations.verl import GymAgentLoop, verl_rows
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge_envs.color_pick.data import LOOK_CALL, make_row
    from gymbridge_envs.color_pick.server import ColorPickServer

    tiny = build_tiny_vlm(0)
    tokenizer = tiny.tokenizer
    prompt_length, response_length = 512, 256
    config = _config(prompt_length, response_length)
    processor = _processor(
        tokenizer, tiny.model.config, "TinyVLProcessor" if case == "unbound" else "Qwen2VLProcessor"
    )
    row = make_row(0, 0, colors="red,green", reveal="tool")
    record = verl_rows([row])[0]
    server = ColorPickServer(max_looks=4)
    manager = ScriptedServerManager(tokenizer, [LOOK_CALL, LOOK_CALL, row["color"]])
    with ServerThread(server) as env:
        url = env.url
        if case == "env_down":  # a port nothing listens on
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        try:
            loop = GymAgentLoop(
                trainer_config=DictConfigWrap(config), server_manager=manager, tokenizer=tokenizer,
                processor=processor, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
                hf_model_type="qwen2_vl", resources_server_url=url, max_turns=4, timeout_s=10,
            )  # fmt: skip
        except Exception as exc:  # the unbound case: report the typed error
            return {"error_type": type(exc).__name__, "error": str(exc), "processor": repr(processor)}
        output = await loop.run(
            {"temperature": 1.0, "top_p": 1.0, "logprobs": True}, **record, raw_prompt=record["prompt"]
        )

    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # the real post-processing methods, no Ray actor
    worker.rollout_config = SimpleNamespace(prompt_length=prompt_length, response_length=response_length)
    worker.tokenizer, worker.processor = tokenizer, processor
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    internal = await worker._agent_loop_postprocess(output, False, raw_prompt=record["prompt"])
    batch = worker._postprocess([internal], input_non_tensor_batch=None)

    if case == "env_down":
        return {
            "gym_failure": output.extra_fields.get("gym_failure"),
            "masked": int(batch.batch["response_mask"].sum()),
            "rm_sum": float(batch.batch["rm_scores"].sum()),
            "calls": manager.calls,
            "batch_size": len(batch),
        }
    input_ids = batch.batch["input_ids"]
    attention_mask = batch.batch["attention_mask"]
    position_ids = batch.batch["position_ids"]
    mmi = batch.non_tensor_batch["multi_modal_inputs"][0]
    grid = mmi["image_grid_thw"]
    merge = processor.image_processor.merge_size
    rm = batch.batch["rm_scores"][0]
    response_mask = batch.batch["response_mask"][0]
    tiny.model.eval()
    with torch.no_grad():
        logits = tiny.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids.transpose(
                0, 1
            ),  # [4, B, L]: text positions + 3 M-RoPE rows, as verl feeds it
            pixel_values=mmi["pixel_values"],
            image_grid_thw=grid,
        ).logits
    nonzero = torch.nonzero(rm).flatten().tolist()
    return {
        "calls": manager.calls,
        "num_images": len(output.multi_modal_data.get("images", [])),
        "image_sizes": [list(im.size) for im in output.multi_modal_data.get("images", [])],
        "image_tokens": int((input_ids[0] == processor.image_token_id).sum()),
        "image_features": int((grid.prod(-1) // merge**2).sum()),
        "pixel_rows": int(mmi["pixel_values"].shape[0]),
        "grid_patches": int(grid.prod(-1).sum()),
        "grid_rows": int(grid.shape[0]),
        "position_ids_shape": list(position_ids.shape),
        "input_len": int(input_ids.shape[1]),
        "vision_rows_differ": bool((position_ids[0, 1] != position_ids[0, 0]).any()),
        "rm_nonzero": nonzero,
        "rm_value": float(rm[nonzero[0]]) if nonzero else None,
        "last_response_index": int(attention_mask[0, prompt_length:].sum()) - 1,
        "reward_score": output.reward_score,
        "num_turns": int(batch.non_tensor_batch["__num_turns__"][0]),
        "masked_generated": int(response_mask.sum()),
        "generated": sum(
            len(tokenizer(a + "<|im_end|>", add_special_tokens=False)["input_ids"]) for a in manager.answers
        ),
        "logits_shape": list(logits.shape),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "gym_failure": output.extra_fields.get("gym_failure"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["ok", "unbound", "env_down"], default="ok")
    args = parser.parse_args()
    print("RESULT " + json.dumps(asyncio.run(run(args.case))))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
