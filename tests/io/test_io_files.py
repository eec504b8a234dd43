"""kvbm_backend.io.files: the one O_DIRECT open / fallback rule of the readers (issue 23 item 1), on real files."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

from kvbm_backend.io import probe_o_direct
from kvbm_backend.io.files import ReadFiles, open_for_read
from kvbm_backend.memory import aligned_empty


def _file(tmp_path, n=3 * 4096):
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    p = tmp_path / "slab"
    p.write_bytes(data.tobytes())
    return str(p), data


def test_aligned_reads_are_direct_where_the_filesystem_takes_it(tmp_path):
    path, data = _file(tmp_path)
    direct = probe_o_direct(str(tmp_path))
    files = ReadFiles()
    try:
        buf = aligned_empty(8192)
        assert files.preadv(path, [buf], 4096, True) == 8192
        assert (buf == data[4096:]).all()
        assert files.fd(path, True)[1] is direct
        assert dict(files.counters) == ({"files_o_direct": 1} if direct else {"files_buffered": 1})
        assert files.fd(path, False)[1] is False  # a buffered fd beside it, for unaligned readers
    finally:
        files.close()


def test_a_read_refused_on_an_o_direct_fd_is_retried_buffered_and_stays_buffered(tmp_path):
    path, data = _file(tmp_path)
    if not probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT at open (the other branch)")
    files = ReadFiles(Counter())
    try:
        raw = aligned_empty(4096 + 1)
        odd = raw[1:]  # not 4 KiB aligned: an O_DIRECT read of it is EINVAL
        assert files.preadv(path, [odd], 0, True) == 4096
        assert (odd == data[:4096]).all()
        assert dict(files.counters) == {"files_o_direct": 0, "files_buffered": 1}
        assert files.fd(path, True)[1] is False  # the path reads buffered from now on
    finally:
        files.close()
    assert files.open_fds() == []


def test_open_for_read_says_which_mode_it_got(tmp_path):
    path, _ = _file(tmp_path)
    fd, direct = open_for_read(path, True)
    try:
        assert direct is probe_o_direct(str(tmp_path))
        assert os.fstat(fd).st_size == 3 * 4096
    finally:
        os.close(fd)
    fd, direct = open_for_read(path, False)
    os.close(fd)
    assert direct is False
