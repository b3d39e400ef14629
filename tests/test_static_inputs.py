import pytest
import torch

from graphcap import InputSpec, StaticInputs


def make(max_tokens=16):
    return StaticInputs(
        [InputSpec("ids", torch.int64, 0), InputSpec("slots", torch.int64, -1), InputSpec("emb", torch.float32, 0.5, (3,))],
        max_tokens,
        "cpu",
    )


@pytest.mark.parametrize("n, bucket", [(1, 1), (3, 4), (5, 16), (16, 16)])
def test_copy_in_pads_with_declared_values(n, bucket):
    s = make()
    ids = torch.randint(1, 100, (n,))
    slots = torch.randint(0, 100, (n,))
    emb = torch.randn(n, 3)
    views = s.copy_in({"ids": ids, "slots": slots, "emb": emb}, n, bucket)
    assert views["ids"].shape == (bucket,) and views["emb"].shape == (bucket, 3)
    assert torch.equal(views["ids"][:n], ids) and torch.equal(views["slots"][:n], slots)
    assert torch.equal(views["emb"][:n], emb)
    assert (views["ids"][n:] == 0).all() and (views["slots"][n:] == -1).all() and (views["emb"][n:] == 0.5).all()
    assert views["num_real_tokens"].item() == n


def test_views_share_storage_across_steps():
    s = make()
    a = s.copy_in({"ids": torch.arange(4), "slots": torch.arange(4), "emb": torch.randn(4, 3)}, 4, 8)
    b = s.copy_in({"ids": torch.arange(2) + 7, "slots": torch.arange(2), "emb": torch.randn(2, 3)}, 2, 8)
    assert a["ids"].data_ptr() == b["ids"].data_ptr()
    assert a["ids"].tolist() == [7, 8, 0, 0, 0, 0, 0, 0]  # stale rows of the last step were re-padded


def test_bad_inputs_raise():
    s = make()
    good = {"ids": torch.arange(2), "slots": torch.arange(2), "emb": torch.randn(2, 3)}
    with pytest.raises(ValueError, match="missing"):
        s.copy_in({"ids": torch.arange(2)}, 2, 2)
    with pytest.raises(ValueError, match="unknown"):
        s.copy_in({**good, "extra": torch.arange(2)}, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        s.copy_in({**good, "emb": torch.randn(2, 4)}, 2, 2)
    with pytest.raises(ValueError, match="bucket"):
        s.copy_in(good, 2, 32)
    with pytest.raises(ValueError, match="unique"):
        StaticInputs([InputSpec("a", torch.int64), InputSpec("a", torch.int64)], 4, "cpu")
