"""The command line: every subcommand's help, and `inspect` on a store the test fills."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.cli import inspect_store, main


@pytest.mark.parametrize("command", ["demo", "bench", "inspect"])
def test_help_of_each_subcommand(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"tiercache {command}" in out
    assert {"demo": "--quick", "bench": "--only", "inspect": "path"}[command] in out


def test_module_entry_point_runs() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tiercache", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    assert "inspect" in r.stdout


async def _fill(root: Path, model: str, num_pages: int) -> None:
    cfg = TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        page_size=16,
        device_tokens=1024,
        storage_url=f"file://{root}",
        model=model,
    )
    async with TierCache(cfg) as cache:
        tokens = list(range(num_pages * 16))
        async with cache.request(tokens) as req:
            slots = await req.alloc(len(tokens))
            await req.commit(tokens, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()


@pytest.mark.allow_blocking
def test_inspect_counts_pages_per_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    asyncio.run(_fill(tmp_path, "model-a", 3))
    asyncio.run(_fill(tmp_path, "model-b", 2))
    (tmp_path / "junk.page").write_bytes(b"not a page")
    info = inspect_store(tmp_path)
    assert info["pages"] == 6
    assert info["damaged"] == 1
    groups = info["groups"]
    assert isinstance(groups, list)
    assert sorted(g["pages"] for g in groups) == [2, 3]
    assert len({g["namespace"] for g in groups}) == 2
    assert sum(g["bytes"] for g in groups) + len(b"not a page") == info["bytes"]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pages: 6" in out and "damaged: 1" in out


def test_inspect_missing_dir(tmp_path: Path) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2


def test_inspect_counts_what_is_no_page_file_as_damaged_without_blocking(tmp_path: Path) -> None:
    import os

    shard = tmp_path / "ab"
    shard.mkdir()
    (shard / "real.page").write_bytes(b"not a page either")
    os.mkfifo(shard / "fifo.page")  # opened plainly, a fifo blocks until a writer comes
    (shard / "dangling.page").symlink_to(tmp_path / "gone")
    (shard / "outside.page").symlink_to(tmp_path / "ab" / "real.page")
    info = inspect_store(tmp_path)
    assert info["pages"] == 4
    assert info["damaged"] == 4
    assert info["bytes"] == len(b"not a page either")
    assert main(["inspect", str(tmp_path)]) == 0


def test_inspect_counts_directories_as_damaged_and_older_pages_as_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the file backend reads them: anything but a regular file is damaged; an older
    format version is a stale page (a plain miss), not damage."""
    import os
    import struct

    from tiercache.storage.format import encode_header

    shard = tmp_path / "ab"
    shard.mkdir()
    (shard / "dir.page").mkdir()
    (shard / "dir.page" / "inner.page").write_bytes(b"not walked into")
    (shard / "link.page").symlink_to(tmp_path)  # a link to a directory
    old = bytearray(encode_header("k-ab", "f", 4, 0, 4096) + b"abcd")
    struct.pack_into("<H", old, 4, 2)  # format version 2
    (shard / "old.page").write_bytes(bytes(old))
    struct.pack_into("<H", old, 4, 99)  # a later version, from an upgraded process
    (shard / "new.page").write_bytes(bytes(old))
    info = inspect_store(tmp_path)
    assert (info["pages"], info["damaged"], info["stale"], info["newer"]) == (4, 2, 1, 1)
    assert info["bytes"] == 2 * len(old) and info["groups"] == []
    assert main(["inspect", str(tmp_path)]) == 0
    assert "damaged: 2  stale: 1  newer: 1" in capsys.readouterr().out
    assert os.path.isdir(shard / "dir.page")  # inspecting changes nothing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "0"], "must be at least 1"),
        (["--clients", "-3"], "must be at least 1"),
        (["--clients", "x"], "invalid"),
        (["--metrics-port", "70000"], "a port is 0 to 65535"),
        (["--metrics-port", "-1"], "a port is 0 to 65535"),
    ],
)
def test_demo_refuses_bad_numbers_as_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad number is a usage error (exit 2, one line), never a traceback from the demo."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--quick", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_a_file_as_its_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    assert main(["demo", "--quick", "--no-progress", "--dir", str(target)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert target.read_text() == "keep me"


@pytest.mark.allow_blocking
def test_inspect_takes_the_storage_url_of_a_file_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``storage_url`` an operator configured names the same store as its path."""
    import asyncio

    asyncio.run(_fill(tmp_path, "model-a", 2))
    for url in (f"file://{tmp_path}", f"file://localhost{tmp_path}", f"file://{tmp_path}?fsync=1"):
        assert main(["inspect", url]) == 0
        assert "pages: 2" in capsys.readouterr().out
    for bad in ("redis://localhost:6379/0", f"file://otherhost{tmp_path}"):
        assert main(["inspect", bad]) == 2
        assert bad in capsys.readouterr().err


def test_demo_metrics_addr_without_a_port_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--metrics-addr alone served nothing and said nothing."""
    argv = ["demo", "--quick", "--no-progress", "--dir", str(tmp_path), "--metrics-addr", "0.0.0.0"]
    assert main(argv) == 2
    assert "--metrics-addr needs --metrics-port" in capsys.readouterr().err
    assert not (tmp_path / "demo.json").exists()


def test_demo_dir_that_cannot_be_created_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"  # under a file: never a directory
    assert main(["demo", "--quick", "--no-progress", "--dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cannot create --dir" in err and str(out) in err
