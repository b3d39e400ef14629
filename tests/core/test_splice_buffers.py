"""SpliceBuffers and the caches' directory (CPU)."""

import os

import pytest
import torch

from graphcap.splice_buffers import SpliceBuffers
from graphcap.startup import jit_cache


def test_views_share_one_allocation_at_the_ceiling():
    b = SpliceBuffers(16, "cpu")
    b.add("q", (2, 4), torch.float32)
    b.add("q", (2, 4), torch.float32)  # a second layer declaring the same role keeps the buffer
    v3, v16 = b.view("q", 3), b.view("q", 16)
    assert v3.shape == (3, 2, 4) and v3.data_ptr() == v16.data_ptr() and v3.is_contiguous()
    assert b.nbytes == 16 * 2 * 4 * 4
    with pytest.raises(ValueError, match="cannot add it again"):
        b.add("q", (2, 8), torch.float32)
    with pytest.raises(ValueError, match="exceed"):
        b.view("q", 17)
    with pytest.raises(KeyError, match="declare it"):
        b.view("k", 1)


def test_cache_dir_defaults_overrides_and_respects_user_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAPHCAP_CACHE_DIR", raising=False)
    assert jit_cache.cache_dir() == jit_cache.Path.home() / ".cache" / "graphcap"
    monkeypatch.setenv("GRAPHCAP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", "/users/own/choice")
    assert jit_cache.configure() == tmp_path
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == "/users/own/choice"  # the user's setting wins
    assert jit_cache.kernel_choices_file() == tmp_path / "kernel_choices.json"
