"""Fixtures shared by the model tests."""

import shutil

import pytest


@pytest.fixture
def ckpt_copy(ckpt, tmp_path):
    """A private copy of the requesting module's ``ckpt`` checkpoint folder (to damage)."""
    dst = tmp_path / "ck"
    shutil.copytree(ckpt, dst)
    return str(dst)
