"""Head-server discovery: NeMo Gym's ``GET /global_config_dict_yaml``.

The head server answers a JSON *string* whose content is YAML: the whole
global config, ``instance -> server kind -> implementation -> {host, port, ...}``
plus ``head_server: {host, port}``. Agents are the instances whose kind is
``responses_api_agents``; a row's ``agent_ref: {type, name}`` names one (:func:`env_of_row`).

Invariant: a wildcard bind address (``0.0.0.0``, ``::``, empty) is replaced by
the head server's host, which is the address we know is reachable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import yaml

from gymbridge.errors import ProtocolError

__all__ = ["AGENT_KIND", "agent_ref", "env_of_row", "parse_global_config", "server_urls"]

AGENT_KIND = "responses_api_agents"
SERVER_KINDS = ("responses_api_agents", "resources_servers", "responses_api_models", "environment_servers")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def env_of_row(row: Mapping[str, Any]) -> str | None:
    """The environment a dataset row names: its ``agent_ref``'s ``name`` (``None``: it names none).

    The agent a head server routes the row to, the environment of a mixed run (``env.mix``), and
    the ``env`` of its failure records and per-environment metrics."""
    ref = row.get("agent_ref")
    if isinstance(ref, Mapping):
        name = ref.get("name")
        if isinstance(name, str) and name:
            return name
    return None


def agent_ref(name: str) -> dict[str, str]:
    """The ``agent_ref`` a row carries to be run by agent ``name``: ``{"type": AGENT_KIND, "name": name}``."""
    return {"type": AGENT_KIND, "name": name}


def parse_global_config(body: Any) -> dict[str, Any]:
    """The global config from a ``/global_config_dict_yaml`` body (a JSON string of YAML, or YAML)."""
    text = body if isinstance(body, str) else None
    if text is None:
        raise ProtocolError(
            f"global_config_dict_yaml: expected a JSON string of YAML, got {type(body).__name__}"
        )
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProtocolError(f"global_config_dict_yaml: invalid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ProtocolError("global_config_dict_yaml: the YAML is not a mapping")
    return config


def server_urls(config: Mapping[str, Any], head_url: str, kind: str = AGENT_KIND) -> dict[str, str]:
    """``{instance name: base URL}`` for every server of ``kind`` in the global config."""
    head_host = urlsplit(head_url).hostname or "127.0.0.1"
    urls: dict[str, str] = {}
    for instance, entry in config.items():
        if not isinstance(entry, Mapping) or kind not in entry:
            continue
        impls = entry[kind]
        if not isinstance(impls, Mapping) or not impls:
            continue
        impl = next(iter(impls.values()))
        if not isinstance(impl, Mapping) or "port" not in impl:
            continue
        host = str(impl.get("host") or "")
        if host in WILDCARD_HOSTS:
            host = head_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        urls[str(instance)] = f"http://{host}:{int(impl['port'])}"
    return urls
