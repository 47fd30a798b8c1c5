from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def spawn():
    """Start real Python processes from the repository root; kill whatever is left at the end."""
    started: list[subprocess.Popen] = []

    def start(*args: str, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


class SmallDisk:
    """A real tmpfs of `size` bytes mounted for one test; `fill()` takes every free byte, `free()` gives them back."""

    def __init__(self, path: str):
        self.path = path
        self._filler = os.path.join(path, "filler")
        self._inodes = 0

    def fill(self) -> None:
        with open(self._filler, "ab", buffering=0) as f:
            for chunk in (1 << 16, 1 << 12, 1):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * chunk)
        # and every inode: on a full disk a new folder needs space too (tmpfs counts inodes only)
        with contextlib.suppress(OSError):
            while True:
                self._inodes += 1
                open(f"{self._filler}-{self._inodes}", "xb").close()

    def free_one_inode(self) -> None:
        """Give back one inode and no byte: room for a name (a hard link), none for data."""
        os.remove(f"{self._filler}-1")

    def free(self) -> None:
        for index in range(self._inodes + 1):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{self._filler}-{index}" if index else self._filler)
        self._inodes = 0


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of 512 inodes at tmp_path/disk; skips (saying why) where mounting needs root we do not have."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill a disk needs root: run as root (CI does) to test full disks")
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=512", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the full-disk tests need it")
    try:
        yield SmallDisk(str(path))
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
