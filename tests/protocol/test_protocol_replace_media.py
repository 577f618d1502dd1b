"""inline_media_sources / replace_media_sources: the one walk of replaceable inline media parts."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gymbridge.protocol import inline_media_sources, replace_media_sources

DATA = "data:image/png;base64,iVBORw0KGgo="

PART = st.sampled_from(
    [
        {"type": "input_text", "text": DATA},  # text is never media
        {"type": "input_image", "image_url": DATA},
        {"type": "input_image", "image_url": "https://example.com/a.png"},
        {"type": "image_url", "image_url": {"url": DATA, "detail": "low"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},  # no URL slot
        {"type": "input_image", "file_id": "f"},  # unusable: left to the reader's own error
    ]
)
ITEM = st.one_of(
    st.builds(lambda parts: {"role": "user", "content": parts}, st.lists(PART, max_size=3)),
    st.builds(
        lambda parts: {"type": "function_call_output", "call_id": "c", "output": parts},
        st.lists(PART, max_size=3),
    ),
    st.just({"type": "function_call_output", "call_id": "c", "output": DATA}),  # bare string: stays
    st.just({"role": "user", "content": "plain"}),
)


@given(st.lists(ITEM, max_size=4))
def test_replacing_every_inline_source_leaves_no_data_url_and_mutates_nothing(items: list[Any]) -> None:
    before = copy.deepcopy(items)
    sources = list(inline_media_sources(items))
    out = replace_media_sources(items, {s: "http://127.0.0.1:1/media/" + "a" * 64 for s in sources})
    assert items == before
    assert list(inline_media_sources(out)) == []
    if not sources:
        assert out is items
    for old, new in zip(items, out, strict=True):
        if old is not new:  # only items that held a replaced part are new objects
            assert "http://127.0.0.1:1/media/" in json.dumps(new)
        else:
            assert "http://127.0.0.1:1/media/" not in json.dumps(new)
    assert replace_media_sources(items, {}) is items
