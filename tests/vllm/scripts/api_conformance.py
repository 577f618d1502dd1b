"""Run in .venv-vllm: every vLLM name gymbridge's backend uses exists with the signature it is called with.

Prints one JSON object: ``problems`` (empty when all holds) and what was checked. Builds real
vLLM objects where that runs on CPU: the request gymbridge builds (``TokensPrompt`` +
``SamplingParams``), a ``RequestOutput`` converted by ``generation_from_output``, the worker
extension resolved and checked for name clashes the way vLLM's ``WorkerWrapperBase.init_worker``
does before it injects it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import types
import typing
from importlib.metadata import version
from typing import Any

problems: list[str] = []
checked: list[str] = []


def check(ok: bool, what: str) -> None:
    checked.append(what)
    if not ok:
        problems.append(what)


def params(fn: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


import vllm  # noqa: E402
from PIL import Image  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

from gymbridge.generation import vllm as backend  # noqa: E402
from gymbridge.generation.types import SamplingConfig  # noqa: E402
from gymbridge.trajectory.types import GenerationInput  # noqa: E402

# -- engine args: what VLLMGenerator passes to AsyncEngineArgs
fields = {f.name: f for f in dataclasses.fields(vllm.AsyncEngineArgs)}
for name in ("model", "worker_extension_cls", "logprobs_mode", "max_model_len", "gpu_memory_utilization"):
    check(name in fields, f"AsyncEngineArgs has field {name}")
check("processed_logprobs" in str(fields["logprobs_mode"].type), "AsyncEngineArgs.logprobs_mode takes it")
try:
    from vllm.config.model import LogprobsMode

    check("processed_logprobs" in typing.get_args(LogprobsMode), "LogprobsMode has processed_logprobs")
except ImportError:
    problems.append("vllm.config.model.LogprobsMode is gone")

# -- AsyncLLM: the methods gymbridge awaits, with the keywords it passes
check(inspect.ismethod(AsyncLLM.from_engine_args), "AsyncLLM.from_engine_args is a classmethod")
check(inspect.isasyncgenfunction(AsyncLLM.generate), "AsyncLLM.generate is an async generator")
check(
    list(params(AsyncLLM.generate))[1:4] == ["prompt", "sampling_params", "request_id"],
    "generate(prompt, sampling_params, request_id)",
)
rpc = params(AsyncLLM.collective_rpc)
check(
    inspect.iscoroutinefunction(AsyncLLM.collective_rpc) and "args" in rpc,
    "await collective_rpc(method, args=...)",
)
pause = params(AsyncLLM.pause_generation)
check(inspect.iscoroutinefunction(AsyncLLM.pause_generation), "await pause_generation")
check(
    pause.get("mode") is not None and pause["mode"].kind is inspect.Parameter.KEYWORD_ONLY,
    "pause_generation(*, mode)",
)
check("clear_cache" in pause, "pause_generation(clear_cache=)")
from vllm.v1.engine import PauseMode  # noqa: E402

check("keep" in typing.get_args(PauseMode), "PauseMode has 'keep'")
check(
    inspect.iscoroutinefunction(AsyncLLM.resume_generation) and len(params(AsyncLLM.resume_generation)) == 1,
    "await resume_generation()",
)
reset = params(AsyncLLM.reset_prefix_cache)
check("reset_running_requests" in reset, "reset_prefix_cache(reset_running_requests=)")
check(
    inspect.signature(AsyncLLM.reset_prefix_cache).return_annotation in (bool, "bool"),
    "reset_prefix_cache returns bool",
)
check(inspect.iscoroutinefunction(AsyncLLM.reset_encoder_cache), "await reset_encoder_cache()")
check(
    hasattr(AsyncLLM, "model_config") or "model_config" in inspect.getsource(AsyncLLM.__init__),
    "AsyncLLM.model_config",
)
check("vllm_config" in inspect.getsource(AsyncLLM.__init__), "AsyncLLM.vllm_config")

# -- the request gymbridge builds, as real vLLM objects
hf_config = types.SimpleNamespace(
    image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4
)
engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf_config, max_model_len=64))
gen = backend.VLLMGenerator("unused", engine=engine, load_processor=False)
sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=8, stop_token_ids=(2,), seed=3)
image = Image.new("RGB", (8, 8))
inp = GenerationInput(prompt_token_ids=[1, 5, 5, 5, 9], multi_modal_data={"image": [image]})
prompt, sp = gen.build_request(inp, sampling)
check(isinstance(sp, vllm.SamplingParams), "SamplingParams built")
want = TokensPrompt(prompt_token_ids=[1, 5, 9], multi_modal_data={"image": [image]})
check(prompt == want, "TokensPrompt with one placeholder per item")
check(
    sp.logprobs == 0 and sp.detokenize is False and sp.skip_special_tokens is False,
    "SamplingParams logprobs=0, detokenize=False",
)
check(
    sp.logit_bias is not None and all(math.isinf(v) and v < 0 for v in sp.logit_bias.values()),
    "logit_bias keeps -inf",
)
check(sorted(sp.logit_bias or {}) == [3, 4, 5, 6], "logit_bias bans the media ids")
check(
    sp.seed == 3 and sp.max_tokens == 8 and sp.stop_token_ids == [2],
    "seed / max_tokens / stop_token_ids kept",
)
check("multi_modal_data" in typing.get_type_hints(TokensPrompt), "TokensPrompt takes multi_modal_data")

# -- RequestOutput -> Generation, with vLLM's own logprob containers
from vllm.logprobs import Logprob, append_logprobs_for_next_position, create_sample_logprobs  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

for flat in (False, True):  # vLLM's list of dicts, and FlatLogprobs (VLLM_FLAT_LOGPROBS=1)
    sample_logprobs = create_sample_logprobs(flat)
    for token, lp in ((7, -0.25), (2, -0.5)):
        append_logprobs_for_next_position(sample_logprobs, [token], [lp], [None], 1, 0)
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=[7, 2],
        cumulative_logprob=-0.75,
        logprobs=sample_logprobs,
        finish_reason="stop",
    )
    out = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 5, 9],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
    )
    generation = backend.generation_from_output(out, 0, [1, 5, 9])
    check(generation.token_ids == [7, 2], f"RequestOutput -> Generation tokens (flat={flat})")
    check(generation.logprobs == [-0.25, -0.5], f"RequestOutput -> Generation logprobs (flat={flat})")
    check(generation.finish_reason == "stop", f"finish_reason kept (flat={flat})")
    check(isinstance(sample_logprobs[0][7], Logprob), f"position -> token -> Logprob (flat={flat})")

# -- worker side: world rank, model runner, extension injection
from vllm.distributed.parallel_state import GroupCoordinator, get_world_group  # noqa: E402

check(
    callable(get_world_group) and "rank" in inspect.getsource(GroupCoordinator.__init__),
    "get_world_group().rank",
)
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402

extension = resolve_obj_by_qualname(backend._EXTENSION_PATH)
check(extension is backend.WeightSyncWorkerExtension, "worker_extension_cls resolves")
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

clashes = [a for a in dir(extension) if not a.startswith("__") and hasattr(Worker, a)]
check(not clashes, f"extension names clash with vLLM's Worker: {clashes}")
check("self.model_runner" in inspect.getsource(Worker), "Worker.model_runner")
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

check(
    "self.model = " in inspect.getsource(GPUModelRunner.load_model), "GPUModelRunner.model set by load_model"
)
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: E402

check(
    "worker_extension_cls" in inspect.getsource(WorkerWrapperBase.init_worker),
    "WorkerWrapperBase injects the extension",
)

print(
    json.dumps(
        {
            "vllm": version("vllm"),
            "transformers": version("transformers"),
            "checked": checked,
            "problems": problems,
        }
    )
)
