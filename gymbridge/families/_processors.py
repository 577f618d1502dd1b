"""Loading a family's real processor class without its torchvision-only video sub-processor."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["image_only_processor", "load_image_only_processor"]

_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def image_only_processor(processor_class: type[Any]) -> type[Any]:
    """``processor_class`` (a transformers ``ProcessorMixin``) without its video sub-processor.

    Qwen2.5-VL's, Qwen3-VL's and InternVL's processors declare a video processor, whose classes
    need torchvision; the subclass declares only the image processor and tokenizer, so the real
    class's placeholder expansion runs on images (videos are refused: it has no ``video_processor``).
    """

    class ImageOnly(processor_class):  # type: ignore[misc]
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [a for a in super().get_attributes() if a != "video_processor"]

        def to_dict(self) -> dict[str, Any]:
            # a video processor set after construction is not a declared sub-processor: not saved
            out: dict[str, Any] = super().to_dict()
            out.pop("video_processor", None)
            return out

    # the real class's name: what save_pretrained writes as processor_class, so a saved processor
    # loads as the full one where torchvision is installed
    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def load_image_only_processor(path: str | Path) -> Any | None:
    """The processor saved in ``path`` as :func:`image_only_processor` of its class, or ``None``.

    The class is the ``processor_class`` its processor / preprocessor / tokenizer config names
    (a transformers class; nothing else is imported). Loaded with ``local_files_only``.
    """
    import transformers

    for name in _CONFIG_FILES:
        file = Path(path) / name
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        class_name = data.get("processor_class") if isinstance(data, dict) else None
        cls = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
        if not isinstance(cls, type) or not issubclass(cls, transformers.ProcessorMixin):
            continue
        try:
            return image_only_processor(cls).from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, ImportError, TypeError) as exc:
            logger.info("%s without its video processor did not load from %s: %s", class_name, path, exc)
            return None
    return None
