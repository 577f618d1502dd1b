"""zoom_read resources server: ``zoom(bbox)`` returns an image crop; ``answer(value)`` ends.

``/seed_session`` stores the row's scene in the session; the full canvas is rendered
once per distinct scene (a small LRU shared by sessions; concurrent sessions of one
prompt await the same render, so G rollouts render it once) in a worker thread, off the
event loop, as are the crops. ``zoom`` answers a
:class:`~gymbridge.server.ToolOutput`: a text line plus the crop as an ``input_image``
part (a JSON list of parts; a stock agent passes that text through, gymbridge's agent
shows the image). ``answer`` records the first answer; later zooms or answers are
refused. ``verify`` scores the first ``answer`` call of the rollout.

Invariants: at most ``max_zooms`` crops per session (bounded work per rollout); the LRU
holds at most ``canvas_cache_size`` canvases (bounded memory); a bad bbox comes back to
the model as a 422 error body naming the problem.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Annotated, Any

import orjson
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import HttpError, ResourcesServer, Session, ToolOutput, VerifyResult, image_part, tool
from gymbridge_envs._common import first_call_arguments, png_bytes
from gymbridge_envs._server_common import parse_task, require_state
from gymbridge_envs.zoom_read.data import answer_reward, clamp_bbox, crop, render

__all__ = ["ZoomReadServer"]


class TextItem(BaseModel):
    text: str
    x: int
    y: int
    font_size: int = Field(gt=0, le=200)
    color: list[int] = Field(min_length=3, max_length=3)
    box: bool = False


class Shape(BaseModel):
    kind: str
    bbox: list[int] = Field(min_length=4, max_length=4)
    color: list[int] = Field(min_length=3, max_length=3)


class Scene(BaseModel):
    canvas_size: int = Field(gt=0, le=8192)
    shapes: list[Shape] = Field(default_factory=list)
    items: list[TextItem] = Field(min_length=1)


class ZoomReadTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    scene: Scene
    target_value: str
    zoom_size: int = Field(default=256, gt=0, le=2048)


def _crop_png(
    canvas: Image.Image, box: tuple[int, int, int, int], zoom_size: int
) -> tuple[Image.Image, bytes]:
    image = crop(canvas, box, zoom_size)
    return image, png_bytes(image)


class ZoomReadServer(ResourcesServer):
    """Find the boxed number on a large canvas by zooming, then answer it."""

    def __init__(
        self, *, instance_name: str | None = None, max_zooms: int = 16, canvas_cache_size: int = 32
    ) -> None:
        super().__init__(instance_name=instance_name)
        self.max_zooms = max_zooms
        self.canvas_cache_size = canvas_cache_size
        self._canvases: OrderedDict[str, Image.Image] = OrderedDict()
        self._rendering: dict[str, asyncio.Future[Image.Image]] = {}

    async def _canvas(self, scene: dict[str, Any]) -> Image.Image:
        key = hashlib.sha256(orjson.dumps(scene, option=orjson.OPT_SORT_KEYS)).hexdigest()
        found = self._canvases.get(key)
        if found is not None:
            self._canvases.move_to_end(key)
            return found
        pending = self._rendering.get(key)
        if pending is None:  # the first session to ask renders; concurrent ones await the same task
            pending = asyncio.ensure_future(asyncio.to_thread(render, scene))
            self._rendering[key] = pending
        try:
            canvas = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._rendering.pop(key, None)
        self._canvases[key] = canvas
        while len(self._canvases) > self.canvas_cache_size:
            self._canvases.popitem(last=False)
        return canvas

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        task = parse_task(row, ZoomReadTask)
        session.state.update(scene=task.scene.model_dump(), zoom_size=task.zoom_size, zooms=0, answer=None)
        return {}

    @tool
    async def zoom(
        self,
        session: Session,
        bbox: Annotated[
            list[int],
            Field(min_length=4, max_length=4, description="[x0, y0, x1, y1] in canvas pixel coordinates"),
        ],
    ) -> ToolOutput:
        """Return a full-resolution image of the canvas region bbox = [x0, y0, x1, y1] (canvas pixels)."""
        scene = require_state(session, "scene", "POST /seed_session with the row first")
        if session.state.get("answer") is not None:
            raise HttpError(409, {"detail": "the task is over: answer was already called"})
        if session.state["zooms"] >= self.max_zooms:
            raise HttpError(429, {"detail": f"zoom limit reached ({self.max_zooms} per task); call answer"})
        try:
            box = clamp_bbox(bbox, int(scene["canvas_size"]))
        except ValueError as exc:
            raise HttpError(422, {"detail": str(exc)}) from None
        canvas = await self._canvas(scene)
        image, png = await asyncio.to_thread(_crop_png, canvas, box, int(session.state["zoom_size"]))
        session.state["zooms"] += 1
        text = (
            f"Region {list(box)} of the {canvas.width}x{canvas.height} canvas, "
            f"shown at {image.width}x{image.height}."
        )
        return ToolOutput(text=text, media=[image_part(png)])

    @tool
    async def answer(
        self,
        session: Session,
        value: Annotated[str | int, Field(description="the digits of the number, e.g. '4821'")],
    ) -> dict[str, Any]:
        """Give the number written in the red box. Ends the task."""
        require_state(session, "scene", "POST /seed_session with the row first")
        if session.state.get("answer") is not None:
            raise HttpError(409, {"detail": "answer was already called; only the first answer counts"})
        session.state["answer"] = str(value)
        return {"recorded": str(value), "done": True}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, ZoomReadTask)
        args = first_call_arguments(response["output"], "answer")
        answered = args.get("value") if args is not None else None
        if answered is None:
            answered = session.state.get("answer")
        reward = answer_reward(task.target_value, answered)
        return VerifyResult(
            reward=reward,
            extra={
                "answered": None if answered is None else str(answered),
                "num_zooms": session.state.get("zooms"),
            },
        )
