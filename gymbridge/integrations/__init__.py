"""Adapters that let other RL trainers train NeMo Gym environments through gymbridge (docs/integrations.md).

* :mod:`gymbridge.integrations.trl` — TRL's ``GRPOTrainer``: an ``environment_factory`` over any
  resources server and a ``rollout_func`` over any agent's ``POST /run`` (``gymbridge[trl]``);
* :mod:`gymbridge.integrations.verl` — verl's agent loop: ``GymAgentLoop`` (``gymbridge[verl]``).

Nothing here imports a trainer package until a name that needs it is used; a missing one raises
an ``ImportError`` naming the extra to install.
"""
