"""Tiny offline models: the ``tiny`` / ``tiny:FAMILY`` models of ``smoke run`` and ``model serve``.

Each is a family's real architecture at a tiny size (random weights from a seed) with a tokenizer
trained in code and the family's processor, so the whole loop runs on a CPU with nothing
downloaded: :mod:`.tiny_vlm` (the default Qwen2-VL), :mod:`.tiny_omni` (the Qwen2.5-Omni thinker:
images, video, audio) and :mod:`.tiny_families` (one registry of every family, ``tiny:FAMILY``
specs). They sit below generation, the trainer and the run, which build them; they import torch,
so nothing here is imported by the base (torch-free) modules.
"""
