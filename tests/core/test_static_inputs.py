import pytest
import torch

from graphcap import InputSpec, Padding, StaticInputs


def P(n, rows):  # noqa: N802 - a segmented padding of n tokens (one request) in rows
    return Padding(n, 1, rows, 1)


def make(max_tokens=16):
    return StaticInputs(
        [InputSpec("ids", torch.int64, 0), InputSpec("slots", torch.int64, -1),
         InputSpec("emb", torch.float32, 0.5, (3,))],
        max_tokens,
        "cpu",
    )


@pytest.mark.parametrize("n, bucket", [(1, 1), (3, 4), (5, 16), (16, 16)])
def test_copy_in_pads_with_declared_values(n, bucket):
    s = make()
    ids = torch.randint(1, 100, (n,))
    slots = torch.randint(0, 100, (n,))
    emb = torch.randn(n, 3)
    views = s.copy_in({"ids": ids, "slots": slots, "emb": emb}, P(n, bucket))
    assert views["ids"].shape == (bucket,) and views["emb"].shape == (bucket, 3)
    assert torch.equal(views["ids"][:n], ids) and torch.equal(views["slots"][:n], slots)
    assert torch.equal(views["emb"][:n], emb)
    assert (views["ids"][n:] == 0).all() and (views["slots"][n:] == -1).all() and (views["emb"][n:] == 0.5).all()
    assert views["num_real_tokens"].item() == n


def test_views_share_storage_across_steps():
    s = make()
    a = s.copy_in({"ids": torch.arange(4), "slots": torch.arange(4), "emb": torch.randn(4, 3)}, P(4, 8))
    b = s.copy_in({"ids": torch.arange(2) + 7, "slots": torch.arange(2), "emb": torch.randn(2, 3)}, P(2, 8))
    assert a["ids"].data_ptr() == b["ids"].data_ptr()
    assert a["ids"].tolist() == [7, 8, 0, 0, 0, 0, 0, 0]  # stale rows of the last step were re-padded


def test_bad_inputs_raise():
    s = make()
    good = {"ids": torch.arange(2), "slots": torch.arange(2), "emb": torch.randn(2, 3)}
    with pytest.raises(ValueError, match="missing"):
        s.copy_in({"ids": torch.arange(2)}, P(2, 2))
    with pytest.raises(ValueError, match="unknown"):
        s.copy_in({**good, "extra": torch.arange(2)}, P(2, 2))
    with pytest.raises(ValueError, match="shape"):
        s.copy_in({**good, "emb": torch.randn(2, 4)}, P(2, 2))
    with pytest.raises(ValueError, match="static buffers hold 16"):
        s.copy_in(good, P(2, 32))
    with pytest.raises(ValueError, match="unique"):
        StaticInputs([InputSpec("a", torch.int64), InputSpec("a", torch.int64)], 4, "cpu")


def test_external_inputs_alias_their_buffer_and_are_never_copied():
    owner = torch.full((16,), -1, dtype=torch.int64)  # e.g. the metadata's slot mapping, padded by its owner
    s = StaticInputs([InputSpec("ids", torch.int64, 0), InputSpec.external("slots", owner)], 16, "cpu")
    owner[:3] = torch.tensor([5, 6, 7])
    views = s.copy_in({"ids": torch.arange(3), "slots": owner[:3]}, P(3, 4))
    assert views["slots"].data_ptr() == owner.data_ptr() and views["slots"].tolist() == [5, 6, 7, -1]
    assert s.tensors()["slots"] is owner
    with pytest.raises(ValueError, match="must be a view .* of the external buffer"):
        s.copy_in({"ids": torch.arange(3), "slots": torch.tensor([5, 6, 7])}, P(3, 4))
    with pytest.raises(ValueError, match="pad_value for an owned input, or an external buffer"):
        InputSpec("x", torch.int64, None)
    with pytest.raises(ValueError, match="does not match dtype"):
        InputSpec("x", torch.int32, None, (), owner)
    with pytest.raises(ValueError, match="needs >= 32 rows"):
        StaticInputs([InputSpec.external("slots", owner)], 32, "cpu")
