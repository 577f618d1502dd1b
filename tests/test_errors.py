"""The error tree: shape, context carried, retry classification."""

from __future__ import annotations

import pytest

from gymbridge import errors as E


@pytest.mark.parametrize(
    ("cls", "parent"),
    [
        (E.ProtocolError, E.GymbridgeError),
        (E.MediaError, E.GymbridgeError),
        (E.MediaPolicyError, E.MediaError),
        (E.MediaFetchError, E.MediaError),
        (E.MediaDecodeError, E.MediaError),
        (E.TrajectoryError, E.GymbridgeError),
        (E.EnvServerError, E.EnvError),
        (E.EnvTransportError, E.EnvError),
        (E.EnvTimeoutError, E.EnvError),
        (E.EnvError, E.GymbridgeError),
        (E.CheckEnvError, E.EnvError),
        (E.ConfigError, E.GymbridgeError),
        (E.BridgeError, E.GymbridgeError),
        (E.BridgeStalledError, E.BridgeError),
        (E.CheckpointError, E.GymbridgeError),
        (E.TrainingError, E.GymbridgeError),
        (E.PolicyDriftError, E.TrainingError),
        (E.SamplingMismatchError, E.TrainingError),
        (E.WeightSyncError, E.TrainingError),
        (E.JsonTooDeepError, E.ProtocolError),
        (E.EnvSessionLostError, E.EnvServerError),
        (E.EnvFaultError, E.EnvError),
        (E.GeneratorProcessError, E.TrainingError),
        (E.IntegrationError, E.GymbridgeError),
        (E.ChatTemplateMediaError, E.IntegrationError),
        (E.UntrainableRolloutError, E.IntegrationError),
    ],
)
def test_tree(cls: type[Exception], parent: type[Exception]) -> None:
    assert issubclass(cls, parent)
    assert cls.__name__ in (E.__doc__ or "")


def test_policy_drift_error_says_the_weights_are_not_the_trainers() -> None:
    err = E.PolicyDriftError(ratio_mean=1.023, ratio_max_abs_log=0.4, tolerance=1e-2, step=3)
    assert (err.ratio_mean, err.tolerance, err.step) == (1.023, 1e-2, 3)
    assert "the generator's weights are not the trainer's" in str(err)
    assert "1.023" in str(err)


def test_trajectory_error_names_item() -> None:
    err = E.TrajectoryError("logprobs length 3 != generation length 4", item_index=5)
    assert err.item_index == 5
    assert "output item 5" in str(err)


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(500, True), (503, True), (408, True), (429, True), (400, False), (422, False), (404, False)],
)
def test_server_error_retry_class(status: int, retryable: bool) -> None:
    assert E.EnvServerError("x", status=status).retryable is retryable


def test_config_error_lists_every_problem() -> None:
    err = E.ConfigError(["a: missing", "b: must be > 0"], source="cfg.yaml")
    assert err.problems == ["a: missing", "b: must be > 0"]
    assert "a: missing" in str(err) and "b: must be > 0" in str(err) and "cfg.yaml" in str(err)


def test_media_fetch_error_carries_retryable() -> None:
    assert E.MediaFetchError("timeout", source="http://x", retryable=True).retryable


def test_env_fault_error_carries_route_tool_status_and_its_0_7_0_kind() -> None:
    from gymbridge.faults import env_fault

    fault = env_fault("/zoom", tool="zoom", status=502, body="<html>Bad Gateway</html>")
    assert (fault.route, fault.tool, fault.status, fault.failure_kind) == (
        "/zoom",
        "zoom",
        502,
        "transport_unreachable",
    )
    assert str(fault) == "environment fault: tool 'zoom' answered HTTP 502: <html>Bad Gateway</html>"
    assert fault.failure_class == "env_fault"
    dropped = env_fault("/step", error=E.EnvTransportError("reset by peer", reached=True))
    assert (dropped.tool, dropped.status, dropped.failure_kind) == (None, None, "transport_peer_drop")
    refused = env_fault("/zoom", tool="zoom", error=E.EnvTransportError("refused", reached=False))
    assert refused.failure_kind == "transport_unreachable"
    late = env_fault("/zoom", tool="zoom", error=E.EnvTimeoutError("no answer within 120s"))
    assert late.failure_kind == "transport_timeout" and "passed its deadline" in str(late)
    with pytest.raises(ValueError, match="tool's own answer"):
        env_fault("/zoom", tool="zoom", status=500)


def test_untrainable_rollout_error_names_the_rollout_and_refuses_an_unknown_reason() -> None:
    err = E.UntrainableRolloutError("an image after the first model call", reason="mid_episode_media", row=3)
    assert (err.reason, err.row) == ("mid_episode_media", 3)
    assert str(err).startswith("rollout 3: ")
    with pytest.raises(ValueError, match="unknown reason"):
        E.UntrainableRolloutError("x", reason="bad")
