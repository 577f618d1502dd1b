"""``replace_inline_media``: inline media of items swapped through a callback, nothing mutated."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gymbridge.protocol import inline_media_urls, media_refs_of_content, replace_inline_media

DATA = st.sampled_from(
    ["data:image/png;base64,iVBORw0KGgo=", "data:audio/wav;base64,UklGRg==", "data:video/mp4;base64,AAAA"]
)
OTHER = st.sampled_from(
    ["http://example.com/a.png", "file:///tmp/x.png", "http://127.0.0.1:9/media/" + "a" * 64]
)


def _part(url: str, spelling: int) -> dict[str, Any]:
    modality = url[5:10].split("/")[0] if url.startswith("data:") else "image"
    kind = {"image": "input_image", "audio": "input_audio", "video": "input_video"}[modality]
    key = {"image": "image_url", "audio": "audio_url", "video": "video_url"}[modality]
    if spelling == 0:
        return {"type": kind, key: url, "detail": "auto"}
    if spelling == 1:
        return {"type": kind, key: {"url": url}}
    return {"type": modality, modality: url}


PART = st.one_of(
    st.builds(_part, st.one_of(DATA, OTHER), st.integers(0, 2)),
    st.just({"type": "input_text", "text": "hi"}),
)
ITEM = st.one_of(
    st.builds(
        lambda parts: {"type": "message", "role": "user", "content": parts}, st.lists(PART, max_size=4)
    ),
    st.builds(
        lambda parts: {"type": "function_call_output", "call_id": "c", "output": parts},
        st.lists(PART, max_size=3),
    ),
    st.just({"type": "function_call_output", "call_id": "c", "output": "data:image/png;base64,iVBORw0KGgo="}),
    st.just({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
    st.just({"role": "user", "content": "plain text"}),
)


def _refs(items: list[Any]) -> list[str]:
    out: list[str] = []
    for item in items:
        parts = item.get("content") if item.get("type", "message") == "message" else item.get("output")
        out.extend(source for source, _ in media_refs_of_content(parts))
    return out


@given(items=st.lists(ITEM, max_size=5))
def test_every_inline_medium_is_replaced_in_place_and_nothing_is_mutated(items: list[Any]) -> None:
    before = copy.deepcopy(items)
    seen: list[str] = []

    def reference(url: str) -> str:
        seen.append(url)
        return f"http://store/media/{len(seen)}"

    out = replace_inline_media(items, reference)
    assert items == before  # never mutated
    assert seen == inline_media_urls(items)
    assert len(out) == len(items)
    # every media part keeps its position; only inline ones changed, to their reference
    replaced = iter(f"http://store/media/{i}" for i in range(1, len(seen) + 1))
    want = [next(replaced) if url.startswith("data:") else url for url in _refs(items)]
    assert _refs(out) == want
    # a bare data-URL tool output string is not a part: it stays
    for a, b in zip(items, out, strict=True):
        if isinstance(a.get("output"), str):
            assert b is a
    # untouched items are the same objects
    for a, b in zip(items, out, strict=True):
        if not any(u.startswith("data:") for u in _refs([a])):
            assert b is a


@given(items=st.lists(ITEM, max_size=5))
def test_a_callback_keeping_everything_inline_returns_the_same_list(items: list[Any]) -> None:
    assert replace_inline_media(items, lambda url: None) is items
