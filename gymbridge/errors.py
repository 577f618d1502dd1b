"""The whole gymbridge exception tree.

Every error gymbridge raises on purpose derives from :class:`GymbridgeError`;
lower-level exceptions (pydantic, httpx, aiohttp, PIL, av, soundfile) are mapped
to these in one place per boundary, so callers never have to catch a third-party
type. Programming mistakes (wrong argument types, misuse of an API) stay builtin
exceptions (``TypeError``, ``ValueError``).

::

    GymbridgeError
    ├── ProtocolError          a JSON body does not match the NeMo Gym wire shape
    │   │                      (wraps the pydantic ValidationError as __cause__)
    │   └── JsonTooDeepError   a JSON body nests deeper than
    │                          ``gymbridge.limits.MAX_JSON_DEPTH``
    ├── MediaError             a media reference could not become a MediaItem
    │   ├── MediaPolicyError   refused by the MediaPolicy (permanent: never retry)
    │   ├── MediaFetchError    reading the bytes failed; ``retryable`` says whether
    │   │                      trying again could help (timeout, 5xx) or not (404)
    │   └── MediaDecodeError   the bytes are not a valid image / audio / video
    ├── TrajectoryError        a Gym result cannot become trainable turns;
    │                          ``item_index`` names the output item at fault
    ├── EnvError               talking to an environment / agent / model server
    │   ├── EnvServerError     the server answered with an error status
    │   │   │                  (``status``, ``body``, ``server``)
    │   │   ├── EnvSessionLostError  the environment no longer knows the
    │   │   │                  rollout's session (restarted / evicted; 409)
    │   │   └── GeneratorLostError  the model-server fleet lost the generation: its
    │   │                      replica died and no healthy one could take it (503)
    │   ├── EnvTransportError  the connection failed or broke mid-body
    │   │                      (``reached``: whether it was ever established)
    │   ├── EnvTimeoutError    the deadline passed
    │   ├── EnvFaultError      the environment failed in the middle of an episode
    │   │                      (a tool or ``/step`` answered 502 / 503 / 504 / 408 /
    │   │                      429, broke the connection or passed its deadline):
    │   │                      infrastructure, the rollout is never trained
    │   │                      (``route``, ``tool``, ``status``, ``failure_kind``)
    │   └── CheckEnvError      ``check_env`` found conformance problems
    │                          (``problems`` lists every one)
    ├── ServeError             a server cannot listen: port out of range, in use,
    │                          or not permitted (``host``, ``port``)
    ├── BridgeError            the bridge cannot go on
    │   └── BridgeStalledError too many consecutive failed groups, or none
    │                          completed (``failures``: the latest records)
    ├── CheckpointError        a state file (``gymbridge.safe_io``) is missing,
    │                          truncated, corrupt (sha256 mismatch) or of another
    │                          format; ``path`` and ``reason`` say which and why
    ├── IntegrationError       another trainer (TRL, verl) cannot carry what it was given
    │   ├── ChatTemplateMediaError  the processor's chat template drops the images of
    │   │                      tool messages (the trainer would train without their pixels)
    │   └── UntrainableRolloutError  a rollout the trainer cannot train correctly
    │                          (``reason``: mid_episode_media, noncontiguous,
    │                          prompt_mismatch, placeholder_mismatch, unsupported_media,
    │                          prompt_too_long)
    ├── TrainingError          the training loop cannot go on
    │   ├── PolicyDriftError   on-policy, but the generator's logprobs are not
    │   │                      the trainer's (``ratio_mean``, ``tolerance``)
    │   ├── SamplingMismatchError  a rollout was sampled with another top-p or
    │   │                      temperature than the trainer's (``setting``, values)
    │   ├── WeightSyncError    publishing weights to a generator failed
    │   │                      (a name / shape mismatch, a dead group, a refused route)
    │   └── GeneratorProcessError  the generator's own process did not start
    │       │                  (exited or never ready; the message holds its log tail)
    │       └── GeneratorFleetError  the generator fleet fell below
    │                          ``generator.min_healthy`` (``healthy``, ``min_healthy``)
    └── ConfigError            a configuration is invalid; ``problems`` lists
        │                      every problem found, not just the first
        └── ResumeError        a run directory cannot be continued as asked
                               (no checkpoint to resume from; ``path``)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "BridgeError",
    "BridgeStalledError",
    "ChatTemplateMediaError",
    "CheckEnvError",
    "CheckpointError",
    "ConfigError",
    "EnvError",
    "EnvFaultError",
    "EnvServerError",
    "EnvSessionLostError",
    "EnvTimeoutError",
    "EnvTransportError",
    "GeneratorFleetError",
    "GeneratorLostError",
    "GeneratorProcessError",
    "GymbridgeError",
    "IntegrationError",
    "JsonTooDeepError",
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaPolicyError",
    "PolicyDriftError",
    "ProtocolError",
    "ResumeError",
    "SamplingMismatchError",
    "ServeError",
    "TrainingError",
    "TrajectoryError",
    "UntrainableRolloutError",
    "WeightSyncError",
]


class GymbridgeError(Exception):
    """Root of every error gymbridge raises on purpose."""


class ProtocolError(GymbridgeError):
    """A JSON body does not match the NeMo Gym wire shape.

    The underlying ``pydantic.ValidationError`` (when there is one) is chained
    as ``__cause__``; ``errors`` holds its structured error list.
    """

    def __init__(self, message: str, *, errors: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


class JsonTooDeepError(ProtocolError):
    """A JSON body nests arrays/objects deeper than ``gymbridge.limits.MAX_JSON_DEPTH``."""


class MediaError(GymbridgeError):
    """A media reference could not be turned into a usable ``MediaItem``.

    ``source`` is the (shortened) reference that failed.
    """

    def __init__(self, message: str, *, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source


class MediaPolicyError(MediaError):
    """Refused by the :class:`~gymbridge.media.MediaPolicy`; permanent."""


class MediaFetchError(MediaError):
    """Reading the media bytes failed.

    ``retryable`` is True where trying again could succeed (timeout, connection
    reset, 5xx) and False where it cannot (404, missing file).
    """

    def __init__(self, message: str, *, source: str | None = None, retryable: bool = False) -> None:
        super().__init__(message, source=source)
        self.retryable = retryable


class MediaDecodeError(MediaError):
    """The bytes are not a valid (or are a hostile) image, audio or video."""


class TrajectoryError(GymbridgeError):
    """A Gym result cannot be turned into trainable turns.

    ``item_index`` is the index of the offending item in ``response.output``
    (``None`` when the fault is not tied to one item, e.g. a bad reward).
    """

    def __init__(self, message: str, *, item_index: int | None = None) -> None:
        if item_index is not None:
            message = f"output item {item_index}: {message}"
        super().__init__(message)
        self.item_index = item_index


class EnvError(GymbridgeError):
    """Base of the errors met while talking to a Gym server over HTTP."""

    def __init__(self, message: str, *, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server


class EnvServerError(EnvError):
    """The server answered with an error status.

    ``status`` is the HTTP status, ``body`` the (possibly truncated) body text,
    ``server`` the URL or name of the server.
    """

    def __init__(self, message: str, *, status: int, body: str = "", server: str | None = None) -> None:
        super().__init__(message, server=server)
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        """Infrastructure faults (5xx, 408, 429) are worth retrying; other 4xx are not."""
        return self.status >= 500 or self.status in (408, 429)


class EnvSessionLostError(EnvServerError):
    """The environment answered 409 ``env_session_lost``: it no longer holds the rollout's session.

    It restarted, or evicted or closed the session; the rollout cannot be scored and is
    recorded as a failure of class ``env_session_lost`` (:attr:`failure_class`). Servers
    mark such an answer with the header ``X-Gymbridge-Error: env_session_lost``
    (:attr:`header`), so a 409 for another reason is never mistaken for it.
    """

    failure_class = "env_session_lost"
    header = "X-Gymbridge-Error"


class GeneratorLostError(EnvServerError):
    """The generator fleet's router answered 503 ``generator_lost``: the replica a model call went to
    died before answering and no healthy replica could take the call again.

    The rollout is recorded as a failure of class ``generator_lost`` (:attr:`failure_class`), never
    trained and not retried by the client (the router already moved the call to every healthy
    replica). Marked with the header ``X-Gymbridge-Error: generator_lost`` (:attr:`header`).
    """

    failure_class = "generator_lost"
    header = "X-Gymbridge-Error"

    @property
    def retryable(self) -> bool:
        return False


class EnvTransportError(EnvError):
    """The connection failed, was refused, or broke in the middle of a body.

    ``reached`` is False when no connection was ever established (refused, unresolvable,
    unreachable), True when one broke after it was (reset, closed mid-body), None when unknown.
    """

    def __init__(self, message: str, *, server: str | None = None, reached: bool | None = None) -> None:
        super().__init__(message, server=server)
        self.reached = reached


class EnvTimeoutError(EnvError):
    """The deadline passed before the server answered."""


class EnvFaultError(EnvError):
    """The environment failed in the middle of an episode: infrastructure, not the model's doing.

    A tool or ``/step`` answered a status a client retries other than 500 (502, 503, 504, 408,
    429: a proxy or an overloaded server), or its connection broke, or it passed its deadline.
    The rollout's reward would not measure the task, so it is never trained: the agent ends the
    rollout with a masked result (``gymbridge.faults``), ``GymClient`` retries it and records an
    ``infra`` failure if it stays failed, the native loop records a failure of class
    ``env_fault``. ``route`` is the path called (``/zoom``, ``/step``), ``tool`` the tool's name
    (None for ``/step``), ``status`` the HTTP status (None: no answer came), ``failure_kind`` the
    NeMo Gym 0.7.0 name of the fault (``transport_unreachable``, ``transport_peer_drop``,
    ``transport_timeout``).
    """

    failure_class = "env_fault"

    def __init__(
        self,
        message: str,
        *,
        route: str,
        failure_kind: str,
        status: int | None = None,
        tool: str | None = None,
        server: str | None = None,
    ) -> None:
        super().__init__(message, server=server)
        self.route = route
        self.failure_kind = failure_kind
        self.status = status
        self.tool = tool


class CheckEnvError(EnvError):
    """``check_env`` found conformance problems; ``problems`` lists every one."""

    def __init__(self, problems: Sequence[str], *, server: str | None = None) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"check_env({server}): {len(self.problems)} problem(s):\n{lines}", server=server)


class ServeError(GymbridgeError):
    """A server cannot start listening: its port is out of range, in use, or not permitted.

    Raised before the server announces itself; ``host`` / ``port`` name the address when known.
    """

    def __init__(self, message: str, *, host: str | None = None, port: int | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


class BridgeError(GymbridgeError):
    """The bridge iterator cannot go on producing batches."""


class BridgeStalledError(BridgeError):
    """No batch can be produced: too many consecutive failed groups, or none completed.

    ``failures`` holds the most recent failure records (dicts, as in the failures jsonl).
    """

    def __init__(self, message: str, *, failures: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.failures = list(failures or [])


class CheckpointError(GymbridgeError):
    """A state file written by ``gymbridge.safe_io`` cannot be used.

    ``path`` is the file, ``reason`` what is wrong with it (missing, truncated, sha256
    mismatch, foreign format, malformed fields); the message names both.
    """

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path = str(path)
        self.reason = reason


class IntegrationError(GymbridgeError):
    """Another trainer (TRL, verl) cannot carry what gymbridge was given (``gymbridge.integrations``)."""


class ChatTemplateMediaError(IntegrationError):
    """The processor's chat template renders no image placeholders inside ``tool`` messages.

    TRL would then find image features without image tokens and drop ``pixel_values`` for the
    whole batch without a warning; gymbridge refuses before training instead. ``expected`` and
    ``found`` are the placeholder tokens one tool image should and did produce.
    """

    def __init__(self, message: str, *, expected: int, found: int) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class UntrainableRolloutError(IntegrationError):
    """A rollout the target trainer cannot train correctly, refused instead of crashing it or losing media.

    ``reason`` is one of ``"mid_episode_media"`` (media after the first model call, which the
    trainer's forward would not carry), ``"noncontiguous"`` (the token history does not only
    append: not one sequence), ``"prompt_mismatch"`` (the first prompt is not the trainer's own
    render of the dataset prompt, which its pixels come from), ``"placeholder_mismatch"`` (media
    and placeholder tokens disagree), ``"unsupported_media"`` (a modality the trainer's path
    cannot carry) or ``"prompt_too_long"`` (the first prompt does not fit the trainer's prompt
    length, and cutting it would cut media placeholders); ``row`` is the rollout's index in the
    batch (``None`` when not tied to one).
    """

    REASONS = frozenset(
        {
            "mid_episode_media",
            "noncontiguous",
            "prompt_mismatch",
            "placeholder_mismatch",
            "unsupported_media",
            "prompt_too_long",
        }
    )

    def __init__(self, message: str, *, reason: str, row: int | None = None) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown reason {reason!r}; one of {sorted(self.REASONS)}")
        where = f"rollout {row}: " if row is not None else ""
        super().__init__(f"{where}{message}")
        self.reason = reason
        self.row = row


class TrainingError(GymbridgeError):
    """The training loop cannot go on."""


class PolicyDriftError(TrainingError):
    """An on-policy step whose importance ratio is not 1: the generator's weights are not the trainer's.

    ``ratio_mean`` is the mean ratio over the first micro-batch before any update, ``tolerance``
    the allowed ``|ratio_mean - 1|``, ``step`` the trainer step that failed.
    """

    def __init__(self, *, ratio_mean: float, ratio_max_abs_log: float, tolerance: float, step: int) -> None:
        self.ratio_mean = ratio_mean
        self.ratio_max_abs_log = ratio_max_abs_log
        self.tolerance = tolerance
        self.step = step
        super().__init__(
            f"step {step}: the mean importance ratio over the first micro-batch is {ratio_mean:.6f} "
            f"(max |log ratio| {ratio_max_abs_log:.4g}) before any update, outside 1 +- {tolerance:g}, "
            "in an on-policy run (bridge.max_staleness 0): the generator's weights are not the "
            "trainer's (weights not published to the generator, a generator in another process that "
            "never joined the weight sync, or a different model / seed / dtype / sampling temperature)"
        )


class SamplingMismatchError(TrainingError):
    """A rollout was sampled otherwise than the trainer scores it (a biased importance ratio).

    ``setting`` is ``"top_p"`` or ``"temperature"``; ``rollout_value`` is what the row recorded,
    ``trainer_value`` the trainer's; ``row`` / ``task_index`` / ``rollout_index`` name the row.
    """

    def __init__(
        self,
        *,
        setting: str,
        rollout_value: float,
        trainer_value: float,
        row: int,
        task_index: Any = None,
        rollout_index: Any = None,
    ) -> None:
        self.setting = setting
        self.rollout_value = rollout_value
        self.trainer_value = trainer_value
        self.row = row
        self.task_index = task_index
        self.rollout_index = rollout_index
        super().__init__(
            f"batch row {row} (task {task_index}, rollout {rollout_index}) was sampled with "
            f"{setting}={rollout_value:g} but the trainer scores with trainer.{setting}={trainer_value:g}: "
            "the importance ratio would compare two different distributions; set "
            f"trainer.{setting} to the rollouts' {setting} (a run sends trainer.{setting} to every row)"
        )


class WeightSyncError(TrainingError):
    """Publishing weights to a generator failed (mismatched layout, a refused route, a dead group)."""


class GeneratorProcessError(TrainingError):
    """The generator's own process did not start (it exited, or never became ready)."""


class GeneratorFleetError(GeneratorProcessError):
    """The generator fleet has fewer healthy replicas than ``generator.min_healthy``: the run stops.

    ``healthy`` is how many replicas were serving the current weights, ``min_healthy`` the floor,
    ``replicas`` the fleet's size; the message names each replica's state.
    """

    def __init__(self, message: str, *, healthy: int, min_healthy: int, replicas: int) -> None:
        super().__init__(message)
        self.healthy = healthy
        self.min_healthy = min_healthy
        self.replicas = replicas


class ConfigError(GymbridgeError):
    """A configuration is invalid. ``problems`` lists every problem found."""

    def __init__(self, problems: Sequence[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s){where}:\n{lines}")


class ResumeError(ConfigError):
    """A run directory cannot be continued as asked (``path``): e.g. ``--resume`` of a run that never
    wrote a checkpoint. The message says how to start it again without losing its history."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = path
        super().__init__([f"--resume {path}: {reason}"])
