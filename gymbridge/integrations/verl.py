"""Train NeMo Gym environments with verl's agent loop (verl 0.9.1, ``pip install 'gymbridge[verl]'``).

:data:`GymAgentLoop` (built on first use: ``verl`` is imported then) is a verl ``AgentLoopBase``
that plays one dataset row against a NeMo Gym resources server with gymbridge's own episode
loop (:func:`gymbridge.rollout.run_episode`: ``/seed_session``, the row's tools only, ``/verify``;
every model call's prompt rebuilt from the current conversation, all media so far included),
generating through verl's ``server_manager.generate`` (token ids in, token ids and logprobs
out, ``image_data`` / ``video_data`` / ``audio_data`` = every medium so far). Its
``AgentLoopOutput`` carries ``prompt_ids`` (the first call's prompt), ``response_ids`` (every
later token), ``response_mask`` (1 generated / 0 environment), ``response_logprobs``,
``multi_modal_data`` (``images`` / ``videos`` / ``audios``: every medium of the trajectory, in
order, decoded), ``reward_score`` (the environment's ``/verify`` reward; verl puts it on the last
response token) and ``num_turns``.

Checks, each a typed error instead of a silently text-only or misaligned sample:

* the trajectory is one sequence (:class:`~gymbridge.errors.UntrainableRolloutError`
  ``noncontiguous``) and every turn's media match its placeholder tokens
  (``placeholder_mismatch``); the prompt fits ``rollout.prompt_length`` (``prompt_too_long``);
  a response over ``rollout.response_length`` is cut there, never inside a media placeholder
  run (the media past the cut are dropped with their tokens);
* verl recomputes pixels by decoding ``input_ids`` and re-running its processor, and binds the
  M-RoPE ``get_rope_index`` to the processor by its class name; a rollout with media and no
  processor, or a processor of a Qwen-style vision model (grid image processor) without
  ``get_rope_index``, raises :class:`~gymbridge.errors.IntegrationError` (verl would train it
  text-only, with 1-D positions).

An environment failure (HTTP error, timeout, lost session, a fault mid-episode) is recorded, not
raised: the sample gets ``reward_score`` 0, an all-zero ``response_mask`` and
``extra_fields["gym_failure"]``; so does a result the environment marked ``mask_sample`` (its
reward is no measurement).
:func:`agent_loop_fields` (no verl import) is the result -> output conversion the class uses.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from gymbridge.errors import GymbridgeError, IntegrationError, TrajectoryError, UntrainableRolloutError
from gymbridge.integrations._common import flatten, masked_reason, require

if TYPE_CHECKING:
    from gymbridge.generation.chat import ChatCodec
    from gymbridge.generation.types import FinishReason, Generation, SamplingConfig
    from gymbridge.media import MediaItem, MediaPolicy
    from gymbridge.trajectory import GenerationInput

logger = logging.getLogger(__name__)

__all__ = ["GYM_ROW_COLUMN", "GymAgentLoop", "agent_loop_fields", "verl_rows"]

GYM_ROW_COLUMN = "gym_row"
"""The verl dataset column holding the Gym row as JSON (:func:`verl_rows`)."""

_MEDIA_KEYS = {"image": "images", "video": "videos", "audio": "audios"}
_MROPE_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "glm46v", "qwen2_5_omni"}
)


def __getattr__(name: str) -> Any:
    if name == "GymAgentLoop":
        cls = _agent_loop_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def verl_rows(
    gym_rows: Sequence[Mapping[str, Any]], *, agent_name: str = "gym_agent"
) -> list[dict[str, Any]]:
    """Gym dataset rows -> verl dataset records (write them to parquet for ``data.train_files``).

    Each record holds ``prompt`` (the row's text messages: what verl's dataset filters and logs;
    the agent loop renders the Gym input itself, media included), ``agent_name``,
    ``data_source: "nemo_gym"``, an empty ``reward_model`` and :data:`GYM_ROW_COLUMN` (the row, JSON).
    """
    from gymbridge.server._episode import input_items

    out: list[dict[str, Any]] = []
    for index, row in enumerate(gym_rows):
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, Mapping):
            raise TrajectoryError(f"row {index}: no responses_create_params object")
        messages = []
        for item in input_items(rcp.get("input")):
            if isinstance(item, Mapping) and item.get("type", "message") == "message":
                content = item.get("content")
                text = (
                    content
                    if isinstance(content, str)
                    else " ".join(
                        str(p.get("text"))
                        for p in content or []
                        if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                    )
                )
                messages.append({"role": str(item.get("role", "user")), "content": text})
        out.append(
            {
                "prompt": messages,
                "agent_name": agent_name,
                "data_source": "nemo_gym",
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"index": index},
                GYM_ROW_COLUMN: orjson.dumps(dict(row)).decode(),
            }
        )
    return out


def _gym_row(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    extra = kwargs.get("extra_info")
    for value in (
        kwargs.get(GYM_ROW_COLUMN),
        extra.get(GYM_ROW_COLUMN) if isinstance(extra, Mapping) else None,
    ):
        if isinstance(value, str | bytes):
            parsed = orjson.loads(value)
            if isinstance(parsed, dict):
                return parsed
        if isinstance(value, Mapping):
            return dict(value)
    raise TrajectoryError(
        f"the verl row has no {GYM_ROW_COLUMN!r} column (the Gym row as JSON): build the dataset with "
        "gymbridge.integrations.verl.verl_rows"
    )


def _runs(token_ids: Sequence[int], placeholder: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of ``placeholder`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    start = -1
    for i, token in enumerate(token_ids):
        if token == placeholder and start < 0:
            start = i
        elif token != placeholder and start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(token_ids)))
    return runs


def agent_loop_fields(
    result: Mapping[str, Any],
    *,
    placeholder_token_ids: Mapping[str, int],
    prompt_length: int,
    response_length: int,
    media_policy: MediaPolicy | None = None,
    has_logprobs: bool = True,
) -> dict[str, Any]:
    """A ``/run``-shaped result -> the keyword arguments of verl's ``AgentLoopOutput`` (module docstring).

    ``placeholder_token_ids`` maps a modality to its placeholder id (the processor's
    ``image_token_id`` ...); ``prompt_length`` / ``response_length`` are the rollout config's.
    ``multi_modal_data`` values are decoded (PIL images, ``[T, H, W, 3]`` uint8 frames,
    ``(waveform, rate)`` clips). ``metrics`` is left to the caller. A ``mask_sample`` result keeps
    its tokens with an all-zero ``response_mask``, ``reward_score`` 0 and its reason in
    ``extra_fields["gym_failure"]``.
    """
    from gymbridge.trajectory import from_gym_result

    try:
        trajectory = from_gym_result(
            result, on_noncontiguous="split", placeholder_token_ids=placeholder_token_ids
        )
    except TrajectoryError as exc:
        if "placeholder" in str(exc):
            raise UntrainableRolloutError(str(exc), reason="placeholder_mismatch") from exc
        raise
    flat = flatten(trajectory)
    if len(flat.prompt_ids) > prompt_length:
        raise UntrainableRolloutError(
            f"the first prompt is {len(flat.prompt_ids)} tokens, over rollout.prompt_length={prompt_length}: "
            "cutting it would cut its media placeholders; raise prompt_length or shrink the media",
            reason="prompt_too_long",
        )
    response_ids, mask, logprobs = flat.response_ids, flat.response_mask, flat.response_logprobs
    masked = masked_reason(result)
    if masked is not None:
        mask = [0] * len(mask)
    media = list(flat.media)
    if len(response_ids) > response_length:
        cut = response_length
        for placeholder in placeholder_token_ids.values():
            for start, end in _runs(response_ids, placeholder):
                if start < cut < end:
                    cut = start
        response_ids, mask, logprobs = response_ids[:cut], mask[:cut], logprobs[:cut]
        kept: list[MediaItem] = []
        for modality, placeholder in placeholder_token_ids.items():
            n_kept = len(_runs(flat.prompt_ids + response_ids, placeholder))
            kept += [m for m in media if m.modality == modality][:n_kept]
        dropped = len(media) - len(kept)
        media = [m for m in media if any(m is k for k in kept)]
        logger.info(
            "response cut from %d to %d tokens (%d media dropped)", len(flat.response_ids), cut, dropped
        )
    multi_modal_data: dict[str, list[Any]] = {}
    for medium in media:
        decoded: Any
        if medium.modality == "image":
            decoded = medium.image()
        elif medium.modality == "video":
            decoded = medium.video()
        else:
            decoded = medium.audio()
        multi_modal_data.setdefault(_MEDIA_KEYS[medium.modality], []).append(decoded)
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    env_answers, previous = 0, None
    for item in output if isinstance(output, list) else []:
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        role = item.get("role") if isinstance(item, Mapping) else None
        # a tool's answer, or an observation; a tool's media message right after its output is the same answer
        if kind == "function_call_output" or (
            kind == "message" and role == "user" and previous != "function_call_output"
        ):
            env_answers += 1
        previous = kind
    return {
        "prompt_ids": flat.prompt_ids,
        "response_ids": response_ids,
        "response_mask": mask,
        "response_logprobs": logprobs if has_logprobs else None,
        "multi_modal_data": multi_modal_data,
        "reward_score": 0.0 if masked is not None else flat.reward,
        "num_turns": 1 + flat.num_model_calls + env_answers,
        "extra_fields": {"gym_reward_components": dict(trajectory.reward_components), "gym_failure": masked},
    }


class _ServerManagerGenerator:
    """gymbridge's ``Generator`` over verl's ``server_manager.generate`` (one request id per rollout)."""

    def __init__(
        self, server_manager: Any, codec: ChatCodec, sampling_params: Mapping[str, Any], max_model_len: int
    ) -> None:
        self.server_manager = server_manager
        self.codec = codec
        self.sampling_params = dict(sampling_params)
        self.max_model_len = max_model_len
        self.request_id = uuid.uuid4().hex
        self.policy_version = 0
        self.has_logprobs = True
        self.calls = 0

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        from gymbridge.generation.types import Generation

        out: list[Generation] = []
        for inp in inputs:
            mm = inp.multi_modal_data
            params = {**self.sampling_params, "max_tokens": sampling.max_tokens}
            self.calls += 1
            reply = await self.server_manager.generate(
                request_id=self.request_id,
                prompt_ids=list(inp.prompt_token_ids),
                sampling_params=params,
                image_data=mm.get("image") or None,
                video_data=mm.get("video") or None,
                audio_data=mm.get("audio") or None,
            )
            ids = [int(t) for t in reply.token_ids]
            logprobs = reply.log_probs
            if logprobs is None:
                self.has_logprobs = False
                logprobs = [0.0] * len(ids)
            stop = set(self.codec.stop_token_ids)
            finish: FinishReason = "stop" if ids and ids[-1] in stop else "length"
            out.append(Generation(ids, [float(x) for x in logprobs], finish, list(inp.prompt_token_ids)))
        return out


def _placeholders(processor: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    if processor is None:
        return found
    tokenizer = getattr(processor, "tokenizer", processor)
    for modality in ("image", "video", "audio"):
        token_id = getattr(processor, f"{modality}_token_id", None)
        if not isinstance(token_id, int):
            token = getattr(processor, f"{modality}_token", None)
            converted = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
            token_id = converted if isinstance(converted, int) else None
        if isinstance(token_id, int):
            found[modality] = token_id
    return found


def check_processor(processor: Any, hf_model_type: str | None) -> None:
    """Refuse a processor verl would silently turn into text-only training (module docstring).

    A vision model (``hf_model_type`` of an M-RoPE family) without a processor (verl's loader
    failed and said so only in a warning), or a Qwen-style processor (grid image processor)
    without ``get_rope_index``, raises :class:`~gymbridge.errors.IntegrationError`.
    """
    vision_model = hf_model_type in _MROPE_MODEL_TYPES
    if processor is None:
        if vision_model:
            raise IntegrationError(
                f"verl has no processor for this {hf_model_type} model (its loader failed and only warned: "
                "'Failed to create processor'); without one verl's post-processing drops every image and "
                "computes 1-D positions. Load the model's own processor (verl binds M-RoPE by its class "
                "name: Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor, Glm4vProcessor, "
                "Glm46VProcessor)"
            )
        return
    grid = getattr(getattr(processor, "image_processor", None), "temporal_patch_size", None) is not None
    if (vision_model or grid) and not hasattr(processor, "get_rope_index"):
        raise IntegrationError(
            f"the processor ({type(processor).__name__}) of this {hf_model_type or 'Qwen-style'} model "
            "has no get_rope_index: verl binds M-RoPE by the processor's class name "
            "(Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor, Glm4vProcessor, "
            "Glm46VProcessor), and without it computes 1-D positions for a model that needs 3-D ones"
        )


def _agent_loop_class() -> type:
    agent_loop = require("verl.experimental.agent_loop.agent_loop", "verl", "GymAgentLoop")

    class GymAgentLoop(agent_loop.AgentLoopBase):  # type: ignore[misc, name-defined]
        """verl agent loop over a NeMo Gym resources server (see :mod:`gymbridge.integrations.verl`).

        Agent-loop config keys (``actor_rollout_ref.rollout.agent.agent_loop_config_path``):
        ``resources_server_url`` (required), ``max_turns`` (default 8), ``timeout_s`` (each
        environment call, default 60), ``tool_media`` (``"message"``: a tool's media follow its
        output in a user message, as gymbridge's agent does; ``"output"``: inside the output),
        ``media_policy`` (a :class:`~gymbridge.media.MediaPolicy`'s fields).
        """

        def __init__(
            self,
            *args: Any,
            resources_server_url: str | None = None,
            max_turns: int = 8,
            timeout_s: float = 60.0,
            tool_media: str = "message",
            media_policy: MediaPolicy | Mapping[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            # before verl's own constructor, whose error for a missing processor does not say why
            processor = kwargs["processor"] if "processor" in kwargs else args[3] if len(args) > 3 else None
            check_processor(processor, kwargs.get("hf_model_type"))
            super().__init__(*args, **kwargs)
            from gymbridge.generation.chat import ChatCodec

            if not resources_server_url:
                raise IntegrationError("GymAgentLoop needs resources_server_url in its agent-loop config")
            self.resources_server_url = str(resources_server_url).rstrip("/")
            self.max_turns = int(max_turns)
            self.timeout_s = float(timeout_s)
            self.tool_media = tool_media
            if isinstance(media_policy, Mapping):  # from the YAML config
                from gymbridge.media import MediaPolicy

                media_policy = MediaPolicy.model_validate(dict(media_policy))
            self.media_policy = media_policy
            self.hf_model_type = kwargs.get("hf_model_type")
            template = self.config.actor_rollout_ref.model.get("custom_chat_template", None)
            self.codec = ChatCodec(
                self.processor if self.processor is not None else self.tokenizer, chat_template=template
            )
            self.placeholder_token_ids = _placeholders(self.processor)

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            from gymbridge.generation.types import SamplingConfig
            from gymbridge.rollout import run_episode

            prompt_length = int(self.rollout_config.prompt_length)
            response_length = int(self.rollout_config.response_length)
            generator = _ServerManagerGenerator(
                self.server_manager, self.codec, sampling_params, prompt_length + response_length
            )
            temperature = float(sampling_params.get("temperature", 1.0))
            top_p = float(sampling_params.get("top_p", 1.0))
            sampling = SamplingConfig(temperature=temperature, top_p=top_p or 1.0, max_tokens=response_length)
            row = _gym_row(kwargs)
            try:
                result = await run_episode(
                    generator,
                    self.resources_server_url,
                    row,
                    max_turns=self.max_turns,
                    codec=self.codec,
                    sampling=sampling,
                    media_policy=self.media_policy,
                    max_model_len=prompt_length + response_length,
                    tool_media="output" if self.tool_media == "output" else "message",
                    timeout_s=self.timeout_s,
                )
            except UntrainableRolloutError:
                raise
            except GymbridgeError as exc:
                logger.warning("gym rollout failed: %s: %s", type(exc).__name__, exc)
                return self._failed(f"{type(exc).__name__}: {exc}")
            masked = masked_reason(result)
            if masked is not None:
                logger.warning("gym rollout masked by the environment: %s", masked)
                return self._failed(masked)
            fields = agent_loop_fields(
                result,
                placeholder_token_ids=self.placeholder_token_ids,
                prompt_length=prompt_length,
                response_length=response_length,
                media_policy=self.media_policy,
                has_logprobs=generator.has_logprobs,
            )
            if fields["multi_modal_data"] and self.processor is None:
                raise IntegrationError(
                    "this rollout carries media but verl has no processor for the model: verl would "
                    "train it text-only (see verl's 'Failed to create processor' warning)"
                )
            return agent_loop.AgentLoopOutput(**fields, metrics=agent_loop.AgentLoopMetrics())

        def _failed(self, reason: str) -> Any:
            eos = self.tokenizer.eos_token_id
            return agent_loop.AgentLoopOutput(
                prompt_ids=[],
                response_ids=[int(eos)],
                response_mask=[0],
                multi_modal_data={},
                reward_score=0.0,
                num_turns=0,
                metrics=agent_loop.AgentLoopMetrics(),
                extra_fields={"gym_reward_components": {}, "gym_failure": reason},
            )

    GymAgentLoop.__module__ = __name__
    return GymAgentLoop


if TYPE_CHECKING:
    GymAgentLoop: type
