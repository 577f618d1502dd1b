"""Local files: allowed roots after realpath (symlinks, ``..``), regular files only, size caps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from media_assets import png_bytes

from gymbridge.errors import MediaFetchError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, load_media


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    (r / "img.png").write_bytes(png_bytes())
    return r


def test_every_local_path_is_refused_by_default(root: Path) -> None:
    for source in (str(root / "img.png"), (root / "img.png").as_uri()):
        with pytest.raises(MediaPolicyError, match="allowed_local_roots is empty") as info:
            load_media(source, "image")
        assert "img.png" in str(info.value)


def test_path_and_file_url_under_a_root_load(root: Path) -> None:
    policy = MediaPolicy(allowed_local_roots=(root,))
    by_path = load_media(str(root / "img.png"), "image", policy)
    by_url = load_media((root / "img.png").as_uri(), "image", policy)
    by_pathlib = load_media(root / "img.png", "image", policy)
    assert by_path.raw == by_url.raw == by_pathlib.raw == png_bytes()
    assert by_path.key == by_url.key
    assert by_path.image().size == (24, 16)


def test_file_url_with_percent_encoding(root: Path) -> None:
    (root / "a b#c.png").write_bytes(png_bytes())
    policy = MediaPolicy(allowed_local_roots=(root,))
    item = load_media((root / "a b#c.png").as_uri(), "image", policy)
    assert item.nbytes == len(png_bytes())


def test_path_outside_every_root_is_refused_naming_the_root(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes())
    with pytest.raises(MediaPolicyError, match="outside every allowed_local_roots") as info:
        load_media(str(outside), "image", MediaPolicy(allowed_local_roots=(root,)))
    assert str(root) in str(info.value) and "outside.png" in str(info.value)


def test_dotdot_escape_is_refused(root: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.png").write_bytes(png_bytes())
    sneaky = f"{root}/../secret.png"
    with pytest.raises(MediaPolicyError, match="outside every allowed_local_roots"):
        load_media(sneaky, "image", MediaPolicy(allowed_local_roots=(root,)))
    with pytest.raises(MediaPolicyError, match="outside every allowed_local_roots"):
        load_media(f"file://{root}/../secret.png", "image", MediaPolicy(allowed_local_roots=(root,)))


def test_symlink_escaping_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes())
    (root / "link.png").symlink_to(secret)
    (root / "dirlink").symlink_to(tmp_path)
    policy = MediaPolicy(allowed_local_roots=(root,))
    with pytest.raises(MediaPolicyError, match=r"secret\.png"):
        load_media(str(root / "link.png"), "image", policy)
    with pytest.raises(MediaPolicyError, match="outside every allowed_local_roots"):
        load_media(str(root / "dirlink" / "secret.png"), "image", policy)


def test_symlink_inside_the_root_is_fine(root: Path) -> None:
    (root / "alias.png").symlink_to(root / "img.png")
    item = load_media(str(root / "alias.png"), "image", MediaPolicy(allowed_local_roots=(root,)))
    assert item.raw == png_bytes()


def test_root_given_through_a_symlink_still_matches(root: Path, tmp_path: Path) -> None:
    (tmp_path / "rootlink").symlink_to(root)
    policy = MediaPolicy(allowed_local_roots=(tmp_path / "rootlink",))
    assert load_media(str(root / "img.png"), "image", policy).nbytes == len(png_bytes())


def test_sibling_directory_with_common_prefix_is_refused(root: Path, tmp_path: Path) -> None:
    sibling = tmp_path / "root2"
    sibling.mkdir()
    (sibling / "img.png").write_bytes(png_bytes())
    with pytest.raises(MediaPolicyError):
        load_media(str(sibling / "img.png"), "image", MediaPolicy(allowed_local_roots=(root,)))


def test_missing_file_is_a_permanent_fetch_error(root: Path) -> None:
    with pytest.raises(MediaFetchError, match="does not exist") as info:
        load_media(str(root / "nope.png"), "image", MediaPolicy(allowed_local_roots=(root,)))
    assert info.value.retryable is False


def test_directory_and_fifo_are_refused_without_hanging(root: Path) -> None:
    policy = MediaPolicy(allowed_local_roots=(root,))
    with pytest.raises(MediaPolicyError, match="not a regular file"):
        load_media(str(root), "image", policy)
    fifo = root / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(MediaPolicyError, match="not a regular file"):
        load_media(str(fifo), "image", policy)


def test_oversize_file_is_refused_before_reading(root: Path) -> None:
    big = root / "big.bin"
    with big.open("wb") as f:
        f.truncate(10 * 2**20)  # sparse: costs no disk
    with pytest.raises(MediaPolicyError, match=r"10485760 bytes, over max_encoded_bytes=1048576"):
        load_media(str(big), "image", MediaPolicy(allowed_local_roots=(root,), max_encoded_bytes=2**20))


def test_lazy_item_checks_the_root_at_creation_and_reads_on_first_access(root: Path) -> None:
    policy = MediaPolicy(allowed_local_roots=(root,))
    with pytest.raises(MediaPolicyError):
        MediaItem.from_ref("/etc/passwd", "image", policy)
    item = MediaItem.from_ref(str(root / "img.png"), "image", policy)
    assert not item.loaded
    (root / "img.png").write_bytes(png_bytes(width=5, height=5))  # changed after from_ref: read now
    assert item.image().size == (5, 5)
    assert item.loaded


def test_file_swapped_between_check_and_open_is_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Race: the path passes the realpath check, then becomes a link out of the root before open."""
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes())
    target = root / "swap.png"
    target.write_bytes(png_bytes())
    real_open = os.open

    def swapping_open(path: str, flags: int, *args: int) -> int:
        if path == str(target):
            target.unlink()
            target.symlink_to(secret)  # the attacker wins the race
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", swapping_open)
    if not Path("/proc/self/fd").exists():
        pytest.skip("needs /proc/self/fd")
    with pytest.raises(MediaPolicyError, match="changed while being opened"):
        load_media(str(target), "image", MediaPolicy(allowed_local_roots=(root,)))
