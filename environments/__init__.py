"""The example environments built on :mod:`gymbridge.server`, and their registry.

=============  ==========  =========  ==============================================
name           modality    style      task
=============  ==========  =========  ==============================================
color_pick     image       tools      one word: the image's colour (or a ``look`` tool's)
circle_click   image       tools      ``click(x, y)`` inside the named circle
side_pick      image       tools      one letter: the side a bar lies along
zoom_read      image       tools      ``zoom(bbox)`` crops, then ``answer(value)``
beep_count     audio       tools      count beeps in a WAV (``metadata.audio_data``)
bouncing_ball  video       tools      count bounces in an MP4 (``input_video``)
counter        text        tools      stateful ``increment_counter`` / ``get_counter_value``
grid_door      image       gymnasium  ``/reset`` + ``/step``, ``<action>up</action>``
=============  ==========  =========  ==============================================

Importing this package is cheap: generators and servers load on first use through
:func:`get_env` (see :mod:`gymbridge_envs.registry`). Generated rows are in the stock
NeMo Gym row shape and every generator is deterministic in ``(seed, index, params)``.
"""

from __future__ import annotations

from gymbridge_envs.registry import ENVIRONMENTS, EnvSpec, get_env, list_envs

__all__ = ["ENVIRONMENTS", "EnvSpec", "get_env", "list_envs"]
